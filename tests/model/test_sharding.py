"""``headkit.shard`` (FSDP2) checked in one process: what it refuses. Sharded training,
saving and loading on two CPU ranks are in test_ranks.py; ``HeadedTrainer`` with
``TrainingArguments(fsdp=...)`` needs accelerate's FSDP, which runs on CUDA (on CPU ranks
accelerate runs DDP instead), so that test is ``gpu``-marked here."""

from __future__ import annotations

from pathlib import Path

import pytest
import ranks_worker as shared
import torch
from multiproc import run_ranks
from safetensors.torch import load_file

from headkit import ConfigError, HeadConfig, HeadedModel, shard


def test_shard_takes_a_headed_model(tiny_gpt2):
    with pytest.raises(ConfigError, match="shard takes a HeadedModel, got GPT2LMHeadModel"):
        shard(tiny_gpt2)


def test_shard_without_a_process_group_says_how_to_start_one(tiny_gpt2, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # not started by a launcher
    model = HeadedModel(tiny_gpt2, [HeadConfig("p", num_outputs=2)])
    with pytest.raises(ConfigError, match="shard needs a process group: launch with torchrun"):
        shard(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="accelerate's FSDP needs CUDA")
def test_headed_trainer_with_fsdp_trains_and_saves_a_checkpoint_one_process_loads(tmp_path):
    import fsdp_trainer_worker  # (imports Trainer: only where this test runs)

    nprocs = min(2, torch.cuda.device_count())
    reports = run_ranks(Path(fsdp_trainer_worker.__file__), tmp_path, nprocs=nprocs)
    assert [r["world"] for r in reports] == [nprocs] * nprocs
    assert all(r["fsdp_enabled"] and r["sharded"] for r in reports)
    alone = shared.fsdp_model()
    with torch.no_grad():
        first = alone(**shared.fsdp_batch()).loss  # the whole global batch at the start
    assert reports[0]["losses"][0] == pytest.approx(float(first), rel=1e-4)
    loaded = HeadedModel.from_pretrained(tmp_path / "saved").eval()
    with torch.no_grad():
        want = loaded(**shared.eval_batch()).preds_by_head
    for r in range(nprocs):
        got = load_file(str(tmp_path / f"preds-rank{r}.safetensors"))
        for name, pred in want.items():
            torch.testing.assert_close(got[name], pred, rtol=1e-4, atol=1e-4)
