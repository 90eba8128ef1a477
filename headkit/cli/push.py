"""``headkit push CHECKPOINT REPO_ID``: upload a checkpoint folder and its model card to the
Hugging Face hub (``headkit.checkpoint.hub``); ``--dry-run --output DIR`` writes what would be
uploaded instead. The checkpoint is loaded only to be saved again with its backbone
(``--include-backbone``), on ``--device``; otherwise its files are copied. Importing this
module imports argparse only; ``run`` imports the rest.
"""

from __future__ import annotations

import argparse

from .options import add_quiet

HELP = "upload a checkpoint and its model card to the Hugging Face hub"
EXAMPLE = """example:
  headkit push runs/sentiment my-org/sentiment-probe
  headkit push runs/sentiment my-org/sentiment-probe --dry-run --output staged/
a backbone referenced from a local folder is refused unless --include-backbone uploads it too;
the token comes from --token, HF_TOKEN or `hf auth login`"""
DEVICE_HELP = (
    "where the checkpoint is loaded to be saved again with --include-backbone (what is "
    "uploaded is the same on any device; without it nothing is loaded)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("repo_id", metavar="REPO_ID", help="'name' or 'org/name'")
    p.add_argument(
        "--include-backbone", action="store_true", help="upload the backbone with the heads"
    )
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", help="the branch to push to (default: main)")
    p.add_argument("--commit-message")
    p.add_argument("--create-pr", action="store_true", help="open a pull request instead")
    p.add_argument("--token", help="hub token (default: HF_TOKEN or the saved login)")
    p.add_argument("--dry-run", action="store_true", help="stage only; upload nothing")
    p.add_argument("--output", help="where to write the staged folder (a new or empty folder)")
    add_quiet(p)


def run(args: argparse.Namespace) -> None:
    from ..checkpoint.hub import push_to_hub
    from ..errors import ConfigError
    from ..model.headed import HeadedModel
    from .options import resolve_device

    device = resolve_device(args.device)  # before anything is loaded or written
    if args.output and not args.dry_run:
        raise ConfigError("--output is where --dry-run writes the staged folder; add --dry-run")
    if args.output:
        from .outputs import check_output_folder, local_inputs

        check_output_folder(
            args.output,
            local_inputs(args.checkpoint),
            overwrite=False,
            ours=lambda folder: False,
            what="a staged folder (--output must be new or empty)",
        )
    result = push_to_hub(
        args.checkpoint,
        args.repo_id,
        include_backbone=args.include_backbone,
        private=True if args.private else None,
        token=args.token,
        revision=args.revision,
        commit_message=args.commit_message,
        create_pr=args.create_pr,
        dry_run=args.dry_run,
        output=args.output,
        model_cls=HeadedModel,
        device=device,
    )
    left = f"; left out: {', '.join(result.left_out)}" if result.left_out else ""
    if args.dry_run:
        print(f"staged {len(result.files)} files for {args.repo_id} in {result.staged}{left}")
    else:
        print(f"pushed {len(result.files)} files to {result.commit_url}{left}")
