"""Training run used by test_ddp.py: under ``torchrun`` (one process per rank) or alone.

``python ddp_worker.py OUT_DIR PER_DEVICE_BATCH`` trains a tiny GPT-2 with three heads
("aux" never gets labels) with HeadedTrainer for STEPS steps, DDP over gloo when launched by
torchrun (``ddp_find_unused_parameters=False``: every parameter must take part in each
step), then evaluates. Each rank writes ``rank<r>.safetensors`` (its head weights) and
``rank<r>.json`` (logged losses, eval metrics, whether it may save, its save_pretrained calls).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from headkit import HeadConfig, HeadedModel, HeadwiseMetrics
from headkit.integrations.trainer import HeadedTrainer

STEPS = 3
N_EXAMPLES = 8  # one global batch: every step sees the whole data set, in any order
SEQ = 6


def build_model() -> HeadedModel:
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,  # no dropout: one global batch must give the same loss however split
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    heads = [
        HeadConfig("cls", num_outputs=3, pred_for_sequence=True),
        HeadConfig("tok", num_outputs=4),
        HeadConfig(
            "aux", num_outputs=1, pred_for_sequence=True, is_regression=True, loss_fct="mse"
        ),
    ]
    return HeadedModel(GPT2LMHeadModel(cfg), heads, loss_weighting="uncertainty")


def build_data() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (N_EXAMPLES, SEQ), generator=g)
    tok = torch.randint(0, 4, (N_EXAMPLES, SEQ), generator=g)
    return [
        {"input_ids": ids[i].tolist(), "cls": i % 3, "tok": tok[i].tolist()}
        for i in range(N_EXAMPLES)
    ]


def main(out_dir: str, per_device_batch: int) -> None:
    out = Path(out_dir)
    model = build_model()
    saves = []
    real_save = model.save_pretrained

    def counting_save(path, **kwargs):  # the real save, counted per process
        saves.append(str(path))
        return real_save(path, **kwargs)

    model.save_pretrained = counting_save
    args = TrainingArguments(
        output_dir=str(out / "run"),
        per_device_train_batch_size=per_device_batch,
        per_device_eval_batch_size=per_device_batch,
        max_steps=STEPS,
        learning_rate=5e-2,
        logging_steps=1,
        save_strategy="steps",
        save_steps=STEPS,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    data = build_data()
    trainer = HeadedTrainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=data,
        compute_metrics=HeadwiseMetrics(model),
    )
    trainer.train()
    metrics = trainer.evaluate()
    rank = int(os.environ.get("RANK", "0"))
    state = {k: v.detach().contiguous().cpu() for k, v in model.head_state_dict().items()}
    save_file(state, str(out / f"rank{rank}.safetensors"))
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    report = {
        "world_size": args.world_size,
        "losses": losses,
        "eval": {k: v for k, v in metrics.items() if "runtime" not in k and "per_second" not in k},
        "should_save": args.should_save,
        "saves": saves,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    # Leave together: a rank that exits while its peer's gloo threads still talk to it makes
    # the peer abort (SIGABRT) at shutdown.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
