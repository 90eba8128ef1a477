"""A LoRA checkpoint made from transformer-heads' LoRA save reloads in a new process with the
same predictions and generation (tokens, log-probabilities, head outputs)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from multiproc import run_ranks
from th_fixtures import LORA, batch

from headkit import HeadedModel, load_lora_with_heads

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]


def test_lora_and_generation_reload_in_a_new_process(tmp_path: Path):
    HeadedModel.from_pretrained(LORA).save_pretrained(tmp_path / "ckpt")  # saved here
    model = load_lora_with_heads(tmp_path / "ckpt", only_inference=True)
    with torch.no_grad():
        preds = model(**batch()).preds_by_head
    prompt = torch.tensor([[5, 17, 42, 8]])
    gen = model.generate(prompt, max_new_tokens=4, do_sample=False, eos_token_id=2, pad_token_id=2)
    worker = Path(__file__).with_name("th_reload_worker.py")
    args = [str(tmp_path / "ckpt"), "5,17,42,8"]
    (child,) = run_ranks(worker, tmp_path / "child", launcher="python", nprocs=1, args=args)
    assert set(child["preds"]) == set(preds) and set(child["head_outputs"]) == set(gen.head_outputs)
    for name, value in preds.items():
        torch.testing.assert_close(torch.tensor(child["preds"][name]), value)
    assert child["sequences"] == gen.sequences.tolist()
    torch.testing.assert_close(torch.tensor(child["logprobs"]), gen.token_logprobs)
    for name, value in gen.head_outputs.items():
        torch.testing.assert_close(torch.tensor(child["head_outputs"][name]), value)
