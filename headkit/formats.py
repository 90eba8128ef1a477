"""Formats: ``READERS`` (checkpoint formats read), ``EXPORTERS`` (formats exported) and
``IGNORE_PADS_ALIASES`` (other names of a stored config value).

Both are registries of this torch-free module, so ``headkit/__init__.py`` (the package that
assembles core and edges) registers the edges' entries by name at ``import headkit`` without
importing them, and ``headkit export --help`` lists the export formats without torch.

**Readers.**
A reader says whether it recognises a folder (``detect``) and reads it (``read``) into a
``Checkpoint`` whose ``format`` knows the rest: how that format's backbone is built
(``build_backbone``), which head tensors a model receives (``head_tensors``) and how a saved
backbone or adapter is loaded into an existing model (``load_backbone_into``). ``restore``
asks these and never branches on a format.

headkit's own manifest is the ``"headkit"`` reader (``checkpoint/restore.py``), asked last:
a folder no other reader recognises is read as headkit's, whose errors say what is missing.
Another format is one module plus a registration; a package at the edge registers by name
(``READERS.register_lazy("name", "package.module:READER")``, done for the compat package by
``headkit/__init__.py``, the package that assembles core and edges), so the core never imports
it and every entry point (``HeadedModel.from_pretrained``, ``load_headed``, the CLI) sees it.

**Exporters.** An exporter is a function ``(model, output_dir, **options)`` returning what it
wrote, added with ``EXPORTERS.register(name, fn)``; ``headkit.export(model, dir,
format=name)`` and ``headkit export --format`` call it.

**Value aliases.** ``IGNORE_PADS_ALIASES`` maps another library's name of one of
``HeadConfig.ignore_pads``' rules to headkit's value (``"drop_last_real"``); ``HeadConfig``
stores headkit's value, so configs written with the other name read and save as headkit's.
An edge registers its names (``IGNORE_PADS_ALIASES.register(alias, value)``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .registry import Registry

if TYPE_CHECKING:
    import torch

    from .checkpoint.contract import CheckpointModel
    from .checkpoint.restore import Checkpoint

#: The reader asked last, for any folder no other reader recognises.
DEFAULT_READER = "headkit"


class CheckpointFormat(Protocol):
    """What ``restore`` asks of a read checkpoint's format."""

    def build_backbone(
        self,
        ckpt: Checkpoint,
        model_class: type | None,
        torch_dtype: Any,
        device_map: Any,
        kwargs: dict[str, Any],
        trainable: bool,
    ) -> tuple[Any, Any]:
        """(backbone model, its ``BackboneSource`` or None) with any adapter loaded."""

    def head_tensors(self, ckpt: Checkpoint, model: CheckpointModel) -> dict[str, torch.Tensor]:
        """The head tensors to load into ``model``."""

    def load_backbone_into(self, ckpt: Checkpoint, model: CheckpointModel) -> None:
        """Load the checkpoint's saved backbone tensors and adapter into ``model``, strictly."""


class CheckpointReader(Protocol):
    """A registered reader: recognises a folder and reads it."""

    def detect(self, root: Path) -> bool: ...

    def read(self, root: Path) -> Checkpoint: ...


READERS: Registry[CheckpointReader] = Registry("checkpoint format", "format")


def reader_for(root: str | os.PathLike) -> CheckpointReader:
    """The reader of the folder ``root``: the first other reader that recognises it, else
    headkit's."""
    root = Path(root)
    for name in READERS.names():
        if name != DEFAULT_READER and READERS.get(name).detect(root):
            return READERS.get(name)
    return READERS.get(DEFAULT_READER)


def is_checkpoint_folder(path: Any) -> bool:
    """Whether ``path`` is a local folder some registered reader recognises."""
    if not isinstance(path, (str, os.PathLike)):
        return False
    root = Path(path)
    return any(READERS.get(name).detect(root) for name in READERS.names())


#: Export formats: name -> ``fn(model, output_dir, **options)``.
EXPORTERS: Registry[Any] = Registry("export format", "format")


#: Other names of an ``ignore_pads`` value → the value ``HeadConfig`` stores.
IGNORE_PADS_ALIASES: Registry[str] = Registry("ignore_pads alias", "ignore_pads")
