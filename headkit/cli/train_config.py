"""The YAML config of ``headkit train``: a safe loader with an alias budget, and a schema.

The loader is PyYAML's safe loader that refuses a document whose aliases would expand it by
more than ``ALIAS_BUDGET`` nodes (a few hundred bytes of nested aliases otherwise become
10^8 leaves once a head's ``extra`` is walked) and refuses recursive aliases. The schema
(pydantic, strict) checks types and ranges — ``limit``, ``epochs``, ``max_length`` and
``batch_size`` >= 1, ``lr`` > 0 and finite, ``seed`` an integer, booleans only as YAML
booleans (``'false'`` in quotes is text, and refused), dtypes by name — and lists unknown
keys. Every error is one ``ConfigError`` line naming the key, the value and what is allowed.

This module imports pydantic and yaml; ``headkit train`` imports it only when it runs, so
``headkit --help`` stays light.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from ..errors import ConfigError
from .options import DTYPES

#: Nodes that aliases may add to a config beyond the ones written out.
ALIAS_BUDGET = 10_000
#: Largest seed torch takes.
_MAX_SEED = 2**63 - 1


def _number_text(value: Any) -> Any:
    """PyYAML reads ``1e-3`` (no dot) as text: such text is taken as the number it spells."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _auto(value: Any) -> Any:
    """``auto`` is the same as leaving the key out."""
    return None if value == "auto" else value


def _none(value: Any) -> Any:
    """``none`` (or ``null``) is None."""
    return None if value == "none" else value


def _reporters(value: Any) -> Any:
    """``report_to``: a name or a list of names; ``none`` is the empty list."""
    if value in ("none", None):
        return []
    return [value] if isinstance(value, str) else value


#: Where a run keeps its training state (for ``--resume``) and its logs, in the output folder.
STATE_FOLDER = "training_state"
LOG_FOLDER = "logs"
#: ``training.lr_schedule`` values and ``training.report_to`` names.
SCHEDULES = ("constant", "linear", "cosine")
REPORTERS = ("csv", "tensorboard")

Positive = Annotated[int, Field(ge=1)]
Rate = Annotated[float, Field(gt=0, allow_inf_nan=False), BeforeValidator(_number_text)]


class _Section(BaseModel):
    # protected_namespaces=(): a field may start with "model_" (pydantic < 2.10 refuses or warns)
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


class DataSection(_Section):
    """``data:``: the files, the columns and how to read them."""

    train: str
    eval: str | None = None
    text_column: str = "text"
    label_columns: Annotated[dict[str, str], Field(min_length=1)] | None = None
    step_separator: str = "\n"
    limit: Positive | None = None
    encoding: str | None = None


class TrainingSection(_Section):
    """``training:``; None (or ``auto``) for ``epochs`` and ``lr`` picks them by
    ``freeze_backbone`` (``headkit.cli.train.DEFAULTS``)."""

    epochs: Annotated[Positive | None, BeforeValidator(_auto)] = None
    batch_size: Positive = 32
    lr: Annotated[Rate | None, BeforeValidator(_auto)] = None
    max_length: Positive = 128
    seed: Annotated[int, Field(ge=0, le=_MAX_SEED)] = 0
    freeze_backbone: bool = True
    use_cached_features: Literal["auto"] | bool = "auto"
    validation_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.1
    patience: Positive = 10
    metric_for_best_model: str = "loss"
    greater_is_better: bool | None = None
    lr_schedule: Literal[SCHEDULES] = "constant"  # type: ignore[valid-type]
    warmup_ratio: Annotated[float, Field(ge=0, lt=1)] = 0.0
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    weight_decay: Annotated[
        float, Field(ge=0, allow_inf_nan=False), BeforeValidator(_number_text)
    ] = 0.01
    max_grad_norm: Annotated[Rate | None, BeforeValidator(_none)] = None
    gradient_accumulation_steps: Positive = 1
    bf16: bool = False
    fp16: bool = False
    report_to: Annotated[list[Literal[REPORTERS]], BeforeValidator(_reporters)] = []  # type: ignore[valid-type]
    calibrate: bool = True
    threshold: Annotated[Literal["f1", "accuracy"] | None, BeforeValidator(_none)] = None


class ModelKwargs(_Section):
    """``model_kwargs:``: any ``from_pretrained`` arguments; a dtype only by name."""

    model_config = ConfigDict(extra="allow", strict=True, protected_namespaces=())

    torch_dtype: Literal[DTYPES] | None = None  # type: ignore[valid-type]
    dtype: Literal[DTYPES] | None = None  # type: ignore[valid-type]


class TrainConfigFile(_Section):
    """The whole file."""

    model: str
    model_kwargs: ModelKwargs = ModelKwargs()
    heads: Annotated[list[dict[str, Any]], Field(min_length=1)]
    data: DataSection
    training: TrainingSection = TrainingSection()
    output: str | None = None


_SECTIONS: dict[str, type[BaseModel]] = {
    "data": DataSection,
    "training": TrainingSection,
    "model_kwargs": ModelKwargs,
}

#: What each key allows, in words (for the one-line error).
_ALLOWED = {
    "model": "a folder, a hub id, packaged:minilm or packaged:smollm2",
    "model_kwargs": "a mapping of from_pretrained arguments",
    "heads": "a non-empty list of HeadConfig field mappings",
    "data": (
        "a mapping with train, label_columns (not for reward data) and optional eval, "
        "text_column, limit, encoding, step_separator"
    ),
    "training": "a mapping (see docs/cli.md)",
    "output": "a folder path",
    "model_kwargs.torch_dtype": ", ".join(DTYPES),
    "model_kwargs.dtype": ", ".join(DTYPES),
    "data.train": "a data file path or packaged:rotten_tomatoes",
    "data.eval": "a data file path, or leave it out",
    "data.text_column": "a column name",
    "data.label_columns": "a non-empty mapping {head target: column}",
    "data.step_separator": "the text between the steps of stepwise data (TRL's, default a newline)",
    "data.limit": "an integer >= 1 (rows to read), or leave it out",
    "data.encoding": "a text encoding name (utf-8, latin-1, ...), or leave it out",
    "training.epochs": "an integer >= 1, or auto",
    "training.batch_size": "an integer >= 1",
    "training.lr": "a finite number > 0, or auto",
    "training.max_length": "an integer >= 1 (tokens per text)",
    "training.seed": f"an integer 0..{_MAX_SEED}",
    "training.freeze_backbone": "true or false (YAML booleans, not text in quotes)",
    "training.use_cached_features": "auto, true or false",
    "training.validation_fraction": "a number in [0, 1): the share held out for early stopping",
    "training.patience": "an integer >= 1 (epochs without a better validation score)",
    "training.metric_for_best_model": "loss, a metric (accuracy, macro_f1, mse, mae, r2) or "
    "<head>_<metric>",
    "training.greater_is_better": "true, false, or leave it out (by the metric)",
    "training.lr_schedule": ", ".join(SCHEDULES),
    "training.warmup_ratio": "a number in [0, 1): the share of steps with linear warm-up",
    "training.warmup_steps": "an integer >= 0 (optimizer steps of linear warm-up)",
    "training.weight_decay": "a finite number >= 0 (AdamW's decoupled weight decay)",
    "training.max_grad_norm": "a finite number > 0 (clip the gradients' total norm), or none",
    "training.gradient_accumulation_steps": "an integer >= 1 (batches per optimizer step)",
    "training.bf16": "true or false (bfloat16 autocast)",
    "training.fp16": "true or false (float16 autocast with a gradient scaler; a CUDA GPU)",
    "training.report_to": f"none, or a list of {', '.join(REPORTERS)}",
    "training.calibrate": "true or false (fit a temperature per classifier on validation)",
    "training.threshold": "none, f1 or accuracy (choose binary heads' decision threshold)",
}


def load_yaml(path: Path) -> Any:
    """The YAML document of ``path``, read with the safe loader and the alias budget."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {e.start}); save the config as UTF-8"
        ) from None
    try:
        return yaml.load(text, Loader=_BudgetLoader)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    except _Expansion as e:
        raise ConfigError(f"{path}: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: the YAML is nested too deeply to read") from None


def parse_config(raw: Any, where: str) -> TrainConfigFile:
    """``raw`` (the loaded YAML) checked against the schema; one-line ConfigError if not."""
    if not isinstance(raw, dict):
        keys = sorted(TrainConfigFile.model_fields)
        raise ConfigError(f"{where}: the config must be a mapping with keys {keys}")
    try:
        config = TrainConfigFile.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"{where}: {describe_errors(e)}") from None
    return config


def describe_errors(error: ValidationError) -> str:
    """pydantic's errors as one line: unknown keys per section, then each bad value."""
    unknown: dict[str, list[str]] = {}
    problems: list[str] = []
    for e in error.errors():
        key = _dotted(e["loc"])
        if e["type"] == "extra_forbidden":
            section = key.rpartition(".")[0]
            unknown.setdefault(section, []).append(key.rpartition(".")[2])
            continue
        allowed = _ALLOWED.get(key, e["msg"])
        if e["type"] == "missing":
            message = f"key {key!r} is missing; {allowed}"
        else:
            message = f"{key}={e['input']!r} is invalid; allowed: {allowed}"
        if message not in problems:
            problems.append(message)
    lines = []
    for section, keys in unknown.items():
        fields = (_SECTIONS[section] if section else TrainConfigFile).model_fields
        where = f"{section}: " if section else ""
        lines.append(f"{where}unknown key(s) {keys}; allowed: {', '.join(sorted(fields))}")
    return "; ".join(lines + problems)


def _dotted(loc: tuple) -> str:
    """``('training', 'epochs')`` → ``training.epochs``; what follows a key with no schema
    of its own (union member tags, list indices) is dropped; an unknown key ends the path."""
    parts: list[str] = []
    model: type[BaseModel] | None = TrainConfigFile
    for item in loc:
        if model is None or not isinstance(item, str):
            break
        parts.append(item)
        if item not in model.model_fields:
            break
        model = _SECTIONS.get(item) if model is TrainConfigFile else None
    return ".".join(parts)


# ---------------------------------------------------------------------- the loader
class _Expansion(Exception):
    """The document's aliases expand beyond the budget, or refer to themselves."""


class _BudgetLoader(yaml.SafeLoader):
    """The safe loader, refusing documents whose aliases expand beyond ``ALIAS_BUDGET``."""

    def compose_document(self) -> Any:  # type: ignore[override]
        node = super().compose_document()
        written, expanded = _sizes(node)
        if expanded - written > ALIAS_BUDGET:
            raise _Expansion(
                f"its aliases (*name) expand to {_count(expanded)} nodes from {written} written; "
                f"at most {ALIAS_BUDGET} more nodes than written are allowed (write the values "
                "out instead)"
            )
        return node


def _sizes(root: Any) -> tuple[int, int]:
    """(distinct nodes, nodes once every alias is expanded) of a composed YAML graph;
    memoised per node, so a graph of n nodes costs O(n) however far it expands."""
    memo: dict[int, int] = {}
    active: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in memo:
            return memo[key]
        if key in active:
            raise _Expansion("an alias refers to a node that contains it (a recursive alias)")
        active.add(key)
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(k) + size(v) for k, v in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(v) for v in node.value)
        else:
            total = 1
        active.discard(key)
        memo[key] = total
        return total

    expanded = size(root)
    return len(memo), expanded


def _count(n: int) -> str:
    return f"{n:,}" if n < 10**9 else f"about 10^{int(math.log10(n))}"
