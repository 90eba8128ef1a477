"""Training a HeadedModel with Hugging Face ``Trainer``.

The vanilla ``transformers.Trainer`` works with a HeadedModel and ``HeadedCollator``:

* ``model.forward``'s signature lists every head target, so ``remove_unused_columns`` keeps
  the label columns (``HeadedTrainer`` does not rely on it: it asks the heads which columns
  the model reads, ``_set_signature_columns_if_needed``);
* the collator puts labels under ``batch["labels"]`` (a ``{target: tensor}`` dict, or for a
  model with one head that has a loss, that head's tensor, as ``DataCollatorWithPadding``
  makes it). Trainer finds ``**labels`` in ``forward``'s signature, takes ``"labels"`` as
  its label key, and so computes ``eval_loss``; HeadedModel routes it (``labels.py``);
* the output's first field after ``loss`` is ``logits`` (the one trained head's predictions,
  else ``{head: predictions}``) and the per-head dicts are listed in the backbone config's
  ``keys_to_ignore_at_inference``, so ``compute_metrics`` gets
  ``EvalPrediction(predictions=logits, label_ids=labels)`` the usual way;
* ``HeadedModel.accepts_loss_kwargs = False`` keeps Trainer from passing
  ``num_items_in_batch`` (head losses are per-batch means, scaled for gradient accumulation
  by Trainer as usual);
* a head without labels in a step takes no part in it (its gradient stays None, so the
  optimizer leaves it untouched); under DDP that needs ``find_unused_parameters=True``, the
  default Trainer picks for a HeadedModel. With ``ddp_find_unused_parameters=False`` such
  heads join the loss with an exact zero instead, and HeadedTrainer drops those zero
  gradients before the optimizer step (see ``distributed/parallel.py``).

What the vanilla Trainer cannot do, and ``HeadedTrainer`` (a thin subclass) adds:

* ``save_model`` and checkpoints write a headkit checkpoint (``HeadedModel.save_pretrained``:
  safetensors + JSON, a frozen unchanged backbone referenced rather than copied) instead of
  one ``model.safetensors`` holding the whole state dict, and ``resume_from_checkpoint`` and
  ``load_best_model_at_end`` read it back (the vanilla Trainer's ``_save`` only knows
  ``PreTrainedModel`` and peft models);
* evaluation logs each head's loss as ``eval_<head>_loss`` (the vanilla Trainer reads only
  ``output.loss``);
* ``predict`` returns ``predictions`` as ``{head: array}`` and ``label_ids`` as
  ``{target: array}`` (one array each for a model with one trained head), and heads missing
  from some batches' labels still concatenate;
* a training batch whose every loss was left out (``nonfinite_loss="skip"``) is skipped
  (no update) and counted in the logs as ``skipped_batches``.

Under ``torchrun`` Trainer runs DDP itself; only rank 0 writes checkpoints. With
``TrainingArguments(fsdp=...)`` (accelerate's FSDP: CUDA and other accelerators; on the CPU
it runs DDP instead, with a warning) the checkpoint is written from the full state dict
Trainer gathers.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from ..checkpoint import MANIFEST, restore
from ..checkpoint.card import refresh_card, trainer_metrics
from ..data.collator import HeadedCollator
from ..distributed.parallel import drop_idle_gradients, join_idle
from ..distributed.sharding import is_sharded, plain_parameters
from ..errors import ConfigError
from ..losses.objective import IGNORE_INDEX, label_rule
from ..model.labels import loss_heads, model_columns, route_labels, without_unused_labels
from ..model.rates import HEAD_LR, param_groups

logger = logging.getLogger(__name__)


class HeadedTrainer(Trainer):
    """``transformers.Trainer`` for a HeadedModel: heads at their own learning rate,
    headkit checkpoints, per-head eval losses, predictions by head. ``data_collator``
    defaults to ``HeadedCollator(model, tokenizer)``.

    The optimizer Trainer builds (``args.optim``) gets two rates: the heads
    ``head_learning_rate`` (None: the larger of ``HEAD_LR`` = 3e-3 and
    ``args.learning_rate``), a trainable backbone ``args.learning_rate``
    (``headkit.param_groups``); an ``optimizers=`` of your own is used as given."""

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        data_collator: Any = None,
        *rest: Any,
        head_learning_rate: float | None = None,
        **kwargs: Any,
    ) -> None:
        if model is None or not hasattr(model, "head_configs"):
            raise ConfigError(
                f"HeadedTrainer: model={type(model).__name__} is invalid; a HeadedModel "
                "(use transformers.Trainer for other models)"
            )
        if data_collator is None:
            # Trainer's positional order: train_dataset, eval_dataset, processing_class, ...
            tokenizer = kwargs.get("processing_class", rest[2] if len(rest) > 2 else None)
            data_collator = HeadedCollator(model, tokenizer)
        super().__init__(model, args, data_collator, *rest, **kwargs)
        if self.args.label_smoothing_factor:
            # Trainer would pop batch["labels"] and smooth outputs["logits"], which a
            # HeadedModel does not have: each head computes its own loss.
            raise ConfigError(
                f"HeadedTrainer: label_smoothing_factor={self.args.label_smoothing_factor} is "
                "not supported; allowed: 0 (heads compute their own losses)"
            )
        if self.args.fsdp and not self.is_fsdp_enabled:
            warnings.warn(
                f"HeadedTrainer: TrainingArguments(fsdp={self.args.fsdp!r}) is not applied "
                f"here: accelerate runs {self.accelerator.distributed_type} instead (its FSDP "
                "needs CUDA or another accelerator); to shard on the CPU, call "
                "headkit.shard(model) and train in your own loop (docs/training.md)",
                stacklevel=2,
            )
        self._head_loss_sums: torch.Tensor | None = None
        self.skipped_batches = 0
        self.head_learning_rate = (
            max(HEAD_LR, self.args.learning_rate)
            if head_learning_rate is None
            else head_learning_rate
        )
        param_groups(model, head_lr=self.head_learning_rate)  # checks the rate now
        self.add_callback(_DropIdleGradients(self))

    def create_optimizer(self, model: Any = None) -> torch.optim.Optimizer:
        """Trainer's optimizer (``args.optim`` and its options) over ``param_groups``: the
        heads at ``head_learning_rate``, the backbone at ``args.learning_rate``, weight decay
        on weight matrices."""
        if self.optimizer is not None or self.optimizer_cls_and_kwargs is not None:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, opt_model)
        plain = isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
        special = {"params", "model", "optimizer_dict"} & set(kwargs) or "bitsandbytes" in str(cls)
        if not plain or special:  # GaLore, LOMO, layer-wise, 8-bit, factories: Trainer's way
            return super().create_optimizer(model)
        groups = param_groups(
            self._headed(),
            head_lr=self.head_learning_rate,
            backbone_lr=self.args.learning_rate,
            weight_decay=self.args.weight_decay,
        )
        self.optimizer = cls(
            [{k: v for k, v in g.items() if k != "name"} for g in groups], **kwargs
        )
        return self.optimizer

    # ------------------------------------------------------------------ training

    def _set_signature_columns_if_needed(self) -> None:
        """The columns ``remove_unused_columns`` keeps, known from the model's heads (inputs,
        the backbone's own inputs, every head's target, the label columns) rather than read
        from ``forward``'s signature: HeadedTrainer keeps its target columns itself."""
        if self._signature_columns is None:
            model = self.model
            model = model.get_base_model() if hasattr(model, "get_base_model") else model
            own = getattr(getattr(model, "info", None), "extra_inputs", ())
            columns = model_columns(model.head_configs, own)
            self._signature_columns = sorted(columns | set(self.label_names or []))

    def compute_loss(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """Trainer's loss; a batch whose every head loss was left out as non-finite
        (``nonfinite_loss="skip"``) gives a zero loss that updates nothing."""
        if not model.training or self.compute_loss_func is not None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        outputs = model(**inputs)
        loss = outputs.loss
        if loss is None or (outputs.loss_by_head and not outputs.adapted_loss_by_head):
            if not outputs.loss_by_head:  # no labels at all: Trainer's own error says so
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            if self.skipped_batches == 0:
                logger.warning(
                    "HeadedTrainer: every head loss of a batch was non-finite and left out "
                    "(nonfinite_loss='skip'); the batch is skipped (counted as skipped_batches)"
                )
            self.skipped_batches += 1
            if loss is None and self.args.world_size > 1:
                # DDP must see parameters in the graph: the heads join with an exact zero
                loss = join_idle(self._headed(), None, outputs.preds_by_head, set())
            if loss is None:  # nothing in the graph: no gradient, no update
                loss = torch.zeros((), device=self.args.device, requires_grad=True)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """Trainer's log, plus ``skipped_batches`` once any batch was skipped."""
        if self.skipped_batches and "loss" in logs:
            logs = {**logs, "skipped_batches": self.skipped_batches}
        super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ evaluation
    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, dict | None, dict | None]:
        """One evaluation batch → (total loss, ``{head: preds}``, ``{target: labels}``), or
        the one trained head's (preds, labels) for a model with one head that has a loss."""
        inputs = self._prepare_inputs(inputs)
        heads = self._headed().head_configs
        labels = _labels_of(inputs, heads)
        with torch.no_grad(), self.compute_loss_context_manager():
            # labels only loss-free heads read serve their metrics, not the model call
            out = model(**without_unused_labels(inputs, heads.values()))
        loss = out.loss.detach().mean() if out.loss is not None else None
        if self._head_loss_sums is not None and out.loss_by_head:
            n = inputs["input_ids"].shape[0] if "input_ids" in inputs else 1
            for i, name in enumerate(heads):
                if name in out.loss_by_head:
                    self._head_loss_sums[i, 0] += float(out.loss_by_head[name]) * n
                    self._head_loss_sums[i, 1] += n
        if prediction_loss_only:
            return loss, None, None
        preds = {k: v.detach() for k, v in out.preds_by_head.items()}
        if labels:
            labels = _fill_missing_labels(labels, preds, heads)
        trained = loss_heads(heads)
        if len(trained) == 1:  # plain arrays, as for any transformers model
            target = heads[trained[0]].target
            return loss, preds[trained[0]], (labels[target] if labels else None)
        return loss, preds, (labels or None)

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ):
        """Trainer's loop, plus ``<prefix>_<head>_loss`` for every head that had labels.

        A head's loss is averaged over the examples of the batches that had its labels."""
        heads = list(self._headed().head_configs)
        self._head_loss_sums = torch.zeros(len(heads), 2, dtype=torch.float64)
        try:
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
            sums = self._head_loss_sums
        finally:
            self._head_loss_sums = None
        if self.args.world_size > 1:
            sums = self.accelerator.reduce(sums.to(self.args.device), reduction="sum").cpu()
        for i, name in enumerate(heads):
            if sums[i, 1] > 0:
                output.metrics[f"{metric_key_prefix}_{name}_loss"] = float(sums[i, 0] / sums[i, 1])
        return output

    # ------------------------------------------------------------------ checkpoints
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Write a headkit checkpoint (rank 0 only). Under FSDP Trainer hands over the full
        state dict it gathered: the checkpoint is written from it; another given
        ``state_dict`` (DeepSpeed) falls back to Trainer's own format."""
        headed = self._headed()
        sharded = is_sharded(headed)
        if state_dict is not None and not sharded:
            return super()._save(output_dir, state_dict=state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return None
        os.makedirs(output_dir, exist_ok=True)
        if state_dict is not None:
            with plain_parameters(headed, state_dict):  # full tensors in place of the shards
                headed.save_pretrained(output_dir, main_process_only=False)
        else:  # Trainer saves on rank 0 alone (should_save): no collective to wait at
            headed.save_pretrained(output_dir, main_process_only=False)
        tokenizer = self.processing_class
        if tokenizer is None:
            tokenizer = getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            tokenizer.save_pretrained(output_dir)
        # JSON instead of Trainer's pickled training_args.bin: checkpoints hold no pickle.
        Path(output_dir, "training_args.json").write_text(self.args.to_json_string())
        evals = [e for e in self.state.log_history if any(k.startswith("eval_") for k in e)]
        if Path(output_dir, MANIFEST).is_file():  # the card: settings and the last evaluation
            refresh_card(output_dir, metrics=trainer_metrics(evals[-1]) if evals else None)
        return None

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Trainer's checkpoint, then the model card again with what ``trainer_state.json``
        now says (steps, metrics); a card the user wrote is left alone."""
        super()._save_checkpoint(model, trial)
        folder = Path(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        if self.args.should_save and Path(folder, MANIFEST).is_file():
            refresh_card(folder)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        model = model if model is not None else self.model
        if not Path(resume_from_checkpoint, MANIFEST).is_file():
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        restore(resume_from_checkpoint, model=self.accelerator.unwrap_model(model))
        return None

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or not Path(best, MANIFEST).is_file():
            return super()._load_best_model()
        restore(best, model=self._headed())
        return None

    def _headed(self) -> Any:
        return self.accelerator.unwrap_model(self.model)


class _DropIdleGradients(TrainerCallback):
    """Before each optimizer step: heads idle on every rank keep no (zero) gradient."""

    def __init__(self, trainer: HeadedTrainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        drop_idle_gradients(self.trainer._headed())


def _labels_of(inputs: Mapping[str, Any], heads: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    """``{target: labels}`` of a batch, routed as HeadedModel routes them."""
    targets = {c.target for c in heads.values()}
    given = {k: v for k, v in inputs.items() if (k == "labels" or k in targets) and v is not None}
    routed = route_labels(heads, given)
    return {k: v for k, v in routed.items() if isinstance(v, torch.Tensor)}


def _fill_missing_labels(
    labels: dict[str, torch.Tensor], preds: dict[str, torch.Tensor], heads: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """Give every head's target a label tensor (all -100 where the batch had none), so that
    batches concatenate across the evaluation loop. Metrics ignore -100."""
    out = dict(labels)
    for name, cfg in heads.items():
        if cfg.target in out:
            continue
        p, rule = preds[name], label_rule(cfg)
        shape = p.shape[:-1] if rule.classes or p.shape[-1] == 1 else p.shape
        out[cfg.target] = torch.full(tuple(shape), IGNORE_INDEX, dtype=rule.dtype, device=p.device)
    return out
