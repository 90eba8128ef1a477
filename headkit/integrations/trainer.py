"""Training a HeadedModel with Hugging Face ``Trainer``.

The vanilla ``transformers.Trainer`` works with a HeadedModel and ``HeadedCollator``:

* ``remove_unused_columns`` keeps the columns named in ``HeadedModel.forward``'s signature
  (the class's: the text inputs and ``labels``) and ``label``/``label_ids``, so one head
  learning from a ``label`` column trains with the defaults; the heads' target columns are
  not in it, so with several heads pass ``remove_unused_columns=False`` or use
  ``HeadedTrainer``, which asks the heads which columns the model reads
  (``_set_signature_columns_if_needed``). A training forward that gets no label at all says
  so once (``labels.say_no_targets``) before Trainer's "did not return a loss";
* the collator puts labels under ``batch["labels"]`` (a ``{target: tensor}`` dict, or for a
  model with one head that has a loss, that head's tensor, as ``DataCollatorWithPadding``
  makes it). Trainer finds ``labels`` in ``forward``'s signature, takes it as its label
  key, and so computes ``eval_loss``; HeadedModel routes it (``labels.py``);
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
  (no update) and counted in the logs as ``skipped_batches``;
* TRL's reward data trains reward heads as ``RewardTrainer`` / ``PRMTrainer`` would
  (``docs/rewards.md``): a dataset of preference pairs (``chosen`` / ``rejected``, texts or
  conversations, or tokenised) is tokenised as RewardTrainer does (``data/preferences.py``)
  and batched by ``PreferenceCollator``; stepwise supervision (``prompt``, ``completions``,
  ``labels``) as PRMTrainer does (``data/stepwise.py``), for the model's token head. TRL's own
  ``RewardConfig`` / ``PRMConfig`` may be passed as ``args``: their ``max_length``,
  ``step_separator``, ``max_completion_length`` and ``train_on_last_step_only`` are read
  (plain ``TrainingArguments``: no length limit, separator "\\n"), and their
  ``disable_dropout=True`` (TRL's default) sets every dropout of the model to 0, as TRL does.

Under ``torchrun`` Trainer runs DDP itself; only rank 0 writes checkpoints. With
``TrainingArguments(fsdp=...)`` (accelerate's FSDP: CUDA and other accelerators; on the CPU
it runs DDP instead, with a warning) the checkpoint is written from the full state dict
Trainer gathers.
"""

from __future__ import annotations

import inspect
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
from ..data.examples import example_columns, is_streamed
from ..data.preferences import (
    PreferenceCollator,
    has_texts,
    is_preference_data,
    pair_columns,
    tokenize_preferences,
)
from ..data.stepwise import STEP_SEPARATOR, is_stepwise_data, step_head, tokenize_stepwise
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
        # Trainer's positional order: train_dataset, eval_dataset, processing_class, ...
        names = list(inspect.signature(Trainer.__init__).parameters)[4 : 4 + len(rest)]
        twice = sorted(set(names) & set(kwargs))
        if twice:
            raise TypeError(f"HeadedTrainer got multiple values for argument(s) {twice}")
        kwargs = {**dict(zip(names, rest)), **kwargs}
        tokenizer = kwargs.get("processing_class")
        self._reward_data: str | None = None
        self._pair_columns: list[str] = []
        for key, is_eval in (("train_dataset", False), ("eval_dataset", True)):
            if kwargs.get(key) is not None:
                kwargs[key] = self._reward_dataset(kwargs[key], model, tokenizer, args, is_eval)
        _check_centering(model.head_configs, getattr(args, "center_rewards_coefficient", None))
        if getattr(args, "disable_dropout", False):  # TRL's RewardConfig / PRMConfig
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
        if data_collator is None:
            if self._reward_data == "pairs":
                data_collator = PreferenceCollator(model, tokenizer)
            else:
                data_collator = HeadedCollator(model, tokenizer)
        super().__init__(model, args, data_collator, **kwargs)
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

    # ------------------------------------------------------------------ reward data
    def _reward_dataset(
        self, data: Any, model: Any, tokenizer: Any, args: Any, is_eval: bool
    ) -> Any:
        """TRL's preference or stepwise data tokenised as its trainers do; other data (and a
        dict of eval datasets, each in turn) as it is."""
        if isinstance(data, Mapping):
            return {
                k: self._reward_dataset(v, model, tokenizer, args, is_eval) for k, v in data.items()
            }
        columns = getattr(data, "column_names", None)
        if columns is None and isinstance(data, list) and data and isinstance(data[0], Mapping):
            columns = list(data[0])
        if columns is None and is_streamed(data):  # streamed: columns known once read
            columns = example_columns(data, "HeadedTrainer: the dataset")
        if not columns:
            return data
        heads = model.head_configs
        if is_preference_data(columns, heads):
            kind = "pairs"
        elif is_stepwise_data(columns):
            kind = "steps"
        else:
            return data
        if self._reward_data not in (None, kind):
            raise ConfigError(
                "HeadedTrainer: the train and eval datasets must both be preference pairs or "
                "both stepwise supervision"
            )
        self._reward_data = kind
        if tokenizer is None and (kind == "steps" or has_texts(heads, columns)):
            raise ConfigError(
                f"HeadedTrainer: {'preference' if kind == 'pairs' else 'stepwise'} data is "
                "tokenised by the trainer: pass processing_class=tokenizer, as to TRL's trainers"
            )
        max_length = getattr(args, "max_length", None)
        if kind == "pairs":
            out = tokenize_preferences(data, tokenizer, heads, max_length=max_length)
            self._pair_columns = pair_columns(heads, columns)
            return out
        return tokenize_stepwise(
            data,
            tokenizer,
            heads[step_head(heads)].target,
            is_eval=is_eval,
            step_separator=getattr(args, "step_separator", STEP_SEPARATOR),
            max_length=max_length,
            max_completion_length=getattr(args, "max_completion_length", None),
            train_on_last_step_only=getattr(args, "train_on_last_step_only", False),
        )

    def evaluate(self, eval_dataset: Any = None, *args: Any, **kwargs: Any) -> dict[str, float]:
        """Trainer's evaluate; TRL-format data passed here is tokenised as in ``__init__``."""
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = self._reward_dataset(
                eval_dataset, self._headed(), self.processing_class, self.args, True
            )
        return super().evaluate(eval_dataset, *args, **kwargs)

    def predict(self, test_dataset: Any, *args: Any, **kwargs: Any) -> Any:
        """Trainer's predict; TRL-format data is tokenised as in ``__init__``."""
        test_dataset = self._reward_dataset(
            test_dataset, self._headed(), self.processing_class, self.args, True
        )
        return super().predict(test_dataset, *args, **kwargs)

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
            columns |= set(self._pair_columns)  # preference data: what PreferenceCollator reads
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
        if self._reward_data == "pairs" and labels:
            preds, labels = _pairs_by_example(preds, labels, heads)
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


def _check_centering(heads: Mapping[str, Any], coefficient: float | None) -> None:
    """TRL's ``RewardConfig(center_rewards_coefficient=...)`` given as ``args``: in headkit the
    option is each reward head's (``HeadConfig``); refuse a value the heads do not have rather
    than train without it."""
    if coefficient is None:
        return
    differ = [
        n
        for n, c in heads.items()
        if label_rule(c).task == "pairwise" and c.center_rewards_coefficient != coefficient
    ]
    if differ:
        raise ConfigError(
            f"HeadedTrainer: args.center_rewards_coefficient={coefficient} but reward head(s) "
            f"{differ} have another; in headkit it is each head's option: "
            f"HeadConfig(..., center_rewards_coefficient={coefficient})"
        )


def _pairs_by_example(
    preds: dict[str, torch.Tensor], labels: dict[str, torch.Tensor], heads: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A ``PreferenceCollator`` batch's rows regrouped by example: (examples, rows of one
    example, ...). Accelerate cuts the last evaluation batch to the examples the dataset has
    left, counting the first dimension as examples; by example, whole pairs survive the cut.
    The batch's layout (each source of pairs: n chosen rows, then n rejected rows) gives the
    order; within an example, each source's chosen row comes before its rejected row, so the
    k-th chosen still pairs with the k-th rejected once the rows are flattened again."""
    pairwise = [c.target for c in heads.values() if label_rule(c).task == "pairwise"]
    roles = next(labels[t] for t in pairwise if t in labels)
    roles = roles[:, 0] if roles.dim() == 2 else roles
    n = int((roles == 1).sum())
    rows = roles.shape[0]
    if n == 0 or rows % (2 * n):
        return preds, labels
    order = [
        b * 2 * n + side * n + i
        for i in range(n)
        for b in range(rows // (2 * n))
        for side in (0, 1)
    ]
    index = torch.tensor(order, device=roles.device)

    def regroup(x: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, index.to(x.device)).reshape(n, -1, *x.shape[1:])

    return {k: regroup(v) for k, v in preds.items()}, {k: regroup(v) for k, v in labels.items()}


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
