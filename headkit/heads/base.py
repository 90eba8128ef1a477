"""Heads: ``Head`` (pooling + block_gradients), the ``HEADS`` registry, ``build_head``.

A head kind is a ``Head`` subclass registered by name (``HeadConfig.head_type``, default
"mlp"). It is built as ``cls(config, pooler_size=..., pooler=...)`` from a resolved config
(and ``special_tokens=...`` too when its pooling skips a vision backbone's leading special
tokens, "patch_mean")
(``in_size`` and ``num_outputs`` set) and implements ``from_features`` (what it computes on
its input); ``Head`` provides the pooling of sequence heads, so a new kind only says what it
does with a (batch, width) or (batch, seq, in_size) input. Its parameters and buffers are
saved with the checkpoint like any module's.

What the rest of headkit needs to know of a head it asks the head, never its attributes:

- ``output_projection()``: the Linear producing the outputs. Resizing the vocabulary resizes
  it (``replace_output_projection``); a head that is nothing but it (``projection_only``) and
  is named ``lm_head`` starts from the task model's LM head, and a frozen one shares the
  input embeddings (``backbone/tying.py``).
- ``dense_layers()``: the head as a chain of Linear layers and activations (exports).
- ``linear_form()``: the head as one Linear and an activation, when it is one: heads of one
  shape on one input then run as one matmul (``stacked.py``).
- ``parameter_count(config)`` and ``tensor_count(config)`` (class methods): its size from the
  config alone, so the size guards refuse a head before anything is allocated.

Each has a default that says "not known", so a new kind needs none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ConfigError
from ..registry import Registry
from .pooling import (
    SequencePooling,
    needs_special_tokens,
    pooled_width,
    pooling_parameter_count,
)

if TYPE_CHECKING:
    from ..config import HeadConfig

HEADS: Registry = Registry("head type", "head_type")


class Head(nn.Module):
    """Base class of head kinds: pooling for sequence heads, then ``from_features``.

    ``pooling_key`` identifies inputs that several heads can share: heads on the same layer
    with the same parameter-free pooling get one pooled tensor per forward (HeadedModel
    computes it once).
    """

    def __init__(
        self,
        config: HeadConfig,
        pooler_size: int | None = None,
        pooler: nn.Module | None = None,
        special_tokens: int | None = None,
    ) -> None:
        super().__init__()
        if config.in_size is None or config.num_outputs is None:
            raise ConfigError(
                f"{type(self).__name__}({config.name!r}) needs a resolved config: "
                f"in_size={config.in_size}, num_outputs={config.num_outputs} (HeadedModel fills "
                "them from the backbone)"
            )
        self.config = config
        self.name = config.name
        self.pooling: SequencePooling | None = None
        if config.pred_for_sequence:
            strategies = config.pooling_strategies or ["first"]
            self.pooling = SequencePooling(
                strategies, config.in_size, pooler_size, pooler, special_tokens
            )

    @property
    def in_features(self) -> int:
        """Width of what ``from_features`` takes (the pooled width for sequence heads)."""
        return self.pooling.out_size if self.pooling is not None else self.config.in_size

    @property
    def pooling_key(self) -> tuple[Any, ...] | None:
        """A key under which this head's pooled input can be shared, or None (it can't)."""
        if self.pooling is None or self.pooling.has_parameters:
            return None
        return (self.config.pooling, self.config.block_gradients)

    def features(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The head's input: pooled (batch, width) or per-token (batch, seq, in_size)."""
        if self.config.block_gradients:
            hidden = hidden.detach()
        if self.pooling is not None:
            hidden = self.pooling(hidden, mask)
        return hidden

    def forward(self, hidden: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (batch, seq, in_size) → (batch, num_outputs) or (batch, seq, num_outputs)."""
        if hidden.shape[-1] != self.config.in_size:
            raise ConfigError(
                f"head {self.name!r}: hooked states have width {hidden.shape[-1]} but "
                f"in_size={self.config.in_size}"
            )
        return self.from_features(self.features(hidden, mask))

    def from_features(self, features: torch.Tensor) -> torch.Tensor:
        """What the head computes on its (pooled) input."""
        raise NotImplementedError

    # ------------------------------------------------------------------ hooks
    def output_projection(self) -> nn.Linear | None:
        """The Linear producing the outputs (``out_features == num_outputs``), or None."""
        return None

    def replace_output_projection(self, linear: nn.Linear) -> None:
        """Put ``linear`` where ``output_projection()`` is (a resized vocabulary)."""
        old = self.output_projection()
        for module in self.modules() if old is not None else ():
            for name, child in module.named_children():
                if child is old:
                    setattr(module, name, linear)
                    return
        raise ConfigError(
            f"head {self.name!r} ({type(self).__name__}) has no output projection among its "
            "submodules to replace"
        )

    @property
    def projection_only(self) -> bool:
        """Whether the head learns nothing but its output projection (a one-layer MLP head):
        its outputs are that Linear of its features, up to a parameter-free activation."""
        proj = self.output_projection()
        if proj is None:
            return False
        own = {id(p) for p in proj.parameters()}
        return all(id(p) in own for p in self.parameters())

    def linear_form(self) -> tuple[nn.Linear, nn.Module | None] | None:
        """``(linear, activation)`` when ``from_features(x)`` is exactly ``linear(x)`` followed
        by ``activation`` (a parameter-free module; None: nothing), so that heads of one
        shape on one input may run as one matmul (``heads/stacked.py``); None otherwise.
        Asked every forward: answer from the modules as they are now."""
        return None

    def dense_layers(self) -> list[tuple[nn.Linear, str]] | None:
        """The head as Linear layers, each with the name of the activation after it (an
        ``ACTIVATIONS`` name), applied in order to its features; None when it is not one."""
        return None

    @classmethod
    def parameter_count(cls, config: HeadConfig, pooler_size: int | None = None) -> int | None:
        """Parameters of this kind built from ``config`` (resolved sizes), counted without
        building it; None when the kind cannot tell (the guard then builds it on the meta
        device). ``pooler_size``: the width of the backbone's pooler."""
        return None

    @classmethod
    def tensor_count(cls, config: HeadConfig) -> int | None:
        """At least how many tensors a checkpoint of this kind holds (None: unknown)."""
        return None

    @staticmethod
    def pooled_width(config: HeadConfig, pooler_size: int | None = None) -> int:
        """``in_features`` of a head built from ``config``, without building it."""
        if not config.pred_for_sequence:
            return config.in_size
        return pooled_width(config.pooling_strategies or ["first"], config.in_size, pooler_size)

    @staticmethod
    def pooling_parameter_count(config: HeadConfig) -> int:
        """Parameters the pooling of a head built from ``config`` learns (0 for token heads)."""
        if not config.pred_for_sequence:
            return 0
        return pooling_parameter_count(config.pooling_strategies or ["first"], config.in_size)


def build_head(
    config: HeadConfig,
    pooler_size: int | None = None,
    pooler: nn.Module | None = None,
    max_parameters: int | None = None,
    special_tokens: int | None = None,
) -> Head:
    """Build the head kind named by ``config.head_type`` (``HEADS`` registry).

    ``special_tokens`` (a vision backbone's leading non-patch tokens) is passed on only to a
    head whose pooling reads it ("patch_mean"), so kinds that never pool so need not take it.

    With ``max_parameters``, a head that would hold more parameters is refused with a
    ConfigError before anything is allocated (its kind counts them from the config, or it
    is first built on the meta device).
    """
    cls = HEADS.get(config.head_type)
    kwargs: dict[str, Any] = {"pooler_size": pooler_size, "pooler": pooler}
    if config.pred_for_sequence and needs_special_tokens(config.pooling_strategies or []):
        kwargs["special_tokens"] = special_tokens
    if max_parameters is not None:
        _check_head_size(cls, config, kwargs, max_parameters)
    return cls(config, **kwargs)


def _check_head_size(
    cls: type[Head], config: HeadConfig, kwargs: dict[str, Any], limit: int
) -> None:
    sizes = {"in_size": config.in_size, "num_outputs": config.num_outputs}
    if config.num_layers > 1:
        sizes["hidden_size"] = config.hidden_size
    fields = ", ".join(f"{k}={v}" for k, v in sizes.items())

    def refuse(count: str) -> ConfigError:
        # name what the user can lower: in_size is the backbone's width
        choices = {k: v for k, v in sizes.items() if k != "in_size"}
        field, value = max(choices.items(), key=lambda kv: kv[1] or 0)
        return ConfigError(
            f"HeadConfig(name={config.name!r}): {field}={value} makes a head of {count} "
            f"parameters ({fields}, num_layers={config.num_layers}), over the limit "
            f"max_head_parameters={limit:,}; lower {field}, or raise the limit with "
            "HeadedModel(..., max_head_parameters=...)"
        )

    count = cls.parameter_count(config, kwargs["pooler_size"])
    if count is None:  # a kind that cannot count itself: build it where nothing is allocated
        try:
            with torch.device("meta"):
                probe = cls(config, **kwargs)
        except (RuntimeError, OverflowError) as e:  # sizes torch cannot even describe
            raise refuse(f"too many ({e})") from None
        count = sum(p.numel() for p in probe.parameters())
    if count > limit:
        raise refuse(f"{count:,}")


class HeadDict(nn.ModuleDict):
    """The heads by name: an ``nn.ModuleDict`` that also takes names which are attributes of
    ``nn.ModuleDict`` (``"type"``, ``"keys"``, ``"to"``, ``"training"``, ...).

    Heads are read by ``heads[name]``; state-dict keys stay ``heads.<name>.``. Attribute
    access (``heads.keys``) keeps meaning the method, so ``HeadedModel.get_submodule``
    resolves ``"heads.<name>"`` through the dict.
    """

    def __setitem__(self, key: str, module: nn.Module) -> None:
        if not isinstance(key, str) or not key or "." in key:
            raise ConfigError(f"head name {key!r} is invalid; a non-empty string without '.'")
        if not isinstance(module, nn.Module):
            raise ConfigError(f"head {key!r} must be an nn.Module, got {type(module).__name__}")
        self._modules[key] = module  # add_module would refuse names that are attributes

    def __setattr__(self, name: str, value: Any) -> None:
        # ``train()`` sets ``self.training = mode``: a plain attribute even when a head is
        # named "training" (nn.Module would refuse a bool for a child's name)
        if not isinstance(value, nn.Module) and name in self.__dict__.get("_modules", {}):
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)


def get_submodule_by_name(root: nn.Module, target: str) -> nn.Module:
    """``root.get_submodule(target)`` that reads each step from ``_modules`` first, so that
    a head named like a module attribute (``heads.type``) resolves to the head."""
    mod = root
    for item in target.split(".") if target else []:
        child = mod._modules.get(item)
        if child is None:
            return nn.Module.get_submodule(mod, item)
        mod = child
    return mod
