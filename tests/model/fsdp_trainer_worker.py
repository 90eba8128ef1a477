"""HeadedTrainer with ``TrainingArguments(fsdp=...)`` (accelerate's FSDP2) on CUDA ranks:
what test_sharding.py's ``gpu`` test launches (one rank per CUDA device, at most two).

``python fsdp_trainer_worker.py OUT_DIR`` under torchrun: 3 training steps of
ranks_worker's GPT-2 with an early-exit head, each rank on half of one global batch of 8,
then ``trainer.save_model(OUT_DIR/saved)`` (rank 0 writes a headkit checkpoint from the
full state dict Trainer gathers) and the sharded model's predictions on one batch
(``preds-rank<r>.safetensors``).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ranks_worker as shared
import torch
from multiproc import rank, run_rank
from safetensors.torch import save_file
from transformers import TrainingArguments

from headkit import HeadedTrainer
from headkit.distributed.sharding import is_sharded


def main(out: Path) -> dict[str, Any]:
    world = int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    batch = shared.fsdp_batch()
    data = [{k: v[i].tolist() for k, v in batch.items()} for i in range(shared.GLOBAL_BATCH)]
    args = TrainingArguments(
        output_dir=str(out / "run"),
        per_device_train_batch_size=shared.GLOBAL_BATCH // world,
        max_steps=shared.STEPS,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        fsdp=True,
        fsdp_config={
            "fsdp_version": 2,
            "transformer_layer_cls_to_wrap": ["GPT2Block"],
            "state_dict_type": "FULL_STATE_DICT",
        },
    )
    trainer = HeadedTrainer(model=shared.fsdp_model(), args=args, train_dataset=data)
    trainer.train()
    model = trainer.model
    sharded = is_sharded(model)
    trainer.save_model(str(out / "saved"))
    model.eval()
    with torch.no_grad():
        cuda = {k: v.cuda() for k, v in shared.eval_batch().items()}
        preds = model(**cuda).preds_by_head
    save_file(
        {k: v.float().cpu().contiguous() for k, v in preds.items()},
        str(out / f"preds-rank{rank()}.safetensors"),
    )
    return {
        "world": world,
        "fsdp_enabled": trainer.is_fsdp_enabled,
        "sharded": sharded,
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
    }


if __name__ == "__main__":
    run_rank(main)
