"""The checkpoint folder of the command line: written by ``train``, read by ``eval``/``predict``.

It holds the headkit checkpoint (``head_configs.json`` + safetensors, the backbone referenced
unless it was trained), the tokenizer, and ``headkit_cli.json`` (text and label columns, max
length), so ``eval`` and ``predict`` need nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:  # imports torch and transformers: only where a model is loaded
    from ..model.headed import HeadedModel

CLI_SETTINGS = "headkit_cli.json"


def save_trained(
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


def record_metrics(out: str | Path, metrics: dict[str, dict[str, float]]) -> None:
    """Add held-out ``metrics`` ({head: {metric: value}}) to ``headkit_cli.json`` and render
    the model card again with them (its evaluation section and ``model-index``)."""
    from ..checkpoint.card import refresh_card
    from .outputs import write_text

    out = Path(out)
    settings = {**read_settings(out), "metrics": metrics}
    write_text(out / CLI_SETTINGS, json.dumps(settings, indent=2) + "\n")
    refresh_card(out)


def open_checkpoint(
    checkpoint: str | Path, model: HeadedModel | None = None
) -> tuple[HeadedModel, Any, dict[str, Any]]:
    """The model (``model`` if given, else loaded), tokenizer and CLI settings of a folder.
    The settings are read first: a corrupt ``headkit_cli.json`` is refused before loading."""
    from transformers import AutoTokenizer

    from ..model.headed import HeadedModel

    root = Path(checkpoint)
    settings = read_settings(root)
    model = model or HeadedModel.from_pretrained(root)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"CHECKPOINT={str(root)!r} holds no tokenizer ({e}); was it written by headkit train?",
            field="CHECKPOINT",
            value=str(root),
        ) from None
    return model.eval(), tokenizer, settings


def read_settings(root: Path) -> dict[str, Any]:
    """``headkit_cli.json`` of a checkpoint folder ({} when there is none), each known key
    checked (unknown keys are kept: a later version may add some)."""
    path = root / CLI_SETTINGS
    if not path.is_file():
        return {}
    where = f"CHECKPOINT={str(root)!r}: {CLI_SETTINGS}"
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(settings, dict):
        raise ConfigError(f"{where} must hold a JSON object")
    checks = {
        "text_column": (lambda v: isinstance(v, str), "a column name"),
        "label_columns": (
            lambda v: (
                isinstance(v, dict)
                and all(isinstance(k, str) and isinstance(c, str) for k, c in v.items())
            ),
            "a mapping {head target: column}",
        ),
        "format": (lambda v: v in ("pairs", "steps"), "'pairs' or 'steps' (reward data)"),
        "step_separator": (lambda v: isinstance(v, str), "a text"),
        "max_length": (
            lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
            "an integer >= 1",
        ),
    }
    for key, (ok, allowed) in checks.items():
        if key in settings and not ok(settings[key]):
            raise ConfigError(
                f"{where}: {key}={settings[key]!r} is invalid; allowed: {allowed} (write the "
                "file again with headkit train, or fix it by hand)"
            )
    return settings
