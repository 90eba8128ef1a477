"""transformer-heads 0.2.2's checkpoints and outputs, recorded once (fixtures/transformer_heads/
record.py, run in its own environment): paths, the recorded batch and values as tensors."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

FIXTURES = Path(__file__).parent / "fixtures" / "transformer_heads"
GPT2_BASE, LLAMA_BASE = FIXTURES / "gpt2-base", FIXTURES / "llama-base"
FULL, HEADS_ONLY, LORA = FIXTURES / "gpt2-full", FIXTURES / "gpt2-heads", FIXTURES / "llama-lora"
#: targets whose labels are class indices (the rest are values)
CLASS_TARGETS = ("lm_head", "tok_labels", "seq")


@functools.cache
def records() -> dict[str, Any]:
    return json.loads((FIXTURES / "records.json").read_text())


def batch() -> dict[str, torch.Tensor]:
    """The recorded inputs: two rows, the second right-padded with the pad id."""
    r = records()
    return {
        "input_ids": torch.tensor(r["input_ids"]),
        "attention_mask": torch.tensor(r["attention_mask"]),
    }


def labels() -> dict[str, torch.Tensor]:
    return {
        k: torch.tensor(v).long() if k in CLASS_TARGETS else torch.tensor(v)
        for k, v in records()["labels"].items()
    }


def recorded_preds(name: str, head: str, sequence: bool) -> torch.Tensor:
    """transformer-heads' predictions of a head (checkpoint ``name``): a sequence head's at
    each row's last real token (it predicts at every position), a token head's as they are."""
    preds = torch.tensor(records()[name]["preds_by_head"][head])
    if not sequence:
        return preds
    last = batch()["attention_mask"].sum(-1) - 1
    return preds[torch.arange(preds.shape[0]), last]


def assert_recorded_preds(model: Any, name: str, atol: float = 1e-5) -> None:
    """``model``'s predictions on the recorded batch equal transformer-heads' (real positions)."""
    with torch.no_grad():
        out = model.eval()(**batch())
    mask = batch()["attention_mask"].bool()
    assert set(out.preds_by_head) == set(records()[name]["preds_by_head"])
    for head, preds in out.preds_by_head.items():
        sequence = model.head_configs[head].pred_for_sequence
        want = recorded_preds(name, head, sequence)
        got, want = (preds, want) if sequence else (preds[mask], want[mask])
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-4, msg=f"head {head}")
