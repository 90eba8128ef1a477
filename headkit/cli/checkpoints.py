"""The checkpoint folder of the command line: written by ``train``, read by ``eval``/``predict``.

It holds the headkit checkpoint (``head_configs.json`` + safetensors, the backbone referenced
unless it was trained), the tokenizer, and ``headkit_cli.json`` (text and label columns, max
length), so ``eval`` and ``predict`` need nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..model.headed import HeadedModel

CLI_SETTINGS = "headkit_cli.json"


def save_checkpoint(
    model: HeadedModel, tokenizer: Any, out: str | Path, settings: dict[str, Any]
) -> Path:
    """Write the model's checkpoint, its tokenizer and the CLI settings to ``out`` (a new or
    empty folder, or a checkpoint ``headkit train`` wrote: ``train.check_output``). The
    checkpoint comes first, so a folder left by an interrupted run is a checkpoint that
    ``--overwrite`` replaces."""
    from .outputs import write_text

    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    write_text(out / CLI_SETTINGS, json.dumps(settings, indent=2) + "\n")
    return out


def open_checkpoint(
    checkpoint: str | Path, model: HeadedModel | None = None
) -> tuple[HeadedModel, Any, dict[str, Any]]:
    """The model (``model`` if given, else loaded), tokenizer and CLI settings of a folder."""
    from transformers import AutoTokenizer

    root = Path(checkpoint)
    model = model or HeadedModel.from_pretrained(root)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"CHECKPOINT={str(root)!r} holds no tokenizer ({e}); was it written by headkit train?"
        ) from None
    settings_path = root / CLI_SETTINGS
    if not settings_path.is_file():
        return model.eval(), tokenizer, {}
    try:
        settings = json.loads(settings_path.read_text())
    except ValueError as e:
        raise ConfigError(
            f"CHECKPOINT={str(root)!r}: {CLI_SETTINGS} is not valid JSON ({e})"
        ) from None
    if not isinstance(settings, dict):
        raise ConfigError(f"CHECKPOINT={str(root)!r}: {CLI_SETTINGS} must hold a JSON object")
    return model.eval(), tokenizer, settings
