"""HeadConfig: what a head reads, what it predicts, and how it is trained.

The first fields' names, order and defaults are those older multi-head libraries' configs
use, so their configs run unchanged; headkit's own fields come after them. What a loss
allows is asked of its ``LossSpec``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import ConfigError
from .formats import IGNORE_PADS_ALIASES
from .heads.activations import ACTIVATIONS
from .heads.base import HEADS
from .heads.pooling import parse_pooling
from .losses.objective import LOSSES, loss_spec, task_of

#: ``ignore_pads`` value: besides padding, each row's last real token does not count in a
#: token loss (a rule other libraries use; for comparing losses with them). Other names for
#: it are registered in ``formats.IGNORE_PADS_ALIASES`` and stored as this value.
DROP_LAST_REAL = "drop_last_real"

#: Values of ``HeadConfig.stack``: which stack of an encoder–decoder model a head reads.
STACKS = ("encoder", "decoder")
#: Values of ``HeadConfig.pool_over``: which positions a sequence head pools.
POOL_OVER = ("all", "text", "image")

_BOOL_FIELDS = (
    "is_causal_lm",
    "pred_for_sequence",
    "is_regression",
    "output_bias",
    "trainable",
    "block_gradients",
    "last_hidden_state",
)


@dataclass
class HeadConfig:
    """Configuration of one head.

    ``layer_hook`` indexes the hidden-states tuple exactly as ``output_hidden_states=True``
    returns it (0 = embeddings, -1 = the last layer's output, after the final norm for
    models that have one). ``num_layers=1`` is one Linear; ``n > 1`` is n Linears with
    ``hidden_activation`` between them and nothing after the last; ``output_activation``
    applies after the last layer only. ``None`` for ``in_size`` means the backbone's hidden
    size, for ``num_outputs`` the vocabulary size of a causal-LM head (1 otherwise), for
    ``target`` the head's name, for ``ignore_pads`` "not is_causal_lm", and for ``pooling``
    the backbone's natural choice ("last" for decoder-only models, "first" for encoders).
    ``loss_fct=None`` means the head is never trained by a loss. ``head_type`` names the head
    class in the ``HEADS`` registry ("mlp", the default, is ``MLPHead``).

    Other model families: ``stack`` ("encoder", the default, or "decoder") chooses the stack
    of an encoder–decoder model (T5, BART, Whisper) whose ``hidden_states`` ``layer_hook``
    indexes; other models have one stack and ignore it. ``pool_over`` ("all", the default,
    "text" or "image") makes a sequence head of a vision-language model pool only its text
    tokens or only its image tokens. ``last_hidden_state=True`` reads the backbone's
    ``last_hidden_state`` (with ``layer_hook=-1``): where HF's ``hidden_states[-1]`` is taken
    before the final norm (ViT, wav2vec2), this is the output after it, which HF's own
    classifiers read; elsewhere the two are the same.

    Imbalance and calibration: ``class_weights`` (one weight >= 0 per class, or "balanced",
    resolved from the training labels by ``with_class_weights``) weigh a class loss's labels
    (the weighted mean, as ``cross_entropy(weight=)``); ``pos_weight`` (a number > 0, or one
    per output) weighs the positives of ``bce_with_logits`` (as ``BCEWithLogitsLoss``);
    ``loss_options`` sets the loss's own options (``focal``: ``gamma``). ``temperature``
    divides the logits before probabilities are read (``headkit.calibrate`` fits it on
    validation data); ``threshold`` is the decision threshold on the positive probability of
    a binary head or a two-class classifier (None: the loss's default / the argmax). Both are
    saved with the head; ``predict`` and the metrics use them; training ignores them.

    Reward heads: a pairwise loss (``loss_fct="bradley_terry"``) needs a sequence head with
    one output; ``center_rewards_coefficient`` (TRL ``RewardConfig``'s option of that name,
    a number >= 0 or None) adds ``coefficient * mean((r_chosen + r_rejected) ** 2)`` to its
    loss, keeping rewards centred on zero (docs/rewards.md).

    ``name`` is any non-empty string without '.' (also "type", "keys", "my-head").
    NumPy scalars are stored as the Python numbers they hold; ``extra`` must hold JSON values
    (NumPy scalars converted, tuples become lists), so every config saves as JSON.
    """

    name: str
    in_size: int | None = None
    num_outputs: int | None = None
    layer_hook: int = -1
    hidden_size: int = 0
    num_layers: int = 1
    output_activation: str = "linear"
    target: str | None = None
    is_causal_lm: bool = False
    pred_for_sequence: bool = False
    is_regression: bool = False
    output_bias: bool = False
    loss_fct: str | None = "cross_entropy"
    trainable: bool = True
    loss_weight: float = 1.0
    ignore_pads: bool | None = None
    block_gradients: bool = False
    hidden_activation: str = "relu"
    dropout: float = 0.0
    pooling: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    head_type: str = "mlp"
    stack: str = "encoder"
    pool_over: str = "all"
    last_hidden_state: bool = False
    class_weights: list[float] | str | None = None
    pos_weight: float | list[float] | None = None
    loss_options: dict[str, float] = field(default_factory=dict)
    temperature: float = 1.0
    threshold: float | None = None
    center_rewards_coefficient: float | None = None

    def __post_init__(self) -> None:
        self._as_python_values()
        if isinstance(self.ignore_pads, str) and self.ignore_pads in IGNORE_PADS_ALIASES:
            self.ignore_pads = IGNORE_PADS_ALIASES.get(self.ignore_pads)
        self._validate()
        if self.target is None:
            self.target = self.name
        if self.ignore_pads is None:
            self.ignore_pads = not self.is_causal_lm
        if self.pooling is not None:
            self.pooling = "+".join(parse_pooling(self.pooling))
        self.loss_weight = float(self.loss_weight)
        self.dropout = float(self.dropout)

    # ------------------------------------------------------------------ validation
    def _bad(self, field_name: str, value: Any, allowed: str) -> ConfigError:
        return ConfigError(
            f"HeadConfig(name={_show(self.name)}): {field_name}={_show(value)} is invalid; "
            f"{allowed}",
            field=field_name,
            value=value,
        )

    def _as_python_values(self) -> None:
        """NumPy scalars (``np.int64(3)``, ``np.float32(0.5)``, ``np.bool_``) become the Python
        numbers they hold, so configs compare, hash and save as JSON like any other; ``extra``
        must hold JSON values (NumPy scalars converted, tuples become lists)."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, np.generic) and v.dtype.kind in "biuf":
                setattr(self, f.name, v.item())
        if isinstance(self.extra, dict):
            self.extra = _json_value(self.extra, "extra", self)

    def _validate(self) -> None:
        if not isinstance(self.name, str) or not self.name or "." in self.name:
            raise ConfigError(
                f"HeadConfig: name={self.name!r} is invalid; a non-empty string without '.'"
            )
        self._validate_types()
        self._validate_sizes()
        self._validate_kind()
        self._validate_loss()
        self._validate_weights()
        self._validate_calibration()
        if self.pooling is not None:
            if not self.pred_for_sequence:
                raise self._bad(
                    "pooling",
                    self.pooling,
                    "pooling applies only to sequence heads (pred_for_sequence=True)",
                )
            parse_pooling(self.pooling, head=self.name)
        self._validate_positions()

    def _validate_positions(self) -> None:
        """``stack``, ``pool_over`` and ``last_hidden_state``: which states a head reads."""
        if self.stack not in STACKS:
            raise self._bad("stack", self.stack, f"allowed: {', '.join(map(repr, STACKS))}")
        if self.pool_over not in POOL_OVER:
            raise self._bad(
                "pool_over", self.pool_over, f"allowed: {', '.join(map(repr, POOL_OVER))}"
            )
        if self.pool_over != "all" and not self.pred_for_sequence:
            raise self._bad(
                "pool_over",
                self.pool_over,
                "pool_over applies only to sequence heads (pred_for_sequence=True)",
            )
        if self.last_hidden_state and self.layer_hook != -1:
            raise self._bad(
                "layer_hook",
                self.layer_hook,
                "last_hidden_state=True reads the backbone's output: leave layer_hook=-1",
            )

    def _validate_types(self) -> None:
        for f in _BOOL_FIELDS:
            v = getattr(self, f)
            if not isinstance(v, bool):
                raise self._bad(f, v, "expected True or False")
        if self.ignore_pads not in (None, True, False, DROP_LAST_REAL):
            aliases = "".join(f", {a!r}" for a in IGNORE_PADS_ALIASES.names())
            raise self._bad(
                "ignore_pads",
                self.ignore_pads,
                f"expected True, False, None or {DROP_LAST_REAL!r} (padding and each row's "
                f"last real token do not count{aliases and '; also named' + aliases[1:]})",
            )
        for f in ("output_activation", "hidden_activation"):
            v = getattr(self, f)
            if v not in ACTIVATIONS:
                raise self._bad(f, v, f"allowed: {', '.join(ACTIVATIONS.names())}")
        if self.target is not None and (not isinstance(self.target, str) or not self.target):
            raise self._bad("target", self.target, "expected a non-empty string or None")
        if not _is_real(self.loss_weight) or not math.isfinite(self.loss_weight):
            raise self._bad("loss_weight", self.loss_weight, "expected a finite number >= 0")
        if self.loss_weight < 0:
            raise self._bad("loss_weight", self.loss_weight, "expected a finite number >= 0")
        if not _is_real(self.dropout) or not 0 <= self.dropout < 1:
            raise self._bad("dropout", self.dropout, "expected a probability in [0, 1)")
        if not isinstance(self.extra, dict):
            raise self._bad("extra", self.extra, "expected a dict of JSON values")
        if self.head_type not in HEADS:
            raise self._bad("head_type", self.head_type, f"allowed: {', '.join(HEADS.names())}")

    def _validate_sizes(self) -> None:
        for f in ("in_size", "num_outputs", "layer_hook", "hidden_size", "num_layers"):
            v = getattr(self, f)
            if _is_int(v) and not -_INT64 <= v < _INT64:
                raise self._bad(f, v, "expected an integer within +-2**63 (a tensor size or index)")
        for f in ("in_size", "num_outputs"):
            v = getattr(self, f)
            if v is not None and (not _is_int(v) or v < 1):
                raise self._bad(f, v, "expected a positive integer or None")
        if not _is_int(self.layer_hook):
            raise self._bad(
                "layer_hook", self.layer_hook, "expected an integer index into hidden_states"
            )
        if not _is_int(self.num_layers) or self.num_layers < 1:
            raise self._bad(
                "num_layers", self.num_layers, "expected an integer >= 1 (1 = one Linear)"
            )
        if not _is_int(self.hidden_size) or self.hidden_size < 0:
            raise self._bad("hidden_size", self.hidden_size, "expected an integer >= 0")
        if self.num_layers > 1 and self.hidden_size < 1:
            raise self._bad(
                "hidden_size",
                self.hidden_size,
                f"num_layers={self.num_layers} needs hidden_size >= 1 (the width between layers)",
            )

    def _validate_kind(self) -> None:
        if self.is_causal_lm and self.pred_for_sequence:
            raise ConfigError(
                f"HeadConfig(name={self.name!r}): is_causal_lm=True and pred_for_sequence=True "
                "cannot both be set; a causal-LM head predicts one token per position"
            )
        if self.is_causal_lm and self.is_regression:
            raise ConfigError(
                f"HeadConfig(name={self.name!r}): is_causal_lm=True and is_regression=True "
                "cannot both be set"
            )

    def _validate_loss(self) -> None:
        self._validate_pairwise()
        if self.loss_fct is None:
            return
        if self.loss_fct not in LOSSES:
            raise self._bad(
                "loss_fct", self.loss_fct, f"allowed: {', '.join(LOSSES.names())} or None"
            )
        spec = LOSSES.get(self.loss_fct)
        if self.is_regression and spec.classes:
            allowed = ", ".join(n for n in LOSSES.names() if not LOSSES.get(n).classes)
            raise self._bad(
                "loss_fct",
                self.loss_fct,
                f"is_regression=True needs a regression loss ({allowed})",
            )
        if spec.needs_probabilities and self.output_activation.lower() not in (
            "sigmoid",
            "softmax",
        ):
            raise self._bad(
                "loss_fct",
                self.loss_fct,
                f"{self.loss_fct.lower()!r} needs probabilities: set output_activation='sigmoid' "
                f"(it is {self.output_activation!r}) or use loss_fct='bce_with_logits'",
            )
        if self.is_causal_lm and not spec.classes:
            allowed = ", ".join(n for n in LOSSES.names() if LOSSES.get(n).classes)
            raise self._bad(
                "loss_fct",
                self.loss_fct,
                f"a causal-LM head needs a loss over class indices ({allowed})",
            )

    def _validate_weights(self) -> None:
        """``class_weights``, ``pos_weight`` and ``loss_options`` against the head's loss."""
        spec = loss_spec(self) if self.loss_fct in LOSSES else None
        if self.class_weights is not None:
            class_losses = ", ".join(n for n in LOSSES.names() if LOSSES.get(n).classes)
            if spec is None or not spec.classes:
                raise self._bad(
                    "class_weights",
                    self.class_weights,
                    f"class weights apply to a loss over class indices ({class_losses}); "
                    f"loss_fct={self.loss_fct!r}",
                )
            if self.class_weights != "balanced":
                self.class_weights = _weight_list(self, "class_weights", self.class_weights, 0)
        if self.pos_weight is not None:
            allowed = ", ".join(n for n in LOSSES.names() if LOSSES.get(n).pos_weight)
            if spec is None or not spec.pos_weight:
                raise self._bad(
                    "pos_weight",
                    self.pos_weight,
                    f"pos_weight applies to {allowed}; loss_fct={self.loss_fct!r}",
                )
            if _is_real(self.pos_weight):  # one weight for every output
                v = self.pos_weight
                if not math.isfinite(v) or v <= 0:
                    raise self._bad("pos_weight", v, "expected a finite number > 0, or a list")
                self.pos_weight = float(v)
            else:
                self.pos_weight = _weight_list(self, "pos_weight", self.pos_weight, 1e-300)
        if not isinstance(self.loss_options, dict):
            raise self._bad("loss_options", self.loss_options, "expected a dict {option: number}")
        known = dict(spec.options) if spec is not None else {}
        for key, value in self.loss_options.items():
            if key not in known:
                allowed = ", ".join(sorted(known)) or "none (this loss takes no options)"
                raise self._bad(f"loss_options[{key!r}]", value, f"allowed options: {allowed}")
            if not _is_real(value) or not math.isfinite(value) or value < 0:
                raise self._bad(f"loss_options[{key!r}]", value, "expected a finite number >= 0")
            self.loss_options[key] = float(value)

    def _validate_calibration(self) -> None:
        """``temperature`` > 0; ``threshold`` in (0, 1), for binary or two-class heads."""
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t <= 0:
            raise self._bad("temperature", t, "expected a finite number > 0 (1 = unchanged)")
        self.temperature = float(t)
        if self.threshold is None:
            return
        v = self.threshold
        if not _is_real(v) or not 0 < v < 1:
            raise self._bad(
                "threshold", v, "expected a probability in (0, 1), or None for the default"
            )
        task = task_of(self) if self.loss_fct in LOSSES or self.loss_fct is None else None
        two_classes = task == "classification" and self.num_outputs in (None, 2)
        if task != "binary" and not two_classes:
            raise self._bad(
                "threshold",
                v,
                "a decision threshold applies to binary heads (bce, bce_with_logits) and "
                "two-class classifiers (num_outputs=2)",
            )
        self.threshold = float(v)

    def with_class_weights(self, labels: Any) -> HeadConfig:
        """This config with ``class_weights="balanced"`` computed from the training
        ``labels`` (class indices: ``n / (num_outputs * count)`` per class, as scikit-learn)."""
        from .losses.objective import balanced_class_weights

        if self.class_weights != "balanced":
            return self
        if self.num_outputs is None:
            raise self._bad(
                "num_outputs", None, "class_weights='balanced' needs num_outputs (the classes)"
            )
        return self.replace(class_weights=balanced_class_weights(labels, self.num_outputs))

    def _validate_pairwise(self) -> None:
        """A pairwise loss scores one number per sequence; centering needs a pairwise loss."""
        spec = LOSSES.get(self.loss_fct) if self.loss_fct in LOSSES else None
        pairwise = spec is not None and spec.pairwise
        c = self.center_rewards_coefficient
        if c is not None:
            if not _is_real(c) or not math.isfinite(c) or c < 0:
                raise self._bad(
                    "center_rewards_coefficient", c, "expected a finite number >= 0 or None"
                )
            if not pairwise:
                raise self._bad(
                    "center_rewards_coefficient",
                    c,
                    f"it applies to pairwise losses (loss_fct='bradley_terry'), not "
                    f"loss_fct={self.loss_fct!r}",
                )
            self.center_rewards_coefficient = float(c)
        if not pairwise:
            return
        if not self.pred_for_sequence:
            raise self._bad(
                "loss_fct",
                self.loss_fct,
                "a pairwise loss scores whole sequences: set pred_for_sequence=True",
            )
        if self.num_outputs not in (None, 1):
            raise self._bad(
                "num_outputs",
                self.num_outputs,
                f"loss_fct={self.loss_fct!r} scores each sequence with one number: num_outputs=1",
            )

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields that differ from their defaults (and ``name``).

        Leaving defaults out keeps checkpoints readable by versions that do not know a
        field added later.
        """
        ref = _defaults_for(self)
        data = dataclasses.asdict(self)
        return {k: v for k, v in data.items() if k == "name" or v != ref.get(k, _MISSING)}

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, unknown: str = "error") -> HeadConfig:
        """Build from a dict. Unknown keys raise ConfigError naming them, or with
        ``unknown="warn"`` (how checkpoints are read) are ignored with a warning."""
        if not isinstance(data, dict):
            raise ConfigError(f"a HeadConfig must be a dict of fields, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(data) - known, key=str)
        if extra and unknown == "warn":
            warnings.warn(
                f"HeadConfig(name={data.get('name')!r}): ignoring unknown field(s) {extra} "
                "(written by another headkit version?)",
                stacklevel=2,
            )
            data = {k: v for k, v in data.items() if k in known}
        elif extra:
            raise ConfigError(
                f"HeadConfig(name={data.get('name')!r}): unknown field(s) {extra}; "
                f"allowed: {', '.join(sorted(known))}"
            )
        if "name" not in data:
            raise ConfigError("HeadConfig: field 'name' is required")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> HeadConfig:
        try:
            data = json.loads(text)
        except (TypeError, ValueError, RecursionError) as e:  # ValueError: a 5,001-digit int
            raise ConfigError(f"HeadConfig.from_json: not valid JSON ({e})") from None
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> HeadConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ derived
    @property
    def pooling_strategies(self) -> list[str]:
        return parse_pooling(self.pooling) if self.pooling else []

    @property
    def layout(self) -> str:
        """ "causal_lm", "sequence" or "token": what one prediction covers."""
        if self.is_causal_lm:
            return "causal_lm"
        return "sequence" if self.pred_for_sequence else "token"

    @property
    def task(self) -> str:
        """ "lm", "regression", "binary" or "classification" (asked of the loss's spec)."""
        return task_of(self)

    @property
    def spec(self):
        """The head's ``LossSpec`` (None without a loss)."""
        return loss_spec(self)


_MISSING = object()
_INT64 = 2**63


def _json_value(value: Any, path: str, cfg: HeadConfig) -> Any:
    """``value`` as JSON-ready Python data (NumPy scalars converted, tuples as lists), or a
    ConfigError naming the path of the first value JSON cannot hold."""
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        value = value.item()
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if not -_INT64 <= value < _INT64:
            raise cfg._bad(path, value, "expected JSON values (integers within +-2**63)")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise cfg._bad(path, value, "expected JSON values (finite numbers)")
        return value
    if isinstance(value, (list, tuple)):
        return [_json_value(v, f"{path}[{i}]", cfg) for i, v in enumerate(value)]
    if isinstance(value, dict):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise cfg._bad(f"{path} key", bad[0], "expected JSON values (dict keys are strings)")
        return {k: _json_value(v, f"{path}[{k!r}]", cfg) for k, v in value.items()}
    raise cfg._bad(
        path,
        value,
        f"expected JSON values (None, bool, int, float, str, list, dict), got "
        f"{type(value).__name__}",
    )


def _weight_list(cfg: HeadConfig, name: str, values: Any, low: float) -> list[float]:
    """A list of finite weights >= ``low`` (at least one > 0), one per output when
    ``num_outputs`` is known."""
    allowed = (
        f"expected {'a number > 0 or ' if name == 'pos_weight' else ''}a list of finite "
        f"numbers {'> 0' if low > 0 else '>= 0, not all 0'}"
        + (f", one per output ({cfg.num_outputs})" if cfg.num_outputs else "")
        + (" or 'balanced'" if name == "class_weights" else "")
    )
    if isinstance(values, tuple):
        values = list(values)
    if not isinstance(values, list) or not values:
        raise cfg._bad(name, values, allowed)
    for v in values:
        if not _is_real(v) or not math.isfinite(v) or v < low:
            raise cfg._bad(name, values, allowed)
    if not any(v > 0 for v in values):
        raise cfg._bad(name, values, allowed)
    if cfg.num_outputs is not None and len(values) != cfg.num_outputs:
        raise cfg._bad(name, values, allowed)
    return [float(v) for v in values]


def _defaults_for(cfg: HeadConfig) -> dict[str, Any]:
    """What each field of ``cfg`` would be had it been left at its default."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(HeadConfig):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    out["target"] = cfg.name  # None resolves to the name ...
    out["ignore_pads"] = not cfg.is_causal_lm  # ... and to "not is_causal_lm"
    return out


def _show(value: Any) -> str:
    """``repr(value)`` for messages, shortened (a 5,001-digit integer has no repr)."""
    try:
        text = repr(value)
    except ValueError:
        return f"<an integer of {abs(value).bit_length()} bits>"
    return text if len(text) <= 200 else f"{text[:120]}...({len(text)} characters)"


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)
