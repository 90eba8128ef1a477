"""HeadConfig: what a head reads, what it predicts, and how it is trained.

Field names, order and defaults follow ``transformer-heads`` so its configs run unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

from .activations import ACTIVATIONS
from .errors import ConfigError
from .losses import CLASSIFICATION_LOSSES, LOSSES, PROBABILITY_LOSSES
from .pooling import parse_pooling


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
    ``loss_fct=None`` means the head is never trained by a loss.
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

    def __post_init__(self) -> None:
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
    def _validate(self) -> None:
        def bad(field_name: str, value: Any, allowed: str) -> ConfigError:
            return ConfigError(
                f"HeadConfig(name={self.name!r}): {field_name}={value!r} is invalid; {allowed}"
            )

        if not isinstance(self.name, str) or not self.name or "." in self.name:
            raise ConfigError(
                f"HeadConfig: name={self.name!r} is invalid; a non-empty string without '.'"
            )
        for f in (
            "is_causal_lm",
            "pred_for_sequence",
            "is_regression",
            "output_bias",
            "trainable",
            "block_gradients",
        ):
            v = getattr(self, f)
            if not isinstance(v, bool):
                raise bad(f, v, "expected True or False")
        if self.ignore_pads is not None and not isinstance(self.ignore_pads, bool):
            raise bad("ignore_pads", self.ignore_pads, "expected True, False or None")
        for f in ("in_size", "num_outputs"):
            v = getattr(self, f)
            if v is not None and (not _is_int(v) or v < 1):
                raise bad(f, v, "expected a positive integer or None")
        if not _is_int(self.layer_hook):
            raise bad("layer_hook", self.layer_hook, "expected an integer index into hidden_states")
        if not _is_int(self.num_layers) or self.num_layers < 1:
            raise bad("num_layers", self.num_layers, "expected an integer >= 1 (1 = one Linear)")
        if not _is_int(self.hidden_size) or self.hidden_size < 0:
            raise bad("hidden_size", self.hidden_size, "expected an integer >= 0")
        if self.num_layers > 1 and self.hidden_size < 1:
            raise bad(
                "hidden_size",
                self.hidden_size,
                f"num_layers={self.num_layers} needs hidden_size >= 1 (the width between layers)",
            )
        for f in ("output_activation", "hidden_activation"):
            v = getattr(self, f)
            if v not in ACTIVATIONS:
                raise bad(f, v, f"allowed: {', '.join(ACTIVATIONS.names())}")
        if self.target is not None and (not isinstance(self.target, str) or not self.target):
            raise bad("target", self.target, "expected a non-empty string or None")
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
        if self.loss_fct is not None:
            if self.loss_fct not in LOSSES:
                raise bad(
                    "loss_fct", self.loss_fct, f"allowed: {', '.join(LOSSES.names())} or None"
                )
            if self.is_regression and self.loss_fct.lower() in CLASSIFICATION_LOSSES:
                raise bad(
                    "loss_fct",
                    self.loss_fct,
                    "is_regression=True needs a regression loss "
                    f"({', '.join(n for n in LOSSES.names() if n not in CLASSIFICATION_LOSSES)})",
                )
            if (
                self.loss_fct.lower() in PROBABILITY_LOSSES
                and self.output_activation.lower()
                not in (
                    "sigmoid",
                    "softmax",
                )
            ):
                raise bad(
                    "loss_fct",
                    self.loss_fct,
                    f"'bce' needs probabilities: set output_activation='sigmoid' (it is "
                    f"{self.output_activation!r}) or use loss_fct='bce_with_logits'",
                )
            if self.is_causal_lm and self.loss_fct.lower() not in CLASSIFICATION_LOSSES:
                raise bad("loss_fct", self.loss_fct, "a causal-LM head needs 'cross_entropy'")
        if (
            isinstance(self.loss_weight, bool)
            or not isinstance(self.loss_weight, numbers.Real)
            or not math.isfinite(self.loss_weight)
            or self.loss_weight < 0
        ):
            raise bad("loss_weight", self.loss_weight, "expected a finite number >= 0")
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, numbers.Real)
            or not 0 <= self.dropout < 1
        ):
            raise bad("dropout", self.dropout, "expected a probability in [0, 1)")
        if self.pooling is not None:
            if not self.pred_for_sequence:
                raise bad(
                    "pooling",
                    self.pooling,
                    "pooling applies only to sequence heads (pred_for_sequence=True)",
                )
            parse_pooling(self.pooling, head=self.name)
        if not isinstance(self.extra, dict):
            raise bad("extra", self.extra, "expected a dict of JSON values")

    # ------------------------------------------------------------------ JSON
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HeadConfig:
        """Build from a dict; unknown keys raise ConfigError naming them."""
        if not isinstance(data, dict):
            raise ConfigError(f"a HeadConfig must be a dict of fields, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(
                f"HeadConfig(name={data.get('name')!r}): unknown field(s) {unknown}; "
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
        except (TypeError, json.JSONDecodeError, RecursionError) as e:
            raise ConfigError(f"HeadConfig.from_json: not valid JSON ({e})") from None
        return cls.from_dict(data)

    def replace(self, **changes: Any) -> HeadConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    @property
    def pooling_strategies(self) -> list[str]:
        return parse_pooling(self.pooling) if self.pooling else []


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)
