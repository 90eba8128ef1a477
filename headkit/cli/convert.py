"""``headkit convert TH_CHECKPOINT OUT``: a transformer-heads checkpoint as a headkit one.

Reads any of transformer-heads' saves (its plain save with ``config.json`` + ``output_heads``,
its LoRA save, or its heads-only save with ``--base``) through the one restore path and writes
a headkit checkpoint (``head_configs.json`` + safetensors; a full save's backbone is copied, a
LoRA save's base referenced). A new checkpoint is written into a new folder beside ``OUT`` and
renamed into place, so ``OUT`` never holds half a checkpoint; ``OUT`` may not be an input, an
existing headkit checkpoint there is replaced only with ``--overwrite`` (by a save into it: only
the files a save wrote are replaced, as ``save_pretrained`` does; the user's other files there,
a README.md of theirs included, stay), and a folder of other files is refused. ``--device``:
the checkpoint is read on the CPU, moved there and saved from there (the weight files are
the same bytes from any device). Importing this module imports argparse only.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .options import add_quiet

HELP = "convert a transformer-heads checkpoint into a headkit checkpoint"
EXAMPLE = """example:
  headkit convert runs/th_qlora runs/headkit_qlora
  headkit convert th_heads_only runs/heads --base gpt2 --overwrite"""
DEVICE_HELP = (
    "where the checkpoint is loaded (read on the CPU, then moved) and saved from; what is "
    "written is the same on any device"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="TH_CHECKPOINT", help="a folder transformer-heads saved")
    p.add_argument("output", metavar="OUT", help="the headkit checkpoint folder to write")
    p.add_argument(
        "--base",
        help="the backbone (path or hub id) of a heads-only save (transformer-heads' save of a "
        "quantised load_headed model holds no backbone)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    add_quiet(p)


def run(args: argparse.Namespace) -> None:
    from .options import resolve_device

    device = resolve_device(args.device)  # before anything is loaded or written
    out = convert(
        args.checkpoint, args.output, base=args.base, overwrite=args.overwrite, device=device
    )
    print(f"wrote {out}")


def convert(
    checkpoint: str | os.PathLike,
    output: str | os.PathLike,
    *,
    base: str | None = None,
    overwrite: bool = False,
    device: Any = None,
) -> Path:
    """Write the headkit checkpoint of the transformer-heads folder ``checkpoint`` to
    ``output`` (atomically: a sibling folder renamed into place); returns ``output``.
    ``device`` (default the CPU): where the model, read on the CPU, is moved and saved from;
    the files written are the same from any device."""
    from ..checkpoint.card import refresh_card
    from ..checkpoint.paths import is_checkpoint
    from ..compat.checkpoint import detect
    from ..loading import load_headed
    from ..model.headed import HeadedModel
    from ..modules import resolve_device
    from .outputs import check_output_folder, local_inputs

    device = resolve_device(device)
    src, out = Path(checkpoint), Path(output)
    layout = detect(src) if src.is_dir() else None
    if layout is None:
        raise ConfigError(
            f"CHECKPOINT={str(src)!r} is not a transformer-heads checkpoint (no head_configs.json "
            "of its kind, nor a config.json with output_heads); a headkit checkpoint needs no "
            "conversion",
            field="CHECKPOINT",
            value=str(src),
        )
    check_output_folder(
        out,
        local_inputs(src, base),
        overwrite,
        ours=is_checkpoint,
        what="a headkit checkpoint",
        option="OUT",
    )
    if layout == "heads" and base is None:
        raise ConfigError(
            f"CHECKPOINT={str(src)!r} holds heads only (no backbone); pass --base MODEL, the "
            "backbone they were trained on",
            field="CHECKPOINT",
            value=str(src),
        )
    if layout == "heads":
        model = load_headed(base, head_folder_path=src)
    else:
        model = HeadedModel.from_pretrained(src)
    model.to(device)  # saved from there: safetensors writes the same bytes from any device
    # a full save's backbone is copied: the output stands alone, whatever the source folder's
    # fate (an unchanged loaded backbone is otherwise referenced); a LoRA base is referenced
    save_backbone = True if layout == "full" else None
    if out.exists() and is_checkpoint(out):
        # --overwrite of a checkpoint: a save into it, which is atomic and replaces only what
        # a save wrote (checkpoint/journal.py); the user's other files there stay
        model.save_pretrained(out, save_backbone=save_backbone)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.convert-", dir=out.parent))
    try:
        model.save_pretrained(tmp, save_backbone=save_backbone)
        refresh_card(tmp, title=out.name)  # titled by its folder, not the temporary one
        os.replace(tmp, out)  # a new or empty folder
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
