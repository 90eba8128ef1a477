"""The one restore path: every way of loading a checkpoint goes through ``restore``.

``HeadedModel.from_pretrained``, ``load_headed(..., head_folder_path=)``, Trainer resume and
``load_best_model_at_end`` all call ``restore``: it reads and verifies the checkpoint
(``read_checkpoint``: manifest, head weights against their checksum, a saved backbone's files
against theirs) and then either builds the model (``model=None``) or loads into an existing
one (``apply_checkpoint``): heads, loss-weighting state, ``nonfinite_loss``, and a saved
(fine-tuned) backbone, strictly — a missing, unexpected, misshapen or non-finite tensor is a
``CheckpointError``, never a silent re-initialisation.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..backbone import base_model_of
from ..config import HeadConfig
from ..errors import CheckpointError, ConfigError
from ..source import BackboneSource, backbone_fingerprint, load_backbone
from ..tying import tie_head_weights
from .manifest import MANIFEST, TIED, read_manifest, sha256_file

if TYPE_CHECKING:
    from ..model import HeadedModel


@dataclass
class Checkpoint:
    """A read and verified checkpoint: its manifest, head configs and head tensors."""

    root: Path
    manifest: dict[str, Any]
    head_state: dict[str, torch.Tensor]

    @property
    def heads(self) -> list[HeadConfig]:
        return self.manifest["heads"]

    @property
    def backbone(self) -> dict[str, Any]:
        return self.manifest["backbone"]

    @property
    def weighting(self) -> dict[str, Any]:
        return dict(self.manifest.get("loss_weighting") or {"name": "fixed"})

    @property
    def tied(self) -> list[str]:
        """Head weights that are the backbone's input embeddings (re-tied, not in the file)."""
        return list(self.manifest.get(TIED, []))

    @property
    def nonfinite_loss(self) -> str:
        return self.manifest.get("nonfinite_loss", "raise")

    @property
    def saved_backbone(self) -> Path | None:
        """The folder of a saved (copied) backbone, or None for a referenced one."""
        return self.root / self.backbone["path"] if self.backbone["kind"] == "saved" else None


def read_checkpoint(checkpoint_dir: str | os.PathLike) -> Checkpoint:
    """Read and verify a checkpoint without building anything (fails fast, before loading)."""
    root = Path(checkpoint_dir)
    manifest = read_manifest(root)
    state = read_head_weights(root, manifest)
    ckpt = Checkpoint(root, manifest, state)
    folder = ckpt.saved_backbone
    if folder is not None:
        _verify_backbone_files(folder, ckpt.backbone.get("files_sha256"))
    return ckpt


def restore(
    checkpoint: str | os.PathLike | Checkpoint,
    model: HeadedModel | None = None,
    *,
    model_cls: type | None = None,
    freeze_base_model: bool = True,
    only_inference: bool = False,
    torch_dtype: Any = None,
    device_map: Any = None,
    **from_pretrained_kwargs: Any,
) -> HeadedModel:
    """Restore a HeadedModel from a checkpoint: build one (``model=None``, with ``model_cls``)
    or load into ``model`` in place. The loading keywords apply only when building."""
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else read_checkpoint(checkpoint)
    backbone_done = False
    if model is None:
        if model_cls is None:
            raise ConfigError("restore(model=None) needs model_cls to build the model")
        backbone, source = _load_backbone(ckpt, torch_dtype, device_map, from_pretrained_kwargs)
        model = model_cls(
            backbone,
            ckpt.heads,
            freeze_base_model=freeze_base_model,
            nonfinite_loss=ckpt.nonfinite_loss,
            layers_path=ckpt.manifest.get("layers_path"),
            source=source,
        )
        set_weighting(model, ckpt)
        backbone_done = True  # loaded from the checkpoint's own folder or its reference
    apply_checkpoint(model, ckpt, backbone=not backbone_done)
    if only_inference:
        model.eval().requires_grad_(False)
    return model


def set_weighting(model: HeadedModel, ckpt: Checkpoint) -> None:
    """Give ``model`` the loss weighting scheme the checkpoint was saved with."""
    weighting = ckpt.weighting
    name = weighting.pop("name", "fixed")
    try:
        model.set_loss_weighting(name, **weighting)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(
            f"{str(ckpt.root / MANIFEST)!r}: loss_weighting={ckpt.weighting!r} is invalid: {e}"
        ) from None


def apply_checkpoint(model: HeadedModel, ckpt: Checkpoint, *, backbone: bool = True) -> None:
    """Load the checkpoint's state into ``model`` in place (heads, weighting, settings, and the
    saved backbone when ``backbone``); the model must have the checkpoint's heads and scheme."""
    where = str(ckpt.root)
    saved = sorted(c.name for c in ckpt.heads)
    if saved != sorted(model.head_configs):
        raise CheckpointError(
            f"{where!r} holds heads {saved}, but the model has {sorted(model.head_configs)}"
        )
    scheme = ckpt.weighting.get("name", "fixed")
    if scheme != getattr(model.loss_weighting, "name", None):
        raise CheckpointError(
            f"{where!r} was trained with loss_weighting={scheme!r}, but the model uses "
            f"{model.loss_weighting.name!r}"
        )
    trainable = {n: c.trainable for n, c in model.head_configs.items()}
    tie_head_weights(model.backbone, model.heads, ckpt.tied, trainable, where)
    load_head_weights(model, ckpt.head_state, where)
    model.nonfinite_loss = ckpt.nonfinite_loss
    folder = ckpt.saved_backbone
    if backbone and folder is not None:
        load_backbone_state(model.backbone, folder)
    recorded = ckpt.backbone.get("fingerprint")
    source = getattr(model, "source", None)
    if folder is None and recorded and source is not None and source.fingerprint != recorded:
        warnings.warn(
            f"the backbone loaded from {source.source!r} differs from the one these heads were "
            "saved with (different weights or dtype); predictions may differ",
            stacklevel=3,
        )


# ---------------------------------------------------------------------- backbone
def _load_backbone(
    ckpt: Checkpoint, torch_dtype: Any, device_map: Any, kwargs: dict[str, Any]
) -> tuple[Any, BackboneSource | None]:
    bb = ckpt.backbone
    kwargs = dict(kwargs)
    folder = ckpt.saved_backbone
    if folder is not None:
        kwargs["use_safetensors"] = True
        kwargs["output_loading_info"] = True
        hf, info = load_backbone(folder, torch_dtype=torch_dtype, device_map=device_map, **kwargs)
        problems = {k: v for k, v in info.items() if v and k != "error_msgs"}
        if problems or info.get("error_msgs"):
            raise CheckpointError(
                f"backbone folder {str(folder)!r} does not match its config: "
                f"{ {k: sorted(v)[:5] for k, v in problems.items()} } {info.get('error_msgs')}"
            )
        _check_finite(hf.state_dict(), str(folder))
        return hf, None
    for k, v in (bb.get("kwargs") or {}).items():
        kwargs.setdefault(k, v)
    if torch_dtype is None and bb.get("dtype"):
        torch_dtype = bb["dtype"]
    hf = load_backbone(bb["source"], torch_dtype=torch_dtype, device_map=device_map, **kwargs)
    recorded = {k: v for k, v in (bb.get("kwargs") or {}).items()}
    fingerprint = backbone_fingerprint(base_model_of(hf))
    source = BackboneSource(bb["source"], recorded, bb.get("dtype"), fingerprint)
    return hf, source


def _verify_backbone_files(folder: Path, checksums: dict[str, str] | None) -> None:
    if not folder.is_dir():
        raise CheckpointError(f"backbone folder {folder.name!r} named in {MANIFEST} is missing")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"backbone folder {str(folder)!r} has no safetensors file")
    if checksums is None:  # written before checksums were recorded
        return
    names = sorted(f.name for f in files)
    if names != sorted(checksums):
        raise CheckpointError(
            f"backbone folder {str(folder)!r} holds {names}, but {MANIFEST} lists "
            f"{sorted(checksums)}"
        )
    for f in files:
        if sha256_file(f) != checksums[f.name]:
            raise CheckpointError(
                f"backbone file {str(f)!r} is corrupt or truncated (sha256 differs from {MANIFEST})"
            )


def load_backbone_state(backbone: torch.nn.Module, folder: Path) -> None:
    """Copy a saved backbone's tensors into ``backbone`` in place, strictly."""
    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(_load_safetensors(f, "backbone weights"))
    own = backbone.state_dict()
    unexpected = sorted(set(state) - set(own))
    missing = [k for k in own if k not in state and not _tied_to_loaded(k, own, state)]
    if unexpected or missing:
        raise CheckpointError(
            f"backbone weights in {str(folder)!r} do not match the model: missing "
            f"{sorted(missing)[:5]}, unexpected {unexpected[:5]}"
        )
    _check_tensors(own, state, str(folder))
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v.to(own[k].device, own[k].dtype))


def _tied_to_loaded(key: str, own: dict[str, torch.Tensor], state: dict[str, Any]) -> bool:
    """A tied tensor (one storage under two names) is saved once; either name may be missing."""
    ptr = own[key].untyped_storage().data_ptr()
    return any(
        k in state and k != key and t.untyped_storage().data_ptr() == ptr for k, t in own.items()
    )


# ---------------------------------------------------------------------- heads
def read_head_weights(checkpoint_dir: str | os.PathLike, manifest: dict) -> dict[str, torch.Tensor]:
    """Load the heads' safetensors file named by the manifest, checking its checksum."""
    path = Path(checkpoint_dir) / manifest["weights"]
    if not path.is_file():
        raise CheckpointError(f"weights file {str(path)!r} named in {MANIFEST} is missing")
    expected = manifest.get("weights_sha256")
    if expected and sha256_file(path) != expected:
        raise CheckpointError(
            f"weights file {str(path)!r} is corrupt or truncated (sha256 differs from {MANIFEST})"
        )
    state = _load_safetensors(path, "weights file")
    # Sizes come from the manifest: refuse ones far beyond what the file holds before anything
    # is built from them (a corrupt num_layers or num_outputs must not allocate gigabytes or
    # hang); small mismatches are reported tensor by tensor by load_head_weights.
    have = sum(t.numel() for t in state.values())
    tied_heads = {t.removeprefix("heads.").split(".", 1)[0] for t in manifest.get(TIED, [])}
    need = sum(
        _min_head_numel(c)
        for c in manifest["heads"]
        if isinstance(c, HeadConfig) and c.name not in tied_heads  # its matrix is the backbone's
    )
    if need > 2 * have + (1 << 20):
        raise CheckpointError(
            f"{MANIFEST} in {str(checkpoint_dir)!r} describes heads with at least {need} "
            f"parameters, but {manifest['weights']!r} holds {have} values: they do not match"
        )
    return state


def _min_head_numel(cfg: HeadConfig) -> int:
    """A lower bound on a head's parameter count from its config alone (no allocation)."""
    n_in, n_out, n = cfg.in_size or 1, cfg.num_outputs or 1, cfg.num_layers
    hidden = cfg.hidden_size
    return n_in * n_out if n == 1 else n_in * hidden + (n - 2) * hidden * hidden + hidden * n_out


def load_head_weights(model: HeadedModel, state: dict[str, torch.Tensor], where: str) -> None:
    """Copy ``state`` into the model's heads, raising CheckpointError on any mismatch."""
    own = model.head_state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"{where}: head weights do not match {MANIFEST}: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}"
        )
    _check_tensors(own, state, where)
    with torch.no_grad():
        for k, v in state.items():
            own[k].copy_(v.to(own[k].device, own[k].dtype))


def _check_tensors(own: dict[str, torch.Tensor], state: dict[str, torch.Tensor], where: str):
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise CheckpointError(
                f"{where}: tensor {k!r} has shape {tuple(v.shape)}, but {MANIFEST} describes "
                f"{tuple(own[k].shape)}"
            )
        if own[k].is_floating_point() and not v.is_floating_point():
            raise CheckpointError(
                f"{where}: tensor {k!r} has dtype {v.dtype}; a floating-point dtype is expected"
            )
    _check_finite(state, where)


def _check_finite(state: dict[str, torch.Tensor], where: str) -> None:
    for k, v in state.items():
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise CheckpointError(f"{where}: tensor {k!r} holds NaN or infinite values")


def _load_safetensors(path: Path, what: str) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{what} {str(path)!r} cannot be read: {e}") from None
    except Exception as e:  # safetensors raises plain Exception subclasses on some errors
        raise CheckpointError(f"{what} {str(path)!r} cannot be read: {e}") from None
