"""The ``PreTrainedModel`` conveniences a Hugging Face user reaches for, on ``HeadedModel``.

``HeadedModel`` is an ``nn.Module`` around an unmodified backbone, so it does not inherit
``PreTrainedModel``; ``PreTrainedConveniences`` (its base class) adds the methods Trainer,
peft and notebooks call: activation (gradient) checkpointing, input-embedding access and
resizing (an ``lm_head`` causal-LM head follows the vocabulary), parameter counts and
``dtype``. Each delegates to the backbone's own method where it has one.

``hide_head_dicts_from_trainer`` makes the vanilla ``Trainer`` gather only ``logits`` from a
``HeadedModelOutput`` (it gathers every non-None output field after ``loss`` except the
names in ``model.config.keys_to_ignore_at_inference``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..distributed.parallel import drop_idle_gradients
from ..errors import ConfigError
from ..heads.base import Head

#: Output fields the vanilla Trainer must not gather as predictions (``logits`` carries them).
TRAINER_IGNORED_OUTPUTS = ("loss_by_head", "adapted_loss_by_head", "preds_by_head")


def hide_head_dicts_from_trainer(config: Any) -> None:
    """Add the per-head dicts to ``config.keys_to_ignore_at_inference`` (kept if already set).

    Trainer reads that list from ``model.config`` (the backbone's config) and otherwise
    ignores only ``"cache"``; without it, ``EvalPrediction.predictions`` would be a tuple
    holding per-batch losses before the predictions.
    """
    if config is None:
        return
    keys = list(getattr(config, "keys_to_ignore_at_inference", None) or ["cache"])
    keys += [k for k in TRAINER_IGNORED_OUTPUTS if k not in keys]
    config.keys_to_ignore_at_inference = keys


def name_classes(config: Any, heads: Mapping[str, Any]) -> None:
    """Record the classes of the one head with a loss (a sequence head whose config lists
    ``extra["classes"]``, as ``headkit train`` writes them) as ``config.id2label`` /
    ``label2id``, which pipelines label their outputs with; only over transformers' default
    names (``LABEL_0``, ...), never over names the backbone's config already gives."""
    trained = [c for c in heads.values() if c.loss_fct is not None]
    if config is None or len(trained) != 1 or not trained[0].pred_for_sequence:
        return
    classes = trained[0].extra.get("classes")
    if not isinstance(classes, list) or len(classes) != trained[0].num_outputs:
        return
    current = getattr(config, "id2label", None) or {}
    if any(str(v) != f"LABEL_{k}" for k, v in current.items()):
        return
    config.id2label = {i: str(c) for i, c in enumerate(classes)}
    config.label2id = {str(c): i for i, c in enumerate(classes)}


class PreTrainedConveniences:
    """``PreTrainedModel`` methods for a model holding ``self.backbone``, ``self.heads`` and
    ``self.head_configs`` (``HeadedModel``)."""

    backbone: Any
    heads: nn.ModuleDict
    head_configs: dict[str, Any]

    # ------------------------------------------------------------------ checkpointing
    @property
    def supports_gradient_checkpointing(self) -> bool:
        """Whether the backbone can recompute its blocks in the backward pass."""
        return bool(getattr(self.backbone, "supports_gradient_checkpointing", False))

    def activation_checkpointing_enable(
        self,
        activation_checkpointing_kwargs: dict | None = None,
        every_n_layers: int = 1,
        offload: bool = False,
    ) -> None:
        """Recompute the backbone's blocks in the backward pass instead of storing their
        activations (what ``TrainingArguments(gradient_checkpointing=True)`` calls).

        Only a backbone in training mode checkpoints (a frozen one stays in eval mode, so
        this changes nothing for probes). The embeddings' output is made to require grad
        only while some backbone parameter is trainable (LoRA under reentrant checkpointing
        needs it; a frozen backbone would otherwise build a graph nobody uses).
        """
        bb = self.backbone
        if hasattr(bb, "activation_checkpointing_enable"):
            bb.activation_checkpointing_enable(
                activation_checkpointing_kwargs, every_n_layers=every_n_layers, offload=offload
            )
        else:  # transformers < 5.23.0 has only this name
            bb.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs=activation_checkpointing_kwargs
            )
        if hasattr(bb, "disable_input_require_grads"):
            bb.disable_input_require_grads()
        self._remove_input_grad_hook()
        emb = _input_embeddings(bb)
        if emb is not None:
            self._input_grad_hook = emb.register_forward_hook(self._inputs_require_grad)

    def activation_checkpointing_disable(self) -> None:
        """Store activations again (undo ``activation_checkpointing_enable``)."""
        bb = self.backbone
        if hasattr(bb, "activation_checkpointing_disable"):
            bb.activation_checkpointing_disable()
        else:
            bb.gradient_checkpointing_disable()
        self._remove_input_grad_hook()

    def gradient_checkpointing_enable(
        self, gradient_checkpointing_kwargs: dict | None = None, **kwargs: Any
    ) -> None:
        """The older name of ``activation_checkpointing_enable`` (same arguments)."""
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        """The older name of ``activation_checkpointing_disable``."""
        self.activation_checkpointing_disable()

    @property
    def is_activation_checkpointing(self) -> bool:
        """Whether any backbone block checkpoints its activations."""
        modules = self.backbone.modules()
        return any(getattr(m, "gradient_checkpointing", False) is True for m in modules)

    @property
    def is_gradient_checkpointing(self) -> bool:
        """The older name of ``is_activation_checkpointing``."""
        return self.is_activation_checkpointing

    def _inputs_require_grad(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if (
            isinstance(output, torch.Tensor)
            and torch.is_grad_enabled()
            and output.is_floating_point()
            and any(p.requires_grad for p in self.backbone.parameters())
        ):
            output.requires_grad_(True)

    def _remove_input_grad_hook(self) -> None:
        hook = self.__dict__.pop("_input_grad_hook", None)
        if hook is not None:
            hook.remove()

    # ------------------------------------------------------------------ embeddings
    def get_input_embeddings(self) -> nn.Module:
        """The backbone's input embeddings."""
        return self.backbone.get_input_embeddings()

    def enable_input_require_grads(self) -> None:
        """Make the input embeddings' output require grad (adapters on a frozen backbone)."""
        self.backbone.enable_input_require_grads()

    def disable_input_require_grads(self) -> None:
        """Undo ``enable_input_require_grads``."""
        self.backbone.disable_input_require_grads()

    def resize_token_embeddings(
        self,
        new_num_tokens: int | None = None,
        pad_to_multiple_of: int | None = None,
        mean_resizing: bool = True,
    ) -> nn.Embedding:
        """Resize the backbone's vocabulary (``PreTrainedModel.resize_token_embeddings``).

        Causal-LM heads whose ``num_outputs`` was the old vocabulary size follow: their output
        projection (``Head.output_projection``) grows or shrinks to the new size, new rows
        initialised as transformers initialises a resized LM head, and ``num_outputs`` in their
        config is updated (so checkpoints stay consistent). Such a head whose kind has no output
        projection is a ConfigError, raised before anything is resized.
        """
        old = _vocab_size(self.backbone)
        following = {
            name: cfg
            for name, cfg in self.head_configs.items()
            if cfg.is_causal_lm and cfg.num_outputs == old
        }
        for name in following:
            head = self.heads[name]
            if not isinstance(head, Head) or head.output_projection() is None:
                raise ConfigError(
                    f"head {name!r} ({type(head).__name__}) predicts the "
                    f"vocabulary ({old} tokens) but has no output_projection() to resize; "
                    "implement Head.output_projection for its kind, or resize before adding it"
                )
        emb = self.backbone.resize_token_embeddings(
            new_num_tokens, pad_to_multiple_of, mean_resizing
        )
        new = int(emb.weight.shape[0])
        if hasattr(self, "info"):
            self.info.vocab_size = new
        if new == old:
            return emb
        for name, cfg in following.items():
            head = self.heads[name]
            _resize_projection(self.backbone, head, new, mean_resizing)
            cfg = cfg.replace(num_outputs=new)
            self.head_configs[name] = cfg
            head.config = cfg
        return emb

    # ------------------------------------------------------------------ hub and pipelines
    def can_generate(self) -> bool:
        """True exactly when a head is a causal-LM head (what pipelines and Trainer ask)."""
        return any(c.is_causal_lm for c in self.head_configs.values())

    @property
    def name_or_path(self) -> str:
        """The backbone's ``name_or_path`` (its hub id or folder)."""
        return str(getattr(self.backbone, "name_or_path", "") or "")

    def push_to_hub(self, repo_id: str, **options: Any) -> Any:
        """Save to a staged folder with its model card and upload it to hub repo ``repo_id``;
        ``dry_run=True`` only stages it (options and refusals: ``headkit.checkpoint.hub``)."""
        from ..checkpoint.hub import push_to_hub

        return push_to_hub(self, repo_id, **{"model_cls": type(self), **options})

    # ------------------------------------------------------------------ parameters
    @property
    def model(self) -> nn.Module:
        """The backbone, also under the name ``model``."""
        return self.backbone

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the backbone's floating-point parameters."""
        dtype = getattr(self.backbone, "dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
        for p in self.backbone.parameters():
            if p.is_floating_point():
                return p.dtype
        return torch.get_default_dtype()

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Parameters of the backbone, heads and loss weighting (each shared tensor once)."""
        skip = set()
        if exclude_embeddings:
            skip = {
                id(m.weight)
                for m in self.modules()
                if isinstance(m, nn.Embedding)  # type: ignore[attr-defined]
            }
        return sum(
            p.numel()
            for p in self.parameters()  # type: ignore[attr-defined]
            if id(p) not in skip and (p.requires_grad or not only_trainable)
        )

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """(trainable parameters, all parameters), as peft's method of that name."""
        return self.num_parameters(only_trainable=True), self.num_parameters()

    def drop_idle_gradients(self) -> list[str]:
        """In a custom DDP loop with ``find_unused_parameters=False``, call this before
        ``optimizer.step()``: heads that had no labels on any rank keep no gradient, so the
        optimizer leaves them untouched (``parallel.drop_idle_gradients``)."""
        return drop_idle_gradients(self)

    def print_trainable_parameters(self) -> None:
        """Print ``trainable params: ... || all params: ... || trainable%: ...`` (peft's line)."""
        trainable, total = self.get_nb_trainable_parameters()
        share = 100 * trainable / total if total else 0.0
        print(
            f"trainable params: {trainable:,d} || all params: {total:,d} || trainable%: {share:.4f}"
        )


# ---------------------------------------------------------------------- helpers
def _input_embeddings(backbone: Any) -> nn.Module | None:
    try:
        emb = backbone.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        return None
    return emb if isinstance(emb, nn.Module) else None


def _vocab_size(backbone: Any) -> int | None:
    emb = _input_embeddings(backbone)
    weight = getattr(emb, "weight", None)
    return int(weight.shape[0]) if weight is not None else None


@torch.no_grad()
def _resize_projection(backbone: Any, head: Head, new: int, mean_resizing: bool) -> None:
    """Replace the head's output projection by one with ``new`` outputs (transformers' rule)."""
    old = head.output_projection()
    resized = backbone._get_resized_lm_head(old, new, mean_resizing=mean_resizing)
    resized.requires_grad_(old.weight.requires_grad)
    head.replace_output_projection(resized)
