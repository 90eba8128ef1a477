"""Pushing a checkpoint to the Hugging Face hub: staged in a folder, then ``upload_folder``.

The staged folder is what the hub repo will hold: the checkpoint (manifest, heads, a saved
backbone or adapter), its model card (rendered again for the repo when it is headkit's own),
the tokenizer and the files beside it (``headkit_cli.json``, ``training_args.json``, ...).
Left out: headkit's temporary and lock files, pickles (optimizer and RNG states of Trainer
checkpoints) and folders the manifest does not use. The staged copy is verified
(``read_checkpoint``: every checksum) before anything is uploaded.

A referenced backbone must be loadable by whoever downloads the repo: a hub id with the commit
it was loaded at. A local folder or an installed package is refused with the fix, or copied
into the staged folder with ``include_backbone=True`` (the checkpoint is saved again with
``save_backbone=True``). ``dry_run=True`` stages without uploading (into ``output``).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ConfigError, HeadkitError
from ..modules import on_device, resolve_device
from .card import CARD, owns_card, refresh_card
from .journal import in_use
from .manifest import MANIFEST, PICKLE_SUFFIXES
from .paths import read_raw
from .restore import read_checkpoint, restore

if TYPE_CHECKING:
    from ..model.headed import HeadedModel

_COMMIT = re.compile(r"[0-9a-f]{40}")
#: Names in a checkpoint folder that are never uploaded (headkit's own bookkeeping).
_BOOKKEEPING = re.compile(r"\.headkit-save-.*|\.headkit\.lock|\.tmp-.*")


@dataclass
class PushResult:
    """What ``push_to_hub`` did: the repo, the staged folder (kept for a dry run), the files
    uploaded (or that would be), what was left out, and the commit's URL (None: dry run)."""

    repo_id: str
    staged: Path | None
    files: list[str]
    left_out: list[str] = field(default_factory=list)
    commit_url: str | None = None


def push_to_hub(
    source: HeadedModel | str | os.PathLike,
    repo_id: str,
    *,
    tokenizer: Any = None,
    include_backbone: bool = False,
    private: bool | None = None,
    token: str | None = None,
    revision: str | None = None,
    commit_message: str | None = None,
    create_pr: bool = False,
    dry_run: bool = False,
    output: str | os.PathLike | None = None,
    model_cls: type | None = None,
    device: Any = None,
) -> PushResult:
    """Stage ``source`` (a HeadedModel, saved for the purpose, or a checkpoint folder) for
    ``repo_id`` and upload it with ``huggingface_hub.upload_folder`` (see the module
    docstring). ``dry_run=True`` only stages, into ``output`` (default: a new temporary
    folder, kept); ``output`` must be empty or new. ``model_cls``: the class that restores a
    checkpoint folder (needed with ``include_backbone=True`` for a folder). ``device``
    (default the CPU): where a checkpoint folder is loaded when it is saved again
    (``include_backbone=True``; the files are the same from any device; otherwise it is
    copied and nothing is loaded); a HeadedModel is saved from where it is, a ``device``
    elsewhere is refused. A device torch does not see is a ConfigError before anything is
    written."""
    _check_repo_id(repo_id)
    if isinstance(source, (str, os.PathLike)):
        device = resolve_device(device)
    else:
        on_device(source, device)
    keep = dry_run or output is not None
    target = Path(output) if output is not None else Path(tempfile.mkdtemp(prefix="headkit-push-"))
    if output is not None:
        if target.exists() and (not target.is_dir() or any(target.iterdir())):
            raise ConfigError(f"output={str(target)!r} must be a new or empty folder")
        target.mkdir(parents=True, exist_ok=True)
    try:
        left_out = stage(source, target, repo_id, tokenizer, include_backbone, model_cls, device)
        files = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
        url = None
        if not dry_run:
            url = _upload(target, repo_id, private, token, revision, commit_message, create_pr)
    except BaseException:
        if not keep:
            shutil.rmtree(target, ignore_errors=True)
        raise
    if not keep:
        shutil.rmtree(target, ignore_errors=True)
    return PushResult(repo_id, target if keep else None, files, left_out, url)


def export_to_hub(
    model: HeadedModel | str | os.PathLike, output_dir: str | os.PathLike, **options: Any
) -> PushResult:
    """The ``"hub"`` exporter (``headkit.export``): ``push_to_hub(model, repo_id, ...)``
    staged in ``output_dir`` (``options``: ``repo_id`` and ``push_to_hub``'s keywords)."""
    if "repo_id" not in options:
        raise ConfigError("format='hub' needs repo_id=", field="repo_id", value=None)
    return push_to_hub(model, options.pop("repo_id"), output=output_dir, **options)


def stage(
    source: Any,
    target: Path,
    repo_id: str,
    tokenizer: Any = None,
    include_backbone: bool = False,
    model_cls: type | None = None,
    device: Any = None,
) -> list[str]:
    """Write what ``repo_id`` will hold into the empty folder ``target``; returns the names
    left out. A backbone hub users could not load is refused (or copied with
    ``include_backbone``: a folder is then loaded, on ``device``, and saved again); the staged
    checkpoint is verified."""
    left_out: list[str] = []
    if isinstance(source, (str, os.PathLike)):
        folder = Path(source)
        read_checkpoint(folder)  # verified before anything is copied
        if include_backbone:
            if model_cls is None:
                raise ConfigError("include_backbone=True for a checkpoint folder needs model_cls")
            model = restore(folder, model_cls=model_cls)
            if device is not None:
                model.to(device)  # saved from there: the same bytes as from the CPU
            model.save_pretrained(target, save_backbone=True, main_process_only=False)
            raw = read_raw(folder / MANIFEST)
            skip = in_use(raw) | set(os.listdir(target))
            if not owns_card(folder, raw):
                skip.discard(CARD)  # the user's README replaces the card just written
            left_out = _copy_folder(folder, target, skip=skip)
        else:
            left_out = _copy_folder(folder, target)
    else:
        # a staging folder of this process alone: no collective, whatever its rank (a model
        # sharded with FSDP2 is saved on every rank first, and its folder pushed)
        source.save_pretrained(
            target, save_backbone=True if include_backbone else None, main_process_only=False
        )
    if tokenizer is not None:
        tokenizer.save_pretrained(target)
    manifest = read_raw(target / MANIFEST)
    _check_backbone(manifest.get("backbone") if isinstance(manifest, dict) else None, target)
    refresh_card(target, title=repo_id)
    try:
        read_checkpoint(target)
    except CheckpointError as e:
        raise CheckpointError(
            f"the staged copy does not verify (was the folder saved to while "
            f"it was copied? try again): {e}"
        ) from None
    return left_out


def _copy_folder(folder: Path, target: Path, skip: set[str] | None = None) -> list[str]:
    """Copy a checkpoint folder's entries that belong on the hub; returns those left out."""
    manifest = read_raw(folder / MANIFEST)
    used = in_use(manifest)
    left_out = []
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        name = entry.name
        if skip and name in skip:
            continue
        bookkeeping = _BOOKKEEPING.fullmatch(name) is not None
        pickle = entry.suffix in PICKLE_SUFFIXES
        if bookkeeping or pickle or (entry.is_dir() and name not in used) or entry.is_symlink():
            if not bookkeeping:
                left_out.append(name + ("/" if entry.is_dir() else ""))
            continue
        if entry.is_dir():
            shutil.copytree(entry, target / name)
        else:
            shutil.copy2(entry, target / name)
    return left_out


def _check_backbone(bb: Any, target: Path) -> None:
    """A referenced backbone must be a hub id with the commit it was loaded at (or a folder
    inside the staged checkpoint, which goes along)."""
    if not isinstance(bb, dict) or bb.get("kind") != "reference":
        return
    source, revision = bb.get("source"), (bb.get("kwargs") or {}).get("revision")
    inside = in_use({"backbone": bb}) - {MANIFEST}  # a folder inside the checkpoint, if any
    if inside and all((target / name).is_dir() for name in inside):
        return
    fix = (
        "pass include_backbone=True (headkit push --include-backbone) to upload the backbone "
        "with the heads, or load the backbone from the hub (load_headed('org/name', ...)) "
        "so that the checkpoint references it by id and commit"
    )
    if isinstance(source, dict):
        where = (
            f"the model of the installed package {source['package']!r}"
            if "package" in source
            else f"the folder {source.get('checkpoint')!r} beside the checkpoint"
        )
        raise ConfigError(
            f"the backbone is referenced as {where}, which hub users may not have: {fix}"
        )
    if not isinstance(source, str) or os.path.isabs(source) or os.path.exists(source):
        raise ConfigError(
            f"the backbone is referenced as the local folder {source!r}, which hub users cannot "
            f"load: {fix}"
        )
    if not isinstance(revision, str) or not _COMMIT.fullmatch(revision):
        raise ConfigError(
            f"the backbone is referenced as hub id {source!r} without the commit it was loaded "
            f"at (revision={revision!r}): a later push to that repo would change the model "
            f"under these heads; {fix}"
        )


def _check_repo_id(repo_id: Any) -> None:
    try:
        from huggingface_hub.utils import HFValidationError, validate_repo_id
    except ImportError as e:  # pragma: no cover - huggingface_hub comes with transformers
        raise ConfigError(
            f"push_to_hub needs huggingface_hub: pip install huggingface_hub ({e})"
        ) from None
    try:
        validate_repo_id(repo_id)
    except (HFValidationError, TypeError) as e:
        raise ConfigError(
            f"repo_id={repo_id!r} is invalid: {e}; expected 'name' or 'org/name'"
        ) from None


def _upload(
    folder: Path,
    repo_id: str,
    private: bool | None,
    token: str | None,
    revision: str | None,
    commit_message: str | None,
    create_pr: bool,
) -> str:
    """Create the repo if needed and upload the staged folder; returns the commit URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            commit_message=commit_message or "Upload headkit checkpoint",
            revision=revision,
            create_pr=create_pr,
        )
    except (OSError, ValueError) as e:  # HTTP errors (HfHubHTTPError is an OSError), offline
        raise HeadkitError(
            f"pushing to hub repo {repo_id!r} failed: {type(e).__name__}: {e}"
        ) from None
    return str(getattr(info, "commit_url", info))
