"""The checkpoint folder of the command line: written by ``train``, read by ``eval``/``predict``.

It holds the headkit checkpoint (``head_configs.json`` + safetensors, the backbone referenced
unless it was trained), the tokenizer, and ``headkit_cli.json`` (text and label columns, max
length), so ``eval`` and ``predict`` need nothing else.
"""

from __future__ import annotations

import json
import os
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


def record_metrics(
    out: str | Path, metrics: dict[str, dict[str, float]], data: str | None = None
) -> None:
    """Add held-out ``metrics`` ({head: {metric: value}}) to ``headkit_cli.json`` and render
    the model card again with them (its evaluation section and ``model-index``).

    ``data`` (``headkit eval --record``): the data they were measured on. Metrics of the
    training run's ``data.eval`` (or ``data=None``) replace the training run's; those of
    another data set go to ``evaluations``, beside the others, replacing only an earlier
    result on the same data. Each file is replaced atomically (a temporary file renamed
    over it); the card is rendered from ``headkit_cli.json``, so recording again repairs an
    interrupted record. The weights are not touched."""
    from ..checkpoint.card import refresh_card
    from .outputs import write_text

    out = Path(out)
    settings = read_settings(out)
    run_data = settings.get("data")
    trained_on = run_data.get("eval") if isinstance(run_data, dict) else None
    if data is None or same_data(data, trained_on):
        settings["metrics"] = metrics
    else:
        evaluations = list(settings.get("evaluations", []))
        at = next((i for i, e in enumerate(evaluations) if same_data(e["data"], data)), None)
        result = {"data": data, "metrics": metrics}
        if at is None:
            evaluations.append(result)
        else:
            evaluations[at] = result
        settings["evaluations"] = evaluations
    write_text(out / CLI_SETTINGS, json.dumps(settings, indent=2) + "\n")
    refresh_card(out)


def same_data(a: Any, b: Any) -> bool:
    """Whether two data names (as given to ``--data`` / ``data.eval``) name the same data:
    the same text, or two paths of one existing file or folder."""
    if not isinstance(a, str) or not isinstance(b, str):
        return False
    if a == b:
        return True
    try:
        return os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b)
    except OSError:
        return False


def check_recordable(checkpoint: str | Path) -> Path:
    """The folder ``headkit eval --record`` may write into: a headkit checkpoint whose
    README.md is headkit's own card (or absent), with the folder and the files it replaces
    writable (mode bits too: a folder marked read-only is refused even to root). ConfigError
    naming --record and the path otherwise; checked before the model is loaded."""
    from ..checkpoint.card import CARD, owns_card
    from ..checkpoint.manifest import MANIFEST
    from ..checkpoint.paths import is_checkpoint, read_raw

    root = Path(checkpoint)
    where = f"--record: CHECKPOINT={str(root)!r}"
    if not root.is_dir() or not is_checkpoint(root):
        raise ConfigError(
            f"{where} is not a headkit checkpoint folder (no {MANIFEST} written by headkit); "
            "--record writes results only into headkit checkpoints (headkit train, "
            "save_pretrained); leave --record out to only print them",
            field="--record",
            value=str(root),
        )
    if not owns_card(root, read_raw(root / MANIFEST)):
        raise ConfigError(
            f"{where}: its {CARD} is not the card headkit wrote (written or edited by hand); "
            "--record would leave it stale, so it records nothing: leave --record out, or "
            f"remove {CARD} and headkit writes its card again",
            field="--record",
            value=str(root),
        )
    paths = [root] + [root / n for n in (CLI_SETTINGS, CARD, MANIFEST) if (root / n).exists()]
    locked = [p for p in paths if not os.access(p, os.W_OK) or not p.stat().st_mode & 0o222]
    if locked:
        names = ", ".join("the folder" if p == root else p.name for p in locked)
        raise ConfigError(
            f"{where} is read-only ({names}); --record writes the results into "
            f"{CLI_SETTINGS} and {CARD}: make it writable, or leave --record out",
            field="--record",
            value=str(root),
        )
    return root


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
        "evaluations": (
            lambda v: (
                isinstance(v, list)
                and all(
                    isinstance(e, dict)
                    and isinstance(e.get("data"), str)
                    and isinstance(e.get("metrics"), dict)
                    for e in v
                )
            ),
            "a list of {data: name, metrics: {head: {metric: value}}} (headkit eval --record)",
        ),
    }
    for key, (ok, allowed) in checks.items():
        if key in settings and not ok(settings[key]):
            raise ConfigError(
                f"{where}: {key}={settings[key]!r} is invalid; allowed: {allowed} (write the "
                "file again with headkit train, or fix it by hand)"
            )
    return settings
