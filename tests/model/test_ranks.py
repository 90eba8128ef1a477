"""Past one process, on two CPU ranks (gloo), each compared with one process:
feature caching split across the ranks, a probe sweep split across them, a HeadedModel
sharded with FSDP2 (trained, saved, loaded), and DDP (tests/model/distributed_worker.py's
runs, checked by tests/model/ddp_checks.py).

The ranks are started by ``accelerate launch --multi_gpu`` (on CPU: gloo), which runs
torchrun's own elastic agent (``torch.distributed.run``) with accelerate's settings on top:
one launch covers both launchers' environment, and Trainer and a custom accelerate loop
see accelerate's state as users' scripts do.

Every two-rank scenario runs in ONE launch of tests/model/ranks_worker.py (its docstring
lists them); the reference is computed in this process, on one thread, while the ranks run.
Each test reads its scenario's part of the reports.
"""

from __future__ import annotations

import json
from pathlib import Path

import distributed_worker
import pytest
import ranks_worker as worker
import torch
import torch.distributed as dist
from conftest import build_tiny
from ddp_checks import check_early_exit_training, check_two_ranks_match_one_process
from multiproc import start_ranks
from safetensors.torch import load_file
from torch.utils.data import DataLoader
from transformers import AutoTokenizer

from headkit import HeadedCollator, HeadedModel, cache_features
from headkit.packaged import minilm_path

pytestmark = pytest.mark.slow

WORKER = Path(worker.__file__)
N_DDP = distributed_worker.N_EXAMPLES  # the DDP run's global batch, in one process


def _single(out: Path, model_dir: Path) -> dict:
    """Every scenario in this process (one thread): the reference."""
    model = worker.cache_model()
    data = worker.cache_data()
    loader = DataLoader(data, batch_size=worker.BATCH, collate_fn=HeadedCollator(model))
    trained = worker.fsdp_model()
    return {
        "mem": cache_features(model, data, batch_size=worker.BATCH, progress=False).arrays,
        "folder": cache_features(
            model, data, worker.BATCH, storage=out / "cache-dir", progress=False
        ).path,
        "loader": cache_features(model, loader, progress=False).arrays,
        "one": cache_features(model, worker.cache_data(1), worker.BATCH, progress=False).arrays,
        "probe": worker.probe_json(str(model_dir)),
        "losses": worker.train(trained, slice(0, worker.GLOBAL_BATCH)),
        "preds": worker.predictions(trained),
        "ddp": (out, distributed_worker.train_eval_save(out, N_DDP)),
    }


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[Path, list[dict], dict]:
    """One launch of the worker on two ranks; the reference is computed meanwhile."""
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with the gloo backend")
    model_dir = tmp_path_factory.mktemp("tiny-bert")
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    build_tiny("bert", 3, vocab_size=tokenizer.vocab_size).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path_factory.mktemp("ranks")
    running = start_ranks(WORKER, out, launcher="accelerate", nprocs=2, args=[str(model_dir)])
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = _single(tmp_path_factory.mktemp("single"), model_dir)
    finally:
        torch.set_num_threads(before)
    return out, running.reports(), single


def _equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


# ---------------------------------------------------------------------- caching
def test_cache_features_splits_the_batches_and_every_rank_gets_what_one_process_caches(launch):
    out, reports, single = launch
    caches = [r["cache"] for r in reports]
    assert [c["world"] for c in caches] == [2, 2]
    for r in (0, 1):
        # gathered: the whole cache in the dataset's order, bit for bit one process's
        _equal(load_file(str(out / f"cache-mem-rank{r}.safetensors")), single["mem"])
        _equal(load_file(str(out / f"cache-loader-rank{r}.safetensors")), single["loader"])
        # fewer batches than ranks: rank 1 runs none and still gets the one row
        _equal(load_file(str(out / f"cache-one-rank{r}.safetensors")), single["one"])
    assert [c["mem_len"] for c in caches] == [worker.ROWS] * 2
    assert [c["one_len"] for c in caches] == [1, 1]


def test_gather_false_leaves_each_rank_its_own_contiguous_rows(launch):
    out, reports, single = launch
    # 11 rows in 6 batches of 2: rank 0 runs batches 0-2 (rows 0-5), rank 1 batches 3-5
    shards = [r["cache"]["own_meta"]["shard"] for r in reports]
    assert shards == [
        {"rank": 0, "world_size": 2, "start": 0, "stop": 6, "num_sequences_total": 11},
        {"rank": 1, "world_size": 2, "start": 6, "stop": 11, "num_sequences_total": 11},
    ]
    offsets = single["mem"]["offsets"]
    for shard in shards:
        own = load_file(str(out / f"cache-own-rank{shard['rank']}.safetensors"))
        rows = slice(shard["start"], shard["stop"])
        tokens = slice(int(offsets[shard["start"]]), int(offsets[shard["stop"]]))
        assert torch.equal(
            own["offsets"], offsets[shard["start"] : shard["stop"] + 1] - tokens.start
        )
        assert torch.equal(own["features/L1.mean"], single["mem"]["features/L1.mean"][rows])
        assert torch.equal(own["labels/cls"], single["mem"]["labels/cls"][rows])
        # token features and token labels: only this rank's sequences' real tokens
        assert torch.equal(own["features/L2.tokens"], single["mem"]["features/L2.tokens"][tokens])
        assert torch.equal(own["labels/tok"], single["mem"]["labels/tok"][tokens])


def test_a_folder_written_by_two_ranks_is_byte_for_byte_what_one_process_writes(launch):
    out, reports, single = launch
    folder, alone = out / "cache-dir", single["folder"]
    names = sorted(p.name for p in alone.iterdir())
    assert names == sorted(p.name for p in folder.iterdir()) == reports[0]["cache"]["folder_files"]
    assert "manifest.json" in names and not any(n.startswith("rank") for n in names)
    for name in names:
        assert (folder / name).read_bytes() == (alone / name).read_bytes(), name
    assert [r["cache"]["folder_len"] for r in reports] == [worker.ROWS] * 2


def test_a_failure_on_one_rank_is_raised_on_every_rank(launch):
    _, reports, _ = launch
    errors = [r["cache"]["errors"] for r in reports]
    # a bad token id in rank 1's rows: rank 1 raises it, rank 0 hears of it
    assert errors[1]["bad_token"][0] == "BatchError"
    assert "token id 100, outside the vocabulary" in errors[1]["bad_token"][1]
    assert errors[0]["bad_token"] == [
        "BatchError",
        "caching features failed on rank 1: " + errors[1]["bad_token"][1],
    ]
    # rank 1's examples lack one target
    for e in errors:
        assert e["targets"] == [
            "BatchError",
            "the ranks' batches have labels for different targets: rank 0: ['cls', 'tok'], "
            "rank 1: ['tok']; every batch needs the same targets",
        ]
    # rank 0 prepares the folder; both raise
    assert errors[0]["full_folder"][0] == errors[1]["full_folder"][0] == "ConfigError"
    assert "is not empty; pass overwrite=True" in errors[0]["full_folder"][1]
    assert errors[1]["full_folder"][1].startswith("preparing storage=")


# ---------------------------------------------------------------------- probing
def test_a_probe_sweep_on_two_ranks_gives_every_rank_the_one_process_results(launch):
    out, reports, single = launch
    for r in reports:
        assert r["probe"]["results"] == single["probe"]
    scores = [row["accuracy"] for row in single["probe"]["rows"]]
    assert len(set(scores)) > 1  # a sweep whose layers differ: equality means something
    # the command line: rank 0 prints and writes, rank 1 neither
    assert [r["probe"]["cli_status"] for r in reports] == [0, 0]
    assert "pooling  layer" in reports[0]["probe"]["cli_stdout"]
    assert reports[1]["probe"]["cli_stdout"] == ""
    written = json.loads((out / "probe" / "probe_results.json").read_text())
    written.pop("timings")
    assert written == single["probe"]


# ---------------------------------------------------------------------- FSDP2
def test_fsdp2_trains_like_one_process_and_its_checkpoint_loads_in_one_process(launch):
    out, reports, single = launch
    fsdp = [r["fsdp"] for r in reports]
    assert [f["sharded_class"] for f in fsdp] == ["FSDPHeadedModel"] * 2
    # half of the global batch on each rank: the losses of the whole batch in one process
    assert fsdp[0]["losses"] == fsdp[1]["losses"]
    assert fsdp[0]["losses"] == pytest.approx(single["losses"], rel=1e-5)
    preds = [load_file(str(out / f"fsdp-preds-rank{r}.safetensors")) for r in (0, 1)]
    _equal(preds[1], preds[0])
    for k, v in single["preds"].items():  # early exit heads and output_hidden_states
        torch.testing.assert_close(preds[0][k], v, rtol=1e-4, atol=1e-5)
    # save_pretrained on both ranks: rank 0 writes, and both return once it is written
    assert fsdp[0]["writes"] == [str(out / "fsdp-ckpt")] and fsdp[1]["writes"] == []
    assert fsdp[0]["seen_after_save"] == fsdp[1]["seen_after_save"]
    assert "head_configs.json" in fsdp[1]["seen_after_save"]
    loaded = HeadedModel.from_pretrained(out / "fsdp-ckpt")
    _equal({k: v for k, v in worker.predictions(loaded).items()}, preds[0])
    # loaded on each rank and sharded again: the same predictions
    for r in (0, 1):
        _equal(load_file(str(out / f"fsdp-reloaded-rank{r}.safetensors")), preds[0])
    assert fsdp[0]["shard_twice"] == ["ConfigError", "the model is sharded already; shard it once"]


# ---------------------------------------------------------------------- saves
def test_two_ranks_saving_into_one_folder_leave_one_loadable_checkpoint(launch):
    out, reports, _ = launch
    saves = [r["saves"] for r in reports]
    # rank 0 wrote; each rank returned only once it was written, and saw the same folder
    assert saves[0]["seen_after_save"] == saves[1]["seen_after_save"]
    assert "head_configs.json" in saves[1]["seen_after_save"]
    assert not [n for n in saves[0]["seen_after_save"] if n.startswith((".tmp-", ".headkit-"))]
    loaded = HeadedModel.from_pretrained(out / "shared-ckpt")
    _equal(worker.predictions(loaded), load_file(str(out / "saves-preds-rank0.safetensors")))
    # a save rank 0 refuses is raised on both ranks, and writes nothing
    assert saves[0]["bad"][0] == saves[1]["bad"][0] == "ConfigError"
    assert "safe_serialization=False is invalid" in saves[0]["bad"][1]
    assert saves[1]["bad"][1].startswith(f"saving {str(out / 'bad-ckpt')!r} failed on rank 0")


def test_rank_1_saving_its_own_model_alone_writes_a_complete_checkpoint(launch):
    out, reports, _ = launch
    assert "model.safetensors" in reports[1]["own_save"]["backbone_files"]
    loaded = HeadedModel.from_pretrained(out / "rank1-own")
    _equal(worker.predictions(loaded), load_file(str(out / "own-preds-rank1.safetensors")))


def test_trainer_fsdp_on_cpu_ranks_runs_ddp_and_says_so(launch):
    _, reports, _ = launch
    trainer = reports[1]["trainer"]
    assert trainer["fsdp_enabled"] is False
    assert len(trainer["warnings"]) == 1
    assert "TrainingArguments(fsdp=True) is not applied here" in trainer["warnings"][0]
    assert "headkit.shard(model)" in trainer["warnings"][0]


# ---------------------------------------------------------------------- DDP
def test_ddp_on_two_ranks_matches_one_process_and_only_rank0_saves(launch):
    out, reports, single = launch
    check_two_ranks_match_one_process(out, [r["ddp_runs"] for r in reports], *single["ddp"])


def test_ddp_on_two_ranks_trains_an_early_exit_model_in_a_loop_and_headed_trainer(launch):
    out, reports, _ = launch
    check_early_exit_training(out, [r["ddp_runs"] for r in reports])
