"""Argument types and options shared by the commands (argparse only: ``--help`` stays light).

A bad value raises ``argparse.ArgumentTypeError`` naming the value and what is allowed;
argparse turns it into ``argument --option: invalid value ...``.
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

DATA_HELP = (
    "CSV, JSONL, JSON, Parquet, a saved dataset folder, packaged:rotten_tomatoes, "
    "packaged:presidential_debates or packaged:convention_speeches"
)
#: dtype names ``from_pretrained`` takes as ``torch_dtype`` / ``dtype``.
DTYPES = ("auto", "bfloat16", "float16", "float32", "float64", "half", "float", "double")


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: an integer >= 1")
    return value


#: ``--val-splits``: how many validation splits a probe averages over, at most.
MAX_VAL_SPLITS = 100
#: ``--seed``: seeds from 0 to 2**32 - 1 (what numpy, torch and scikit-learn all take).
MAX_SEED = 2**32 - 1


def val_splits(text: str) -> int:
    """``--val-splits``: an integer from 1 to MAX_VAL_SPLITS."""
    return _int_in(text, 1, MAX_VAL_SPLITS)


def seed(text: str) -> int:
    """``--seed``: an integer from 0 to MAX_SEED."""
    return _int_in(text, 0, MAX_SEED)


def _int_in(text: str, low: int, high: int) -> int:
    try:
        value = int(text) if len(text) <= 40 else None
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        raise argparse.ArgumentTypeError(
            f"invalid value {text[:40]!r}; allowed: an integer from {low} to {high}"
        )
    return value


def fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: a number in (0, 1)")
    return value


def floats(text: str) -> list[float]:
    """Comma-separated L2 penalties, each finite and > 0 (the probe's rule:
    ``probe.fit.check_penalties``)."""
    from ..errors import ConfigError
    from ..probe.fit import check_penalties

    try:
        values = [float(v) for v in text.split(",")]
        check_penalties(values)
    except (ValueError, ConfigError):
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}; allowed: comma-separated finite numbers > 0 "
            "(e.g. 1e-3,1e-2,0.1)"
        ) from None
    return values


def key_value(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as JSON where it parses (``4``, ``true``), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def layers(text: str) -> str:
    """The syntax of ``--layers`` now; its range once the model is loaded."""
    from ..errors import ConfigError
    from ..probe.sweep import parse_layers

    try:
        parse_layers(text, 10**6)
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}; allowed: 'all', comma-separated hidden_states indices "
            "('0,3,6'; 0 = embeddings, -1 = last) or slices ('-4:', '1:5')"
        ) from None
    return text


def check_model_kwargs(kwargs: dict[str, Any], where: str = "--model-kwarg") -> None:
    """Refuse a dtype that is not a name ``from_pretrained`` knows (before any loading)."""
    from ..errors import ConfigError

    for key in ("torch_dtype", "dtype"):
        value = kwargs.get(key)
        if value is not None and value not in DTYPES:
            raise ConfigError(f"{where} {key}={value!r} is invalid; allowed: {', '.join(DTYPES)}")


def add_encoding(p: argparse.ArgumentParser) -> None:
    """``--encoding``: the text encoding of the data files a command reads."""
    p.add_argument(
        "--encoding",
        help="text encoding of the data files (default: from the byte-order mark, else UTF-8)",
    )


def add_overwrite(p: argparse.ArgumentParser, what: str = "an existing --output") -> None:
    """``--overwrite``: replace ``what`` (what the command wrote before, never an input)."""
    p.add_argument("--overwrite", action="store_true", help=f"replace {what}")


def poolings(text: str) -> str:
    from ..errors import ConfigError
    from ..probe.sweep import parse_poolings

    try:
        parse_poolings(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quiet", action="store_true", help="no progress bars (transformers' loading bars too)"
    )


def add_batching(p: argparse.ArgumentParser) -> None:
    """``--batch-size``, ``--max-length``, ``--limit`` and ``--quiet``."""
    p.add_argument("--batch-size", type=positive, default=32, help="default 32")
    p.add_argument("--max-length", type=positive, default=128, help="tokens per text (default 128)")
    p.add_argument("--limit", type=positive, help="read at most this many rows")
    add_quiet(p)


def add_threads(p: argparse.ArgumentParser) -> None:
    """``--threads N``, on every command (``main`` applies it)."""
    p.add_argument(
        "--threads",
        type=positive,
        default=None,
        help="torch CPU threads (default: torch's own, one per core; on a busy machine 1 is "
        "often faster). Probe fitting always runs on 1 thread: its small matrices only wait "
        "for each other on more",
    )


#: ``--device`` values: a torch device name (checked against what torch sees once loaded).
_DEVICE = re.compile(r"(cpu|cuda|mps|xpu)(:\d{1,3})?|auto")


def device(text: str) -> str:
    """``--device``'s syntax now (before torch is imported); ``resolve_device`` checks it."""
    if not _DEVICE.fullmatch(text):
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}; allowed: cpu, cuda, cuda:N, mps, xpu or auto"
        )
    return text


#: ``--device``'s values, the end of every command's help for it.
DEVICE_VALUES = "cpu (default), cuda, cuda:N, mps, or auto (cuda when torch sees one, else cpu)"


def add_device(p: argparse.ArgumentParser, what: str = "where the model runs") -> None:
    """``--device``, on every command (``main`` adds it, with the command's ``DEVICE_HELP``:
    what the device is for there)."""
    p.add_argument("--device", type=device, default="cpu", help=f"{what}: {DEVICE_VALUES}")


def resolve_device(name: str | None) -> Any:
    """The ``torch.device`` of ``--device`` (imports torch); a device torch does not see is a
    ConfigError naming the option (``headkit.modules.resolve_device``)."""
    from ..modules import resolve_device as named_device

    return named_device(name, "--device")
