"""HeadedModel: a Hugging Face backbone, left untouched, plus named heads on any of its layers.

``forward`` reads top to bottom: route labels → backbone stage (``inputs.prepare_inputs`` and
``run_stage``: checks, positions, only as deep as needed) → head inputs (each pooling computed
once per layer and shared) → heads → objective (``losses.head_loss``) → weighting → output.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from os import PathLike
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .._transformers import ModelOutput, cache_of
from ..backbone.adapters import (
    adopt_adapters,
    freeze_base,
    keep_heads_in_adapter,
    merge_adapters,
    unwrap_peft_model,
)
from ..backbone.inputs import (
    MODEL_INPUTS,
    drop_tokenizer_extras,
    prepare_inputs,
    run_stage,
    split_inputs,
)
from ..backbone.inspection import BackboneInfo, base_model_of, inspect_backbone, prepare_tracing
from ..backbone.sources import BackboneSource, loaded_from, transformers_model_of
from ..backbone.tying import init_lm_head, tied_head_weights
from ..checkpoint import restore, save_checkpoint
from ..config import HeadConfig
from ..distributed import ranks
from ..distributed.parallel import freeze_unreached, inside_strict_ddp, join_idle
from ..distributed.placement import head_devices, loss_device
from ..distributed.sharding import is_sharded, save_sharded
from ..errors import BatchError, CheckpointError, ConfigError
from ..generation.generate import HeadedGenerationMixin
from ..heads.base import HeadDict, build_head, get_submodule_by_name
from ..heads.stacked import head_outputs
from ..losses.objective import target_rules
from ..losses.shared import head_losses
from ..losses.weighting import LossWeighting, build_weighting
from ..modules import device_of
from .guards import NonFiniteGuard, ValueChecks
from .head_inputs import (
    StateKey,
    head_inputs,
    head_masks,
    mask_of,
    resolve_config,
    state_key,
)
from .labels import loss_heads, route_labels, say_no_targets, unused_targets
from .pretrained import PreTrainedConveniences, hide_head_dicts_from_trainer, name_classes
from .rates import RateWatch

#: A head of more parameters than this is refused unless ``max_head_parameters`` says more.
DEFAULT_MAX_HEAD_PARAMETERS = 2**31


@dataclass
class HeadedModelOutput(ModelOutput):
    """What ``HeadedModel.forward`` returns.

    ``preds_by_head[name]`` is (batch, num_outputs) for sequence heads and
    (batch, seq, num_outputs) otherwise. ``loss`` is the sum of ``adapted_loss_by_head``
    (loss_weight × loss with the default weighting); heads without labels are absent from
    the loss dicts. ``cache`` (alias ``past_key_values``) is set when ``use_cache=True``.
    ``logits`` is what Trainer hands to ``compute_metrics``: the predictions of the one head
    with a loss, or ``preds_by_head`` when there are several (or none).
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | dict[str, torch.Tensor] | None = None
    loss_by_head: dict[str, torch.Tensor] | None = None
    adapted_loss_by_head: dict[str, torch.Tensor] | None = None
    preds_by_head: dict[str, torch.Tensor] | None = None
    cache: Any = None
    hidden_states: tuple[torch.Tensor, ...] | None = None
    attentions: tuple[torch.Tensor, ...] | None = None

    @property
    def past_key_values(self) -> Any:  # the name other multi-head libraries use
        return self.cache


class HeadedModel(HeadedGenerationMixin, PreTrainedConveniences, nn.Module):
    """A transformer backbone with named heads.

    ``model`` may be a bare transformer (``BertModel``), a task model (``GPT2LMHeadModel``,
    ``BertForSequenceClassification``) or a ``SentenceTransformer`` (its Transformer module's
    model): its bare transformer becomes ``self.backbone``, and a
    head named ``lm_head`` with ``is_causal_lm=True`` starts from the task model's output
    embeddings, so its predictions equal the original LM logits (a frozen one of a frozen backbone
    that ties it to its input embeddings shares that matrix). The backbone is not
    modified (only frozen, and then put in eval mode, if asked; the per-head output dicts
    are added to its config's ``keys_to_ignore_at_inference`` for Trainer; with heads below
    the last layer, transformers' own output-capturing hooks are installed as its first
    ``output_hidden_states`` call would, for torch.compile), so peft and generation
    utilities can wrap it.

    LoRA: ``model`` may be a ``PeftModel`` or a model with peft adapters injected (see
    ``headkit.integrations.peft``); the adapted bare transformer becomes the backbone, and
    ``freeze_base_model=True`` freezes everything *except* the adapters, which stay
    trainable. Checkpoints then hold the adapter, not the backbone.

    Only the hooked layers' states are kept, and blocks after the deepest hooked layer do
    not run unless something needs them (``use_cache``, ``output_hidden_states``, ...).
    ``layers_path`` names the block stack when inspection cannot find it; ``source`` records
    where the backbone was loaded from (set by the loaders) so that a frozen, unchanged
    backbone is referenced by checkpoints instead of copied. ``check_inputs=False`` skips
    the per-batch input checks (for ``torch.compile`` and hot loops). With a trainable
    backbone and early exit, the blocks after the deepest hooked layer never run and are
    frozen (see ``parallel.freeze_unreached``).

    A label for a target that only loss-free heads (``loss_fct=None``) read is a BatchError
    (it would be ignored) unless ``allow_unused_labels=True``. A head of more than
    ``max_head_parameters`` parameters is refused before it is allocated.
    """

    # HF Trainer passes ``num_items_in_batch`` to models whose forward has ``**kwargs`` and then
    # skips its gradient-accumulation scaling; head losses are per-batch means, so opt out.
    accepts_loss_kwargs = False

    def __init__(
        self,
        model: PreTrainedModel,
        head_configs: Sequence[HeadConfig | dict] | HeadConfig | dict,
        *,
        freeze_base_model: bool = True,
        loss_weighting: str | dict | LossWeighting = "fixed",
        nonfinite_loss: str = "raise",
        early_exit: bool = True,
        check_inputs: bool = True,
        layers_path: str | None = None,
        source: BackboneSource | None = None,
        allow_unused_labels: bool = False,
        max_head_parameters: int = DEFAULT_MAX_HEAD_PARAMETERS,
    ) -> None:
        super().__init__()
        model = transformers_model_of(model)  # a SentenceTransformer: its transformer
        model = unwrap_peft_model(model)  # a PeftModel: its adapted model (adapters injected)
        if not isinstance(model, PreTrainedModel):
            raise ConfigError(
                f"model must be a transformers PreTrainedModel, got {type(model).__name__}"
            )
        if nonfinite_loss not in ("raise", "skip"):
            raise ConfigError(f"nonfinite_loss={nonfinite_loss!r} is invalid; 'raise' or 'skip'")
        self.backbone: PreTrainedModel = base_model_of(model)
        adopt_adapters(model, self.backbone)  # adapters only inside the backbone
        self.info: BackboneInfo = inspect_backbone(self.backbone, layers_path)
        self.layers_path = layers_path
        # a model from_pretrained loaded, still as its files hold it: referenced, not copied
        self.source = source if source is not None else loaded_from(model)
        self.early_exit = early_exit
        self.check_inputs = check_inputs
        self._value_checks = ValueChecks()  # on accelerators: once per batch signature
        self._guard = NonFiniteGuard()  # the non-finite loss guard (sync-free on CUDA)
        self._rate_watch = RateWatch()  # warns once when fresh heads barely move (rates.py)
        self.nonfinite_loss = nonfinite_loss
        self.allow_unused_labels = bool(allow_unused_labels)
        self.max_head_parameters = _check_budget(max_head_parameters)
        self.head_configs: dict[str, HeadConfig] = {}
        self._state_keys: dict[str, StateKey] = {}  # head → the state it reads
        if isinstance(head_configs, (HeadConfig, Mapping)):  # one head: a list of one
            head_configs = [head_configs]
        for cfg in head_configs:
            cfg = HeadConfig.from_dict(cfg) if isinstance(cfg, dict) else cfg
            if not isinstance(cfg, HeadConfig):
                raise ConfigError(f"head_configs must hold HeadConfig objects, got {cfg!r}")
            cfg = self._resolve(cfg)
            self.head_configs[cfg.name] = cfg
            self._state_keys[cfg.name] = state_key(self.info, cfg)
        self._check_targets()
        # each head on the device of the block producing its layer (placement.py)
        devices = head_devices(
            model, self.backbone, self.info, self._state_keys, device_of(self.backbone)
        )
        pooler, pooler_size = self.info.pooler, self.info.pooler_size
        budget = self.max_head_parameters
        self.heads = HeadDict(
            {
                n: build_head(c, pooler_size, pooler, budget, self.info.special_tokens).to(
                    devices[n]
                )
                for n, c in self.head_configs.items()
            }
        )
        #: ``generate``'s defaults: those of the task model (None: from the backbone's config)
        self.generation_config = getattr(model, "generation_config", None)
        # a task model's LM head (T5's task model is its own bare model: it has one too)
        frozen = freeze_base_model or not any(p.requires_grad for p in model.parameters())
        init_lm_head(self.heads, self.head_configs, self.backbone, model, frozen)
        if freeze_base_model:
            freeze_base(self.backbone)  # LoRA adapters, if any, stay trainable
            self.backbone.eval()  # no dropout noise in features nothing learns from
        else:
            freeze_unreached(self)
        hide_head_dicts_from_trainer(self.backbone.config)
        name_classes(self.backbone.config, self.head_configs)  # pipelines' labels
        layers = set(self._state_keys.values())
        prepare_tracing(self.backbone, self.info, layers)  # capture hooks for torch.compile
        self.set_loss_weighting(loss_weighting)
        self._said_no_targets = False  # labels.say_no_targets: once per model

    # ------------------------------------------------------------------ construction
    def _resolve(self, cfg: HeadConfig) -> HeadConfig:
        """Fill the fields that depend on the backbone and check them against it."""
        if cfg.name in self.head_configs:
            raise ConfigError(f"two heads are named {cfg.name!r}; head names must be unique")
        return resolve_config(self.info, self.backbone, cfg)

    def _check_targets(self) -> None:
        """Targets must not be input names, and each must have one label layout."""
        # "self": forward's first parameter cannot also be a keyword label
        # a task model's own "labels" (T5ForConditionalGeneration) may be a head's target
        reserved = {"self", *MODEL_INPUTS} | (
            self.info.forward_params - {"kwargs", "args", "labels"}
        )
        for cfg in self.head_configs.values():
            if cfg.target in reserved:
                raise ConfigError(
                    f"HeadConfig(name={cfg.name!r}): target={cfg.target!r} collides with a model "
                    f"input name; choose another (reserved: {', '.join(sorted(reserved))})"
                )
        target_rules(self.head_configs)  # a target read per example and per position: refused

    def train(self, mode: bool = True) -> HeadedModel:
        """Set train/eval mode; a fully frozen backbone stays in eval mode.

        Its dropout would only add noise to features nothing learns from, make losses
        depend on how batches are split, and break the equivalence with cached features.
        A backbone with trainable parameters (fine-tuning, LoRA) follows ``mode``.
        """
        super().train(mode)
        if mode and not any(p.requires_grad for p in self.backbone.parameters()):
            self.backbone.eval()
        return self

    def set_loss_weighting(self, scheme: str | dict | LossWeighting, **kwargs: Any) -> None:
        """Choose how head losses combine: "fixed", "adaptive", "uncertainty" (a name, or a
        dict ``{"name": ..., **options}``) or a ``LossWeighting`` module."""
        weights = {n: c.loss_weight for n, c in self.head_configs.items()}
        if isinstance(scheme, LossWeighting):
            self.loss_weighting = scheme
        else:
            if isinstance(scheme, Mapping):
                kwargs = {**{k: v for k, v in scheme.items() if k != "name"}, **kwargs}
                scheme = scheme.get("name", "fixed")
            self.loss_weighting = build_weighting(scheme, weights, **kwargs)
        self.loss_weighting.to(loss_device(self.heads, device_of(self.backbone)))

    # ------------------------------------------------------------------ properties
    @property
    def config(self):
        """The backbone's config (lets HF utilities that read ``model.config`` work)."""
        return self.backbone.config

    @property
    def device(self) -> torch.device:
        return device_of(self.backbone)

    @property
    def peft_config(self) -> dict:
        """Set by peft when it wraps this model (``get_peft_model(headed_model, config)``);
        setting it keeps every head and the loss weighting trainable and in the saved adapter."""
        try:
            return self.__dict__["peft_config"]
        except KeyError:
            raise AttributeError("peft_config") from None

    @peft_config.setter
    def peft_config(self, configs: dict) -> None:
        keep_heads_in_adapter(self, configs)
        self.__dict__["peft_config"] = configs

    @peft_config.deleter
    def peft_config(self) -> None:
        self.__dict__.pop("peft_config", None)

    def merge_and_unload(self) -> HeadedModel:
        """Merge the backbone's LoRA adapters into its weights and remove them, in place: a
        plain HeadedModel with the same predictions (its checkpoints then copy the backbone)."""
        merge_adapters(self)
        return self

    def hooked_layers(self) -> dict[str, int]:
        """Each head's resolved index into its stack's hidden_states (0..num_layers; an
        encoder–decoder model's decoder heads index the decoder's; ``num_layers + 1``: the
        ``last_hidden_state`` where it is not ``hidden_states[-1]``)."""
        return {n: k.index for n, k in self._state_keys.items()}

    def state_keys(self) -> dict[str, StateKey]:
        """Each head's captured state: ``StateKey(stack, index)``, its block stack ("encoder",
        also a model's only stack, or "decoder") and the index into that stack's hidden states
        (``model/head_inputs.py``)."""
        return dict(self._state_keys)

    def head_masks(self, inputs: Any) -> dict[str, torch.Tensor | None]:
        """Each head's mask over the positions it reads, from prepared inputs."""
        return head_masks(self.head_configs, self._state_keys, inputs, self.backbone)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        labels: Any = None,
        **targets: Any,
    ) -> HeadedModelOutput | tuple:
        """Run the backbone (only as deep as needed), every head, and the losses.

        Labels come as ``labels={target: tensor, ...}`` (what ``HeadedCollator`` makes, the
        key HF Trainer recognises as the batch's labels), as ``labels=tensor`` for the one
        head with a loss, or as keyword targets (``model(**batch, sentiment=y)``) in
        ``**targets``, which also takes the backbone's own inputs (``pixel_values``, ...).
        A head without its label gets no loss. Padding comes from ``attention_mask`` (no
        mask: every token counts); with a KV cache the mask may cover ``past + new``
        positions, as in generation.
        The output is a ``HeadedModelOutput``; ``return_dict=False`` gives its
        ``to_tuple()`` instead (its fields that are not None, in order), as transformers
        models do when it is passed (the backbone config's ``return_dict`` is not read).
        """
        self._guard.check_pending()  # CUDA: a loss of an earlier step read without waiting
        if self.training and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            self._rate_watch.observe(self)  # a learning rate too low for fresh heads: warn once
        extra, targets = split_inputs(self.info, targets)  # pixel_values, input_values, ...
        labels = self._route_labels(targets if labels is None else {**targets, "labels": labels})
        given = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "inputs_embeds": inputs_embeds,
            **extra,
            **labels,
        }
        signature = self._value_checks.due(given) if self.check_inputs else None  # guards.py
        check = signature is not None
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "past_key_values": past_key_values,
            "inputs_embeds": inputs_embeds,
            "token_type_ids": token_type_ids,
            "use_cache": use_cache,
            "output_attentions": output_attentions,
            "output_hidden_states": output_hidden_states,
            **extra,
        }
        inputs = prepare_inputs(self.backbone, self.info, batch, check)
        full = bool(use_cache or output_attentions or output_hidden_states) or not self.early_exit
        wanted = set(self._state_keys.values())
        captured, out = run_stage(self.backbone, self.info, inputs, wanted, not full)
        masks = self.head_masks(inputs)
        features = self.head_inputs(captured, masks)
        preds = head_outputs(self.heads, features)  # same-shape heads as one matmul
        stack = self.nonfinite_loss == "raise" and {
            n for n, f in features.items() if not f.requires_grad
        }  # heads whose losses may share a call (losses.shared.head_losses)
        losses = self.head_losses(preds, labels, masks, check, stack=stack)
        self._value_checks.passed(signature)
        loss, adapted = self.combine_losses(losses)
        if self.training and torch.is_grad_enabled() and inside_strict_ddp():
            loss = join_idle(self, loss, preds, set(adapted))
        trained = loss_heads(self.head_configs)
        output = HeadedModelOutput(
            loss=loss,
            logits=preds[trained[0]] if len(trained) == 1 else preds,
            loss_by_head=losses,
            adapted_loss_by_head=adapted,
            preds_by_head=preds,
            cache=cache_of(out) if use_cache and out is not None else None,
            hidden_states=getattr(out, "hidden_states", None) if out is not None else None,
            attentions=getattr(out, "attentions", None) if out is not None else None,
        )
        return output.to_tuple() if return_dict is False else output

    def _route_labels(self, labels: dict[str, Any]) -> dict[str, Any]:
        """Flatten ``labels={target: ...}``, give a ``labels`` tensor to the one head with a
        loss, and refuse keys that are no head's target (``labels.route_labels``)."""
        targets = {c.target for c in self.head_configs.values()}
        inputs = (*MODEL_INPUTS, *self.info.extra_inputs)
        labels = route_labels(self.head_configs, drop_tokenizer_extras(labels, targets), inputs)
        given = [k for k, v in labels.items() if v is not None]
        unused = unused_targets(self.head_configs.values(), given)
        if unused and not self.allow_unused_labels:
            raise BatchError(
                f"label(s) for target(s) {sorted(unused)} would be ignored: only head(s) "
                f"{sorted(n for ns in unused.values() for n in ns)} read them, and they have "
                "loss_fct=None; remove them from the batch, give the head a loss, or build "
                "the model with allow_unused_labels=True"
            )
        quiet = self._said_no_targets or not (self.training and torch.is_grad_enabled())
        quiet = quiet or torch.compiler.is_compiling()  # no logging inside a graph
        if not given and not quiet and loss_heads(self.head_configs):  # a Trainer dropped them?
            self._said_no_targets = True
            say_no_targets(self.head_configs)
        return labels

    def head_inputs(
        self, captured: dict, mask: torch.Tensor | Mapping[str, Any] | None
    ) -> dict[str, torch.Tensor]:
        """Each head's input from the hooked states (moved to the head's device where it sits
        elsewhere, ``placement.py``); a parameter-free pooling is computed once per (layer,
        positions, device, pooling) and shared by the heads that ask for it. ``mask``: one
        for all heads, or each head's (``head_masks``)."""
        return head_inputs(self.heads, self._state_keys, captured, mask)

    def head_losses(
        self,
        preds: dict[str, torch.Tensor],
        labels: Mapping[str, Any],
        mask: torch.Tensor | Mapping[str, Any] | None,
        check: bool = True,
        stack: bool | AbstractSet[str] = False,
    ) -> dict[str, torch.Tensor]:
        """Each head's loss, for the heads that have a loss and a label in ``labels``
        (``check``: validate the labels' values on the host; ``mask``: one for all heads, or
        each head's). Labels are checked and counted once for the heads that read them alike;
        ``stack``: the heads whose losses may run as one call (``losses.shared.head_losses``
        says when that is safe; ``forward`` passes the heads whose inputs need no gradient)."""
        masks = {name: mask_of(mask, name) for name in self.head_configs}
        return head_losses(self.head_configs, preds, labels, masks, check, stack=stack)

    def combine_losses(
        self, losses: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """Apply the loss weighting and non-finite guard; return (total, adapted by head).
        The losses are gathered on the first head's device first (``placement.py``)."""
        device = loss_device(self.heads, device_of(self.backbone))
        losses = {k: v.to(device) for k, v in losses.items()}
        return self._guard.combine(losses, self.loss_weighting, self.nonfinite_loss)

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(
        self, save_directory: str | PathLike, *, main_process_only: bool = True, **kwargs: Any
    ) -> None:
        """Atomically write head_configs.json, the heads (safetensors), a LoRA adapter if the
        backbone carries one, and, unless frozen and unchanged since loading, the backbone.

        Under a process group of several ranks the save is collective: every rank calls it,
        rank 0 writes, and every rank returns once it is written (a failure on rank 0 is
        raised on every rank). A model sharded with FSDP2 is saved so always
        (``sharding.save_sharded``: rank 0 writes full tensors). ``main_process_only=False``:
        this process writes the whole checkpoint alone, whatever its rank, with no collective
        (a save only one rank makes, as HeadedTrainer's on rank 0, or one folder per rank)."""
        if not isinstance(main_process_only, bool):
            raise ConfigError(
                f"main_process_only={main_process_only!r:.80} is invalid; True (under a "
                "process group: rank 0 writes, every rank waits) or False (this process "
                "writes alone)"
            )
        if is_sharded(self):
            if not main_process_only:
                raise ConfigError(
                    "main_process_only=False: a model sharded with FSDP2 is saved by every "
                    "rank together (rank 0 writes the full tensors); call it on every rank"
                )
            return save_sharded(self, save_directory, **kwargs)
        rank, world = ranks.current(init=False)
        if world == 1 or not main_process_only:
            save_checkpoint(self, save_directory, **kwargs)
            return None
        error = None
        if rank == 0:
            try:
                save_checkpoint(self, save_directory, **kwargs)
            except BaseException as e:  # every rank must hear of it (ranks.agree)
                error = e
        ranks.agree(error, f"saving {str(save_directory)!r}")
        return None

    @classmethod
    def from_pretrained(cls, checkpoint_dir: str | PathLike, **kwargs: Any) -> HeadedModel:
        """Load a checkpoint written by ``save_pretrained`` (safetensors and JSON only)."""
        if not isinstance(checkpoint_dir, (str, PathLike)):
            raise CheckpointError(
                f"checkpoint_dir={checkpoint_dir!r:.100} is a {type(checkpoint_dir).__name__}; "
                "expected a folder path (str or os.PathLike)"
            )
        return restore(checkpoint_dir, model_cls=cls, **kwargs)

    def get_submodule(self, target: str) -> nn.Module:
        """``nn.Module.get_submodule``, also for heads named like module attributes
        (``"heads.type"``)."""
        return get_submodule_by_name(self, target)

    def head_state_dict(self) -> dict[str, torch.Tensor]:
        """The parameters and buffers headkit adds (heads and loss weighting); a head weight
        tied to the backbone's input embeddings is the backbone's, not listed here."""
        tied = set(tied_head_weights(self.backbone, self.heads))
        sd = {f"heads.{k}": v for k, v in self.heads.state_dict().items()}
        sd = {k: v for k, v in sd.items() if k not in tied}
        sd.update({f"loss_weighting.{k}": v for k, v in self.loss_weighting.state_dict().items()})
        return sd


def _check_budget(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(
            f"max_head_parameters={value!r} is invalid; a positive integer, or None for no limit"
        )
    return int(value)
