"""Run by test_distributed.py on two CPU ranks (gloo), under ``torchrun`` or ``accelerate launch``.

``python distributed_worker.py OUT_DIR`` trains a tiny GPT-2 whose backbone is trainable and
whose "cls" head reads a middle layer (hidden state 2 of 4), plus an "aux" head that never
gets labels, with DDP's ``find_unused_parameters=False``:

1. a custom accelerate loop (``Accelerator`` + ``DistributedDataParallelKwargs``), then
2. ``HeadedTrainer`` (``ddp_find_unused_parameters=False``).

Blocks 2 and 3 and the final norm never run (early exit), so HeadedModel freezes them;
"aux" joins the loss with an exact zero inside DDP, and ``drop_idle_gradients`` (called by
HeadedTrainer, and by the loop before ``optimizer.step()``) keeps AdamW from moving it.
Each rank writes
``<mode>-rank<r>.safetensors`` (all parameters) and ``<mode>-rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from accelerate import Accelerator, DistributedDataParallelKwargs
from safetensors.torch import save_file
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from headkit import HeadConfig, HeadedCollator, HeadedModel, HeadedTrainer

STEPS = 3
PER_DEVICE_BATCH = 4


def build_model() -> tuple[HeadedModel, list[str]]:
    """The model and the warnings its construction gave."""
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=4,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    heads = [
        HeadConfig("cls", layer_hook=2, num_outputs=3, pred_for_sequence=True),
        HeadConfig("aux", layer_hook=1, num_outputs=2, pred_for_sequence=True),
    ]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = HeadedModel(GPT2LMHeadModel(cfg), heads, freeze_base_model=False)
    return model, [str(w.message) for w in caught]


def build_data() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (16, 6), generator=g)
    return [{"input_ids": ids[i].tolist(), "cls": i % 3} for i in range(16)]


def _write(out: Path, mode: str, rank: int, model: HeadedModel, report: dict) -> None:
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(out / f"{mode}-rank{rank}.safetensors"))
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps(report))


def run_loop(out: Path) -> None:
    ddp = DistributedDataParallelKwargs(find_unused_parameters=False)
    acc = Accelerator(cpu=True, kwargs_handlers=[ddp])
    model, caught = build_model()
    loader = DataLoader(build_data(), batch_size=PER_DEVICE_BATCH, collate_fn=HeadedCollator(model))
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
    report = {
        "world_size": acc.num_processes,
        "distributed_type": str(acc.distributed_type),
        "find_unused_parameters": wrapped.find_unused_parameters,
        "losses": losses,
        "warnings": caught,
    }
    _write(out, "loop", acc.process_index, model, report)


def run_trainer(out: Path) -> None:
    model, caught = build_model()
    args = TrainingArguments(
        output_dir=str(out / "run"),
        per_device_train_batch_size=PER_DEVICE_BATCH,
        max_steps=STEPS,
        learning_rate=1e-2,
        weight_decay=0.1,  # would move a head with zero gradients
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    trainer = HeadedTrainer(model=model, args=args, train_dataset=build_data())
    trainer.train()
    wrapped = trainer.model_wrapped
    report = {
        "world_size": args.world_size,
        "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "warnings": caught,
    }
    _write(out, "trainer", int(os.environ.get("RANK", "0")), model, report)


if __name__ == "__main__":
    torch.set_num_threads(1)
    target = Path(sys.argv[1])
    run_loop(target)
    run_trainer(target)
    # Leave together: a rank that exits while its peer's gloo threads still talk to it makes
    # the peer abort (SIGABRT) at shutdown.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
