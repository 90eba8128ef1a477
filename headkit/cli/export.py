"""``headkit export CHECKPOINT --format onnx --output DIR``: a checkpoint in a format other
stacks serve: one ONNX graph of every head, or one head as a plain transformers classifier
(``headkit.export``). ``--format`` lists the export formats registered in
``headkit.formats.EXPORTERS``. ``--device`` is where the checkpoint is loaded and the export
runs from (``headkit.export(..., device=)``). Importing this module imports argparse and that
registry only; ``run`` imports the rest.
"""

from __future__ import annotations

import argparse

from ..formats import EXPORTERS
from .options import add_overwrite, add_quiet

HELP = "export a checkpoint as ONNX (every head) or a plain transformers classifier (one head)"
EXAMPLE = """example:
  headkit export runs/sentiment --format onnx --output runs/sentiment-onnx
  headkit export runs/sentiment --format transformers --output runs/sentiment-hf
the ONNX folder holds model.onnx, headkit_onnx.json (what each output is) and the tokenizer;
the transformers folder loads with AutoModelForSequenceClassification (or
AutoModelForTokenClassification)"""
DEVICE_HELP = (
    "where the checkpoint is loaded, and the export traced and checked against the model "
    "(an ONNX graph is also run with onnxruntime on the CPU)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument(
        "--format",
        choices=EXPORTERS.in_order(),
        default="onnx",
        help="an export format registered in headkit.EXPORTERS (default onnx)",
    )
    p.add_argument(
        "--output",
        required=True,
        help="the folder to write: new, empty, or an earlier export of the same format",
    )
    add_overwrite(p, "an earlier export in --output")
    p.add_argument(
        "--head",
        action="append",
        metavar="NAME",
        help="export this head (repeatable for onnx; default: every head, or the only one)",
    )
    p.add_argument("--atol", type=float, default=1e-4, help="verification tolerance (1e-4)")
    p.add_argument("--opset", type=int, help="ONNX opset (default: the exporter's)")
    p.add_argument(
        "--exporter",
        choices=("auto", "dynamo", "torchscript"),
        default="auto",
        help="onnx: torch's dynamo exporter, the TorchScript one where it fails (auto, the "
        "default), or either alone",
    )
    p.add_argument("--pad-token-id", type=int, help="transformers, decoders: the pad id")
    add_quiet(p)


def run(args: argparse.Namespace) -> None:
    from ..deploy import export
    from ..errors import ConfigError
    from .options import resolve_device

    device = resolve_device(args.device)  # before anything is loaded or written
    check_export_folder(args)
    options: dict = {"atol": args.atol, "overwrite": args.overwrite, "device": device}
    if args.format == "onnx":
        options.update(heads=args.head, opset=args.opset, exporter=args.exporter)
        result = export(args.checkpoint, args.output, "onnx", **options)
        print(
            f"wrote {result.graph} ({result.exporter} exporter, {result.blocks} of "
            f"{result.description['backbone']['num_layers']} blocks; max |difference| from the "
            f"model per head: {_diffs(result.max_abs_diff)})"
        )
        return
    if args.head and len(args.head) > 1:
        raise ConfigError(
            f"--head given {len(args.head)} times; a transformers classifier holds one"
        )
    options["head"] = args.head[0] if args.head else None
    if args.format != "transformers":  # another registered format: its head, if one is named
        options = {"device": device, **({"head": options["head"]} if args.head else {})}
        result = export(args.checkpoint, args.output, args.format, **options)
        print(f"wrote {args.output} ({args.format}: {type(result).__name__})")
        return
    options["pad_token_id"] = args.pad_token_id
    result = export(args.checkpoint, args.output, "transformers", **options)
    print(
        f"wrote {result.directory} ({result.model_class}, loads with {result.auto_class}; max "
        f"|difference| from head {result.head!r}: {result.max_abs_diff:.2g})"
    )


def check_export_folder(args: argparse.Namespace) -> None:
    """Refuse --output before the checkpoint is loaded: the checkpoint itself, a folder of
    other files (named), or an earlier export without --overwrite."""
    from ..integrations.hf_classifiers import SIDECAR as TRANSFORMERS_SIDECAR
    from ..integrations.onnx import SIDECAR as ONNX_SIDECAR
    from .outputs import check_output_folder, local_inputs

    sidecar = {"onnx": ONNX_SIDECAR, "transformers": TRANSFORMERS_SIDECAR}.get(args.format)
    check_output_folder(
        args.output,
        local_inputs(args.checkpoint),
        args.overwrite,
        ours=lambda folder: sidecar is not None and (folder / sidecar).is_file(),
        what=f"an earlier {args.format} export",
    )


def _diffs(diffs: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.2g}" for k, v in diffs.items())
