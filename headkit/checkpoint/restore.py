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

import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..backbone.adapters import base_state_dict
from ..backbone.fingerprint import tensors_fingerprint
from ..backbone.inspection import base_model_of
from ..backbone.safety import check_model_class
from ..backbone.sources import (
    BackboneSource,
    load_backbone,
    requested_dtype,
    resolve_source,
    source_of,
)
from ..backbone.tying import tie_head_weights
from ..config import HeadConfig
from ..errors import CheckpointError, ConfigError
from ..formats import DEFAULT_READER, READERS, CheckpointFormat, reader_for
from .adapters import backbone_load_kwargs, load_adapter, verify_adapter_files
from .journal import finish_killed_saves
from .manifest import MANIFEST, TIED, read_manifest, sha256_file
from .paths import HUB_KWARGS, check_inside, check_tree_inside, is_checkpoint, resolve_checkpoint
from .sizes import backbone_width, check_sizes

if TYPE_CHECKING:
    from .contract import CheckpointModel

#: How many times (at most), and for how long, a load starts again when other processes'
#: saves keep replacing what it reads: a load on a busy machine can span several quick saves.
LOAD_ATTEMPTS = 100
LOAD_RETRY_S = 60.0
_T = TypeVar("_T")


@dataclass
class Checkpoint:
    """A read and verified checkpoint: its manifest, head configs and head tensors."""

    root: Path
    manifest: dict[str, Any]
    head_state: dict[str, torch.Tensor]
    #: how this checkpoint's backbone and heads load (``formats.CheckpointFormat``)
    format: CheckpointFormat = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.format is None:
            self.format = HEADKIT_FORMAT

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
    """Read and verify a checkpoint without building anything (fails fast, before loading).

    A save committed while this reads (another process) makes it read again (``retrying``).
    """
    root = Path(checkpoint_dir)
    return retrying(root, lambda: _read(root))


def _read(root: Path) -> Checkpoint:
    return reader_for(root).read(root)


def retrying(root: Path, load: Callable[[], _T]) -> _T:
    """``load()``, started again when it fails while another process's save commits into
    ``root`` (the manifest changed meanwhile: the files it read were replaced), up to
    LOAD_ATTEMPTS times within LOAD_RETRY_S seconds; a failure with the manifest unchanged is
    raised as it is."""
    last: Exception | None = None
    deadline = time.monotonic() + LOAD_RETRY_S
    attempts = 0
    while attempts < LOAD_ATTEMPTS and (attempts == 0 or time.monotonic() < deadline):
        attempts += 1
        before = _manifest_bytes(root)
        try:
            return load()
        except (CheckpointError, OSError) as e:
            if before is None or _manifest_bytes(root) == before:
                raise
            last = e
    raise CheckpointError(
        f"{str(root)!r} changed {attempts} times while it was being loaded (another "
        f"process keeps saving into it); load it once those saves pause. Last error: {last}"
    )


def _manifest_bytes(root: Path) -> bytes | None:
    try:
        return (root / MANIFEST).read_bytes()
    except OSError:
        return None


def _read_once(root: Path) -> Checkpoint:
    finish_killed_saves(root)
    manifest = read_manifest(root)
    check_inside(root / MANIFEST, root, "manifest")
    state = read_head_weights(root, manifest)
    ckpt = Checkpoint(root, manifest, state)
    folder = ckpt.saved_backbone
    if folder is not None:
        _verify_backbone_files(root, folder, ckpt.backbone["files_sha256"])
    verify_adapter_files(root, manifest)
    check_sizes(root, manifest, state, backbone_width(_config_json(ckpt)))
    return ckpt


def _config_json(ckpt: Checkpoint) -> Path | None:
    """The backbone's config.json when it is on disk (read before the backbone is loaded)."""
    if ckpt.saved_backbone is not None:
        return ckpt.saved_backbone / "config.json"
    bb = ckpt.backbone
    try:
        folder = Path(resolve_source(bb["source"], ckpt.root))
    except CheckpointError:
        return None
    sub = (bb.get("kwargs") or {}).get("subfolder")
    folder = folder / sub if sub else folder
    return folder / "config.json" if folder.is_dir() else None


def restore(
    checkpoint: str | os.PathLike | Checkpoint,
    model: CheckpointModel | None = None,
    *,
    model_cls: type | None = None,
    freeze_base_model: bool = True,
    only_inference: bool = False,
    torch_dtype: Any = None,
    device_map: Any = None,
    model_class: type | None = None,
    **from_pretrained_kwargs: Any,
) -> CheckpointModel:
    """Restore a HeadedModel from a checkpoint: build one (``model=None``, with ``model_cls``)
    or load into ``model`` in place. The loading keywords apply only when building;
    ``model_class`` (a transformers class) must match the backbone's family; a format whose
    checkpoints record no class loads its backbone with it (``CheckpointFormat``)."""
    if from_pretrained_kwargs.get("trust_remote_code"):
        raise ConfigError(
            "trust_remote_code=True is not accepted when loading a checkpoint: headkit never "
            "runs code from a checkpoint; load the backbone yourself and pass head_folder_path"
        )
    torch_dtype = requested_dtype(torch_dtype, from_pretrained_kwargs)
    options = dict(
        model_cls=model_cls,
        freeze_base_model=freeze_base_model,
        only_inference=only_inference,
        torch_dtype=torch_dtype,
        device_map=device_map,
        model_class=model_class,
    )
    if isinstance(checkpoint, Checkpoint):
        return _restore(checkpoint, model, from_pretrained_kwargs, **options)
    if not Path(checkpoint).exists():  # a hub repo id: revision= is the checkpoint's
        hub = {k: from_pretrained_kwargs[k] for k in HUB_KWARGS if k in from_pretrained_kwargs}
        from_pretrained_kwargs.pop("revision", None)
        checkpoint = resolve_checkpoint(checkpoint, hub)
    root = Path(checkpoint)
    return retrying(
        root,
        lambda: _restore(_read(root), model, dict(from_pretrained_kwargs), **options),
    )


def _restore(
    ckpt: Checkpoint,
    model: CheckpointModel | None,
    from_pretrained_kwargs: dict[str, Any],
    *,
    model_cls: type | None,
    freeze_base_model: bool,
    only_inference: bool,
    torch_dtype: Any,
    device_map: Any,
    model_class: type | None,
) -> CheckpointModel:
    backbone_done = False
    if model is None:
        if model_cls is None:
            raise ConfigError("restore(model=None) needs model_cls to build the model")
        kwargs, device_map = backbone_load_kwargs(ckpt, from_pretrained_kwargs, device_map)
        backbone, source = ckpt.format.build_backbone(
            ckpt, model_class, torch_dtype, device_map, kwargs, not only_inference
        )
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


def set_weighting(model: CheckpointModel, ckpt: Checkpoint) -> None:
    """Give ``model`` the loss weighting scheme the checkpoint was saved with."""
    weighting = ckpt.weighting
    name = weighting.pop("name", "fixed")
    try:
        model.set_loss_weighting(name, **weighting)
    except (ConfigError, TypeError) as e:
        raise CheckpointError(
            f"{str(ckpt.root / MANIFEST)!r}: loss_weighting={ckpt.weighting!r} is invalid: {e}"
        ) from None


def apply_checkpoint(model: CheckpointModel, ckpt: Checkpoint, *, backbone: bool = True) -> None:
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
    load_head_weights(model, ckpt.format.head_tensors(ckpt, model), where)
    model.nonfinite_loss = ckpt.nonfinite_loss
    if backbone:
        ckpt.format.load_backbone_into(ckpt, model)
    if ckpt.saved_backbone is None:
        _check_fingerprint(model, ckpt.backbone.get("fingerprint"))


class HeadkitFormat:
    """headkit's own checkpoints (``head_configs.json``): the ``"headkit"`` reader and its
    format."""

    def detect(self, root: Path) -> bool:
        return is_checkpoint(root)

    def read(self, root: Path) -> Checkpoint:
        return _read_once(root)

    def build_backbone(
        self,
        ckpt: Checkpoint,
        model_class: type | None,
        torch_dtype: Any,
        device_map: Any,
        kwargs: dict[str, Any],
        trainable: bool,
    ) -> tuple[Any, BackboneSource]:
        """The backbone as recorded (saved in the folder, or its reference), its adapter in."""
        _check_class(ckpt, model_class)
        backbone, source = _load_backbone(ckpt, torch_dtype, device_map, kwargs)
        if model_class is not None:
            check_model_class(
                model_class, backbone.config.model_type, ckpt.root, type(backbone).__name__
            )
        load_adapter(base_model_of(backbone), ckpt, trainable=trainable)
        return backbone, source

    def head_tensors(self, ckpt: Checkpoint, model: CheckpointModel) -> dict[str, torch.Tensor]:
        return ckpt.head_state

    def load_backbone_into(self, ckpt: Checkpoint, model: CheckpointModel) -> None:
        folder = ckpt.saved_backbone
        if folder is not None:
            load_backbone_state(model.backbone, folder)
        load_adapter(model.backbone, ckpt)  # strict: a LoRA adapter, or none on either side


HEADKIT_FORMAT = HeadkitFormat()
READERS.register(DEFAULT_READER, HEADKIT_FORMAT)


def _check_class(ckpt: Checkpoint, model_class: type | None) -> None:
    """Refuse a model class of another family before loading: against the backbone's
    config where it is on disk, else against the class the manifest records."""
    if model_class is None:
        return
    recorded = ckpt.backbone.get("class")
    recorded = recorded if isinstance(recorded, str) else None
    config = _config_json(ckpt)
    model_type = None
    if config is not None and config.is_file():
        try:
            model_type = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None
    elif recorded is not None and recorded.isidentifier():
        import transformers

        try:
            known = getattr(transformers, recorded, None)
        except (ImportError, RuntimeError):  # a class whose optional dependency is missing
            known = None
        model_type = getattr(getattr(known, "config_class", None), "model_type", None)
    check_model_class(model_class, model_type, ckpt.root, recorded)


def _check_fingerprint(model: CheckpointModel, recorded: Any) -> None:
    """Warn when a referenced backbone differs from the one the heads were saved with."""
    source = getattr(model, "source", None)
    if not isinstance(recorded, str) or not recorded or source is None:
        return
    if recorded.startswith("tensors:"):
        current = tensors_fingerprint(model.backbone)
    elif recorded.startswith("files:") and str(source.fingerprint).startswith("files:"):
        current = source.fingerprint
    else:  # from files this machine does not have, or of a kind this version does not know
        return
    if current != recorded:
        warnings.warn(
            f"the backbone loaded from {source.source!r} differs from the one these heads were "
            "saved with (different weights or dtype); predictions may differ",
            stacklevel=4,
        )


# ---------------------------------------------------------------------- backbone
def _load_backbone(
    ckpt: Checkpoint, torch_dtype: Any, device_map: Any, kwargs: dict[str, Any]
) -> tuple[Any, BackboneSource]:
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
        return hf, source_of(hf, folder, torch_dtype, {}, saved_in=ckpt.root)
    for k, v in (bb.get("kwargs") or {}).items():
        kwargs.setdefault(k, v)
    if torch_dtype is None and bb.get("dtype"):
        torch_dtype = bb["dtype"]
    where = resolve_source(bb["source"], ckpt.root)
    kwargs["use_safetensors"] = True  # never weights from a pickle (GGUF is not one)
    hf = load_backbone(where, torch_dtype=torch_dtype, device_map=device_map, **kwargs)
    return hf, source_of(hf, where, torch_dtype, kwargs)


def _verify_backbone_files(root: Path, folder: Path, checksums: dict[str, str]) -> None:
    if not folder.is_dir():
        raise CheckpointError(f"backbone folder {folder.name!r} named in {MANIFEST} is missing")
    check_tree_inside(folder, root, "backbone folder")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"backbone folder {str(folder)!r} has no safetensors file")
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
    own = base_state_dict(backbone)  # LoRA adapters are restored on their own
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
    root = Path(checkpoint_dir)
    path = root / manifest["weights"]
    if not path.is_file():
        raise CheckpointError(f"weights file {str(path)!r} named in {MANIFEST} is missing")
    check_inside(path, root, "weights file")
    if sha256_file(path) != manifest["weights_sha256"]:
        raise CheckpointError(
            f"weights file {str(path)!r} is corrupt or truncated (sha256 differs from {MANIFEST})"
        )
    return _load_safetensors(path, "weights file")


def load_head_weights(model: CheckpointModel, state: dict[str, torch.Tensor], where: str) -> None:
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
            target = _live_tensor(model, k)
            if target.is_floating_point() and v.dtype != target.dtype:
                target.data = v.to(target.device)  # a bf16/fp16 head comes back as saved
            else:
                target.copy_(v.to(target.device, target.dtype))


def _live_tensor(model: torch.nn.Module, key: str) -> torch.Tensor:
    """The parameter or buffer ``key`` names (not a detached copy from a state dict)."""
    try:
        return model.get_parameter(key)
    except AttributeError:
        return model.get_buffer(key)


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


def load_trainer_state(model: Any, root: str | os.PathLike) -> None:
    """Load the whole state dict a plain ``transformers.Trainer`` wrote from a HeadedModel
    (``checkpoint-N/model.safetensors``: Trainer saves only the state dict of a model that is
    not a ``PreTrainedModel``) into ``model``, the same HeadedModel built again (its backbone
    and head configs): every key and shape must match, values must be finite."""
    root = Path(root)
    path = root / "model.safetensors"
    check_inside(path, root, "Trainer's state dict")
    state = _load_safetensors(path, "Trainer's state dict")
    own = model.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise CheckpointError(
            f"{str(path)!r} does not hold this model's state: {len(missing)} missing "
            f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}) and "
            f"{len(unexpected)} unexpected ({', '.join(unexpected[:4])}"
            f"{', ...' if len(unexpected) > 4 else ''}); build the model Trainer trained: the "
            "same backbone and head_configs"
        )
    wrong = [k for k in own if tuple(state[k].shape) != tuple(own[k].shape)]
    if wrong:
        k = wrong[0]
        raise CheckpointError(
            f"{str(path)!r}: {len(wrong)} tensors differ in shape from this model's, e.g. "
            f"{k!r} {tuple(state[k].shape)} against {tuple(own[k].shape)}; build the model "
            "Trainer trained: the same backbone and head_configs"
        )
    _check_finite(state, f"Trainer's state dict {str(path)!r}")
    model.load_state_dict(state, strict=True)


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
