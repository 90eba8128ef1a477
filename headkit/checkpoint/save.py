"""Writing a checkpoint atomically: uniquely named files first, the manifest last.

The manifest is the commit point: new weight files get fresh names (with the save's token),
the manifest is replaced with ``os.replace`` (atomic on POSIX), and only then are the files
the previous manifest named deleted. A crash at any moment leaves either the old or the new
checkpoint complete and loadable.

A save holds the folder's lock (``lock.py``) from start to end, so saves into one folder
run one at a time, and it deletes only what it wrote itself (``journal.py``): the files the
manifest it replaces says a save wrote, and its own temporary files; never anything else in
the folder, and never a folder the new manifest uses (such as the ``backbone-*`` folder the
model was loaded from).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import save_file

from ..backbone.adapters import base_parameters, base_state_dict, has_adapters
from ..backbone.tying import tied_head_weights
from ..errors import CheckpointError, ConfigError
from ..losses.weighting import savable_config
from .adapters import quantization_entry, write_adapter
from .card import write_card
from .journal import PendingSave, recover
from .lock import folder_lock
from .manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    PLAIN_FORMAT_VERSION,
    TIED,
    fsync_dir,
    fsync_file,
    sha256_file,
)
from .paths import read_raw
from .shared_backbone import (
    commit_backbone_folder,
    foreign_owner,
    link_backbone,
    new_backbone_folder,
)

if TYPE_CHECKING:
    from .contract import CheckpointModel

#: The keywords ``HeadedModel.save_pretrained`` accepts (others get a ConfigError);
#: ``main_process_only`` is taken by it before ``save_checkpoint`` runs.
SAVE_OPTIONS = ("save_backbone", "safe_serialization", "max_shard_size", "main_process_only")


def backbone_is_referable(model: CheckpointModel) -> bool:
    """A frozen backbone, unchanged since it was loaded from a recorded source (LoRA adapters
    left out: they are saved on their own)."""
    src = model.source
    if src is None or not src.fingerprint:
        return False
    if any(p.requires_grad for p in base_parameters(model.backbone)):
        return False
    backbone = model.backbone
    return src.unchanged(base_state_dict(backbone) if has_adapters(backbone) else backbone)


def save_checkpoint(
    model: CheckpointModel,
    save_directory: str | os.PathLike,
    *,
    save_backbone: bool | None = None,
    safe_serialization: bool = True,
    max_shard_size: int | str | None = None,
    **unsupported: Any,
) -> Path:
    """Write ``model`` to ``save_directory`` atomically (see module docstring).

    ``save_backbone=None`` copies the backbone only when it cannot be referenced (trained,
    changed since loading, or built in memory); True/False force it. ``max_shard_size``
    shards a copied backbone's safetensors files (as transformers does); checkpoints are
    always safetensors (``safe_serialization=True``).
    """
    _check_options(safe_serialization, max_shard_size, unsupported)
    weighting = savable_config(model.loss_weighting)  # before anything is written
    root = Path(save_directory)
    root.mkdir(parents=True, exist_ok=True)
    with folder_lock(root):
        recover(root)  # finish what a killed save left
        token = uuid.uuid4().hex[:12]
        previous = read_raw(root / MANIFEST)
        with PendingSave(root, token, previous):
            weights_name = _write_heads(model, root, token)
            adapter = write_adapter(model, root, token)  # the backbone's LoRA adapter, if any
            entry = _backbone_entry(model, root, token, previous, save_backbone, max_shard_size)
            entry["class"] = type(model.backbone).__name__
            quantization = quantization_entry(model.backbone)
            if quantization and entry["kind"] == "reference":
                entry["quantization"] = quantization  # a 4-bit base reloads 4-bit
            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION if adapter else PLAIN_FORMAT_VERSION,
                "heads": [c.to_dict() for c in model.head_configs.values()],
                "weights": weights_name,
                "weights_sha256": sha256_file(root / weights_name),
                "backbone": entry,
                "loss_weighting": weighting,
                "nonfinite_loss": model.nonfinite_loss,
            }
            if model.layers_path is not None:
                manifest["layers_path"] = model.layers_path
            if adapter is not None:
                manifest["adapter"] = adapter
            tied = tied_head_weights(model.backbone, model.heads)
            if tied:  # shared with the backbone's input embeddings: re-tied on load, not written
                manifest[TIED] = tied
            card = write_card(model, root, manifest, previous, token)  # README.md (card.py)
            if card is not None:
                manifest["card"] = card
            _commit(root, manifest, token)
    return root


def _check_options(safe_serialization: Any, max_shard_size: Any, unsupported: dict) -> None:
    if unsupported:
        raise ConfigError(
            f"save_pretrained got {sorted(unsupported)}, which headkit does not support; "
            f"allowed: {', '.join(SAVE_OPTIONS)} (checkpoints are written locally as "
            "safetensors + JSON)"
        )
    if safe_serialization is not True:
        raise ConfigError(
            f"safe_serialization={safe_serialization!r} is invalid; headkit writes only "
            "safetensors (True)"
        )
    if max_shard_size is not None:
        from transformers.utils.hub import convert_file_size_to_int

        try:
            ok = convert_file_size_to_int(max_shard_size) > 0
        except (ValueError, TypeError, AttributeError):
            ok = False
        if not ok or isinstance(max_shard_size, bool):
            raise ConfigError(
                f"max_shard_size={max_shard_size!r} is invalid; a positive number of bytes or "
                "a size such as '500MB' or '5GB'"
            )


def _backbone_entry(
    model: CheckpointModel,
    root: Path,
    token: str,
    previous: Any,
    save_backbone: bool | None,
    max_shard_size: int | str | None,
) -> dict[str, Any]:
    """The manifest's backbone entry: the saved folder in place (saving back, unchanged),
    a reference to the source, or a fresh copy."""
    referable, asked = backbone_is_referable(model), save_backbone
    # weights not in safetensors or GGUF files (pickles): a checkpoint never loads those
    unsafe = referable and not model.source.fingerprint.startswith("files:")
    if save_backbone is None:
        kept = _saved_in_place(model, root, previous) if referable else None
        if kept is not None:
            return kept
        save_backbone = not referable or model.source.saved_in is not None or unsafe
    owned = foreign_owner(model, root, asked) if referable else None
    if owned is not None:  # a folder another checkpoint owns (and deletes): linked or copied
        linked = link_backbone(model, owned, root, token)
        entry = linked or _write_backbone(model, root, token, max_shard_size)
        return {**entry, "reason": "from_checkpoint"}
    if save_backbone:
        entry = _write_backbone(model, root, token, max_shard_size)
        return {**entry, "reason": _copy_reason(model, asked, unsafe)}
    if unsafe:
        raise CheckpointError(
            f"save_backbone=False, but the backbone's weights at {model.source.source!r} are "
            "not in safetensors or GGUF files, and a checkpoint never loads pickles: save it "
            "(save_backbone=None or True)"
        )
    if model.source is None:
        raise CheckpointError(
            "save_backbone=False, but the backbone has no source to reference (it was built in "
            "memory); save it or load it with load_headed(path)"
        )
    if not referable:
        warnings.warn(
            "save_backbone=False: the backbone was changed since loading; the checkpoint "
            "references the original, so predictions may differ after loading",
            stacklevel=4,
        )
    return {
        "kind": "reference",
        **model.source.to_manifest(root),
        "fingerprint": model.source.fingerprint,
    }


def _copy_reason(model: CheckpointModel, asked: bool | None, unsafe: bool) -> str:
    """Why the backbone is copied (``card.BACKBONE_REASONS`` says it in words)."""
    if asked:
        return "asked"
    if model.source is None or not model.source.fingerprint:
        return "in_memory"
    if any(p.requires_grad for p in base_parameters(model.backbone)):
        return "trainable"
    if unsafe:
        return "not_safetensors"
    if model.source.saved_in is not None and backbone_is_referable(model):
        return "from_checkpoint"
    return "changed"


def _saved_in_place(model: CheckpointModel, root: Path, previous: Any) -> dict[str, Any] | None:
    """The current manifest's saved-backbone entry, when the model was restored from that
    very folder of this checkpoint and is unchanged: saving heads back keeps it."""
    src = model.source
    bb = previous.get("backbone") if isinstance(previous, dict) else None
    if src is None or src.saved_in is None or src.dtype is not None or not isinstance(bb, dict):
        return None  # (loaded in another dtype than its files hold: write it as it is now)
    if bb.get("kind") != "saved" or bb.get("path") != Path(src.source).name:
        return None
    try:
        same = os.path.samefile(src.saved_in, root) and (root / bb["path"]).is_dir()
    except OSError:
        return None
    if not same:
        return None
    return {k: bb[k] for k in ("kind", "path", "files_sha256", "fingerprint", "reason") if k in bb}


def _write_heads(model: CheckpointModel, root: Path, token: str) -> str:
    name = f"heads-{token}.safetensors"
    tmp = root / f".tmp-{name}"
    state = {k: v.detach().contiguous().cpu() for k, v in model.head_state_dict().items()}
    version = str(PLAIN_FORMAT_VERSION)
    metadata = {"format": FORMAT, "format_version": version, "token": token}
    save_file(state, str(tmp), metadata=metadata)  # the token proves the file is headkit's
    os.chmod(tmp, 0o644)  # safetensors creates files readable by the owner only
    fsync_file(tmp)
    os.replace(tmp, root / name)
    return name


def _write_backbone(
    model: CheckpointModel, root: Path, token: str, max_shard_size: int | str | None = None
) -> dict[str, Any]:
    options = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    # a LoRA backbone is saved as it was before peft (its adapter is saved on its own)
    if has_adapters(model.backbone):
        options["state_dict"] = base_state_dict(model.backbone)
    tmp = new_backbone_folder(root, token)
    with _written_on_this_rank(model.backbone):
        model.backbone.save_pretrained(tmp, safe_serialization=True, **options)
    if not any(tmp.glob("*.safetensors")):
        raise CheckpointError(
            f"saving the backbone of {type(model.backbone).__name__} into {str(root)!r} wrote "
            "no weights file; nothing was committed"
        )
    for f in tmp.iterdir():
        if f.is_file():
            fsync_file(f)
    return commit_backbone_folder(tmp, root)


@contextlib.contextmanager
def _written_on_this_rank(backbone: Any) -> Iterator[None]:
    """transformers' ``save_pretrained`` writes nothing on a rank other than 0 of a process
    group; a headkit save runs only on the process meant to write (rank 0 of a collective
    save, or a save ``main_process_only=False`` asked for), so that process writes."""
    if not callable(getattr(type(backbone), "should_save_on_this_rank", None)):
        yield
        return
    backbone.should_save_on_this_rank = _always
    try:
        yield
    finally:
        del backbone.should_save_on_this_rank


def _always(is_main_process: bool) -> bool:
    return is_main_process


def _commit(root: Path, manifest: dict[str, Any], token: str) -> None:
    fsync_dir(root)  # the renamed weight files are durable before the commit point
    tmp = root / f".tmp-{MANIFEST}-{token}"
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
    fsync_file(tmp)
    os.replace(tmp, root / MANIFEST)  # <- the commit point
    fsync_dir(root)
