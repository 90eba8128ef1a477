"""Where a backbone comes from: loading it with headkit's defaults, and recording its source.

A ``BackboneSource`` is what a checkpoint records instead of copying a frozen, unchanged
backbone: the path or hub id, the ``from_pretrained`` keywords that matter, the dtype, and
a fingerprint of the weights as loaded. It is given to ``HeadedModel`` by whoever loaded the
backbone (``load_headed``, ``HeadedModel.from_pretrained``), never set on it afterwards.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError
from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel

from .backbone import base_model_of
from .errors import CheckpointError, HeadkitError

#: from_pretrained keyword arguments recorded with a referenced backbone (JSON-safe strings).
RECORDED_KWARGS = ("gguf_file", "revision", "subfolder")


@dataclass
class BackboneSource:
    """A loadable description of a backbone: ``source`` (path or hub id), recorded
    ``kwargs``, ``dtype`` name and the ``fingerprint`` of the weights as loaded."""

    source: str
    kwargs: dict[str, str] = field(default_factory=dict)
    dtype: str | None = None
    fingerprint: str | None = None

    def to_manifest(self) -> dict[str, Any]:
        """The checkpoint's backbone entry fields."""
        return {"source": self.source, "kwargs": dict(self.kwargs), "dtype": self.dtype}


def dtype_name(dtype: Any) -> str | None:
    """``torch.float16`` / ``"float16"`` → ``"float16"`` (None stays None)."""
    if dtype is None or isinstance(dtype, str):
        return dtype
    return str(dtype).removeprefix("torch.")


def backbone_fingerprint(model: torch.nn.Module | Mapping[str, torch.Tensor]) -> str:
    """A cheap digest of every backbone tensor (names, shapes, dtypes, sums); of a module or
    of a state dict."""
    h = hashlib.sha256()
    items = list((model if isinstance(model, Mapping) else model.state_dict()).items())
    with torch.no_grad():
        # float64 accumulation without float64 copies of the (possibly huge) tensors
        sums = [t.detach().sum(dtype=torch.float64) for _, t in items]
        abs_sums = [t.detach().abs().sum(dtype=torch.float64) for _, t in items]
        values = torch.stack(sums + abs_sums).cpu().tolist() if items else []
    for (name, t), v in zip(items, values):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{v!r};".encode())
    for v in values[len(items) :]:
        h.update(f"{v!r};".encode())
    return h.hexdigest()


def load_backbone(
    source: str | os.PathLike,
    *,
    torch_dtype: Any = None,
    device_map: Any = None,
    model_class: type | None = None,
    causal_lm: bool = False,
    **kwargs: Any,
) -> PreTrainedModel:
    """``from_pretrained`` with headkit's defaults; loading errors become CheckpointError."""
    cls = model_class or (AutoModelForCausalLM if causal_lm else AutoModel)
    if torch_dtype is not None:
        kwargs["dtype"] = (
            getattr(torch, torch_dtype)
            if isinstance(torch_dtype, str) and hasattr(torch, torch_dtype)
            else torch_dtype
        )
    if device_map is not None:
        kwargs["device_map"] = device_map
    try:
        return cls.from_pretrained(str(source), **kwargs)
    except HeadkitError:
        raise
    # transformers and safetensors report missing, corrupt or mismatched files with many types
    except (
        OSError,
        ValueError,
        RuntimeError,
        TypeError,
        KeyError,
        EOFError,
        SafetensorError,
        pickle.UnpicklingError,  # a referenced *.bin that torch.load(weights_only=True) refuses
    ) as e:
        raise CheckpointError(f"cannot load a backbone from {str(source)!r}: {e}") from None


def source_of(
    backbone: PreTrainedModel,
    source: str | os.PathLike,
    torch_dtype: Any,
    from_pretrained_kwargs: dict[str, Any],
) -> BackboneSource:
    """Describe a backbone just loaded from ``source`` with these arguments (the fingerprint
    is of its bare transformer, what ``HeadedModel.backbone`` will be)."""
    path = str(source)
    if os.path.exists(path):
        path = os.path.abspath(path)
    recorded = {
        k: from_pretrained_kwargs[k] for k in RECORDED_KWARGS if k in from_pretrained_kwargs
    }
    fingerprint = backbone_fingerprint(base_model_of(backbone))
    return BackboneSource(path, recorded, dtype_name(torch_dtype), fingerprint)
