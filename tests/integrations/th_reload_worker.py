"""Reload a checkpoint in a fresh process: predictions on the recorded batch and a greedy
generation's tokens, log-probabilities and head outputs (test_th_checkpoints.py)."""

from __future__ import annotations

from pathlib import Path

import torch
from multiproc import run_rank
from th_fixtures import batch

from headkit import load_lora_with_heads


def main(out: Path, checkpoint: str, prompt: str) -> dict:
    model = load_lora_with_heads(checkpoint, only_inference=True)
    with torch.no_grad():
        preds = model(**batch()).preds_by_head
    ids = torch.tensor([[int(t) for t in prompt.split(",")]])
    gen = model.generate(ids, max_new_tokens=4, do_sample=False, eos_token_id=2, pad_token_id=2)
    return {
        "preds": {k: v.tolist() for k, v in preds.items()},
        "sequences": gen.sequences.tolist(),
        "logprobs": gen.token_logprobs.tolist(),
        "head_outputs": {k: v.tolist() for k, v in gen.head_outputs.items()},
    }


if __name__ == "__main__":
    run_rank(main)
