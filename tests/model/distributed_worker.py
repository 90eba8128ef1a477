"""The DDP runs test_ranks.py's one launch makes on two CPU ranks (gloo).

tests/model/ranks_worker.py calls ``main`` on each rank: three trainings of a tiny GPT-2
with DDP's ``find_unused_parameters=False``, one after the other in one process group:

1. "loop" and 2. "trainer": the backbone is trainable and the "cls" head reads a middle
   layer (hidden state 2 of 4), so blocks 2 and 3 and the final norm never run (early exit)
   and HeadedModel freezes them; "aux" never gets labels. A custom accelerate loop
   (``Accelerator`` + ``DistributedDataParallelKwargs``), then ``HeadedTrainer``.
   ``drop_idle_gradients`` (called by HeadedTrainer, and by the loop before
   ``optimizer.step()``) keeps AdamW from moving "aux".
3. "ddp": ``train_eval_save`` — a frozen backbone with three heads ("aux" never gets
   labels) and learned loss weights, trained by HeadedTrainer on one global batch of 8
   split over the ranks, then evaluated and saved; the test runs the same function in one
   process with batch 8 and compares.

Each rank writes ``<mode>-rank<r>.safetensors`` (the trained weights) and its report
(``rank<r>.json``: one entry per mode).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DistributedDataParallelKwargs
from conftest import build_tiny
from multiproc import rank, run_rank
from safetensors.torch import save_file
from torch.utils.data import DataLoader
from transformers import TrainingArguments

from headkit import HeadConfig, HeadedCollator, HeadedModel, HeadwiseMetrics
from headkit.integrations.trainer import HeadedTrainer

STEPS = 3
PER_DEVICE_BATCH = 4
N_EXAMPLES = 8  # "ddp": one global batch, so every step sees the whole data set in any order
SEQ = 6


def _gpt2(num_layers: int) -> torch.nn.Module:
    """No dropout: one global batch must give the same loss however it is split."""
    return build_tiny(
        "gpt2",
        num_layers,
        dropout=0.0,
        num_attention_heads=2,
        vocab_size=64,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=None,
    )


def _args(out: Path, per_device_batch: int = PER_DEVICE_BATCH, **kwargs: Any) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=per_device_batch,
        per_device_eval_batch_size=per_device_batch,
        max_steps=STEPS,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
        **kwargs,
    )


def _save(out: Path, mode: str, state: dict[str, torch.Tensor]) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    save_file(state, str(out / f"{mode}-rank{rank()}.safetensors"))


# ---------------------------------------------------------------------- early exit
def build_early_exit_model() -> tuple[HeadedModel, list[str]]:
    """The model of "loop" and "trainer", and the warnings its construction gave."""
    heads = [
        HeadConfig("cls", layer_hook=2, num_outputs=3, pred_for_sequence=True),
        HeadConfig("aux", layer_hook=1, num_outputs=2, pred_for_sequence=True),
    ]
    backbone = _gpt2(num_layers=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = HeadedModel(backbone, heads, freeze_base_model=False)
    return model, [str(w.message) for w in caught]


def _early_exit_data() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (16, SEQ), generator=g)
    return [{"input_ids": ids[i].tolist(), "cls": i % 3} for i in range(16)]


def run_loop(out: Path) -> dict[str, Any]:
    ddp = DistributedDataParallelKwargs(find_unused_parameters=False)
    acc = Accelerator(cpu=True, kwargs_handlers=[ddp])
    model, caught = build_early_exit_model()
    data = _early_exit_data()
    loader = DataLoader(data, batch_size=PER_DEVICE_BATCH, collate_fn=HeadedCollator(model))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)
    wrapped, opt, loader = acc.prepare(model, opt, loader)
    wrapped.train()
    losses: list[float] = []
    while len(losses) < STEPS:
        for batch in loader:
            loss = wrapped(**batch).loss
            acc.backward(loss)
            model.drop_idle_gradients()  # "aux" never has labels: no zero gradient for AdamW
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            if len(losses) == STEPS:
                break
    _save(out, "loop", model.state_dict())
    return {
        "world_size": acc.num_processes,
        "distributed_type": str(acc.distributed_type),
        "find_unused_parameters": wrapped.find_unused_parameters,
        "losses": losses,
        "warnings": caught,
    }


def run_trainer(out: Path) -> dict[str, Any]:
    model, caught = build_early_exit_model()
    args = _args(
        out / "trainer-run",
        learning_rate=1e-2,
        weight_decay=0.1,  # would move a head with zero gradients
        save_strategy="no",
    )
    trainer = HeadedTrainer(model=model, args=args, train_dataset=_early_exit_data())
    trainer.train()
    _save(out, "trainer", model.state_dict())
    return {
        "world_size": args.world_size,
        "find_unused_parameters": getattr(trainer.model_wrapped, "find_unused_parameters", None),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "warnings": caught,
    }


# ---------------------------------------------------------------------- ddp
def build_ddp_model() -> HeadedModel:
    heads = [
        HeadConfig("cls", num_outputs=3, pred_for_sequence=True),
        HeadConfig("tok", num_outputs=4),
        HeadConfig(
            "aux", num_outputs=1, pred_for_sequence=True, is_regression=True, loss_fct="mse"
        ),
    ]
    return HeadedModel(_gpt2(num_layers=2), heads, loss_weighting="uncertainty")


def _ddp_data() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (N_EXAMPLES, SEQ), generator=g)
    tok = torch.randint(0, 4, (N_EXAMPLES, SEQ), generator=g)
    return [
        {"input_ids": ids[i].tolist(), "cls": i % 3, "tok": tok[i].tolist()}
        for i in range(N_EXAMPLES)
    ]


def train_eval_save(out: Path, per_device_batch: int) -> dict[str, Any]:
    """HeadedTrainer for STEPS steps, saving at the last, then evaluation; writes
    ``ddp-rank<r>.safetensors`` (head weights) into ``out`` and returns the logged losses,
    eval metrics, whether this rank may save and its save_pretrained calls."""
    model = build_ddp_model()
    saves = []
    real_save = model.save_pretrained

    def counting_save(path, **kwargs):  # the real save, counted per process
        saves.append(str(path))
        return real_save(path, **kwargs)

    model.save_pretrained = counting_save
    args = _args(
        out / "run",
        per_device_batch,
        learning_rate=5e-2,
        save_strategy="steps",
        save_steps=STEPS,
    )
    data = _ddp_data()
    trainer = HeadedTrainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=data,
        compute_metrics=HeadwiseMetrics(model),
    )
    trainer.train()
    metrics = trainer.evaluate()
    _save(out, "ddp", model.head_state_dict())
    return {
        "world_size": args.world_size,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "eval": {k: v for k, v in metrics.items() if "runtime" not in k and "per_second" not in k},
        "should_save": args.should_save,
        "saves": saves,
    }


def main(out: Path) -> dict[str, Any]:
    return {
        "loop": run_loop(out),
        "trainer": run_trainer(out),
        "ddp": train_eval_save(out, N_EXAMPLES // int(os.environ["WORLD_SIZE"])),
    }


if __name__ == "__main__":
    run_rank(main)
