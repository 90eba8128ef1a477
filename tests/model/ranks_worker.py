"""The checks test_ranks.py runs on two CPU ranks (gloo), all in one launch.

``python ranks_worker.py OUT_DIR MODEL_DIR`` under ``accelerate launch`` (tests/multiproc.py); the
process group is started by headkit itself (``headkit.distributed.ranks.current``). MODEL_DIR is
a tiny random BERT with a tokenizer, saved by the test. Each rank runs, in turn:

0. "ddp_runs": tests/model/distributed_worker.py's DDP runs (a custom accelerate loop and
   HeadedTrainer on an early-exit model, HeadedTrainer on three heads and one global batch),
   checked by tests/model/ddp_checks.py;
1. "cache": ``cache_features`` of a frozen GPT-2 with a pooled sequence head and a token
   head, 11 examples of lengths 2..9, batch 2 (6 batches: rows 0-5 on rank 0, 6-10 on rank
   1): in memory (gathered, and ``gather=False``), into one folder, from a DataLoader, with
   one example (rank 1 runs nothing), and three failures (a bad token id on rank 1 only,
   rank 1's examples without one target, a folder that is not empty);
2. "probe": ``probe_layers`` on MODEL_DIR, then ``headkit probe`` (the command line) on the
   same data, its output captured;
3. "fsdp": ``headkit.shard`` of a trainable GPT-2 whose deepest head reads hidden state 2 of
   3 (early exit), 3 AdamW steps on half of one global batch of 8 each, predictions, a
   forward with ``output_hidden_states``, ``save_pretrained`` on both ranks, the checkpoint
   loaded and sharded again;
4. "trainer" (rank 1 only): ``HeadedTrainer`` with ``TrainingArguments(fsdp=...)``, which on
   the CPU runs DDP instead (a warning says so); then "own_save": rank 1 alone saves its
   model (in-memory backbone) into its own folder with ``main_process_only=False``;
5. "saves": ``save_pretrained`` of an unsharded model by both ranks into one folder (rank 0
   writes, both wait), and a save rank 0 refuses, raised on both.

The test runs the same functions in one process and compares. Tensors go to
``<scenario>-rank<r>.safetensors``; the rest is this rank's report (``rank<r>.json``).
"""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path
from typing import Any

import distributed_worker
import torch
from conftest import build_tiny
from multiproc import rank, run_rank
from safetensors.torch import save_file
from torch.utils.data import DataLoader

from headkit import HeadConfig, HeadedCollator, HeadedModel, cache_features, probe_layers
from headkit.distributed import ranks, sharding

ROWS = 11
BATCH = 2
STEPS = 3
GLOBAL_BATCH = 8
#: probe_layers' arguments, the same as run_probe's command line gives
PROBE = {
    "layers": "all",
    "pooling": "mean,first",
    "batch_size": 4,
    "max_length": 16,
    "l2": [0.01, 1.0],
    "val_splits": 2,
    "progress": False,
}


def _gpt2(num_layers: int) -> torch.nn.Module:
    return build_tiny("gpt2", num_layers, dropout=0.0)


def _save(out: Path, name: str, tensors: dict[str, torch.Tensor]) -> None:
    plain = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(plain, str(out / f"{name}-rank{rank()}.safetensors"))


def _error(fn) -> list[str] | None:
    """[type, message] of what ``fn()`` raises, None if nothing."""
    try:
        fn()
    except Exception as e:  # the report says which
        return [type(e).__name__, str(e)]
    return None


# ---------------------------------------------------------------------- caching
def cache_model() -> HeadedModel:
    """A frozen GPT-2 with a pooled sequence head (layer 1) and a token head (layer 2)."""
    heads = [
        HeadConfig("cls", layer_hook=1, num_outputs=3, pred_for_sequence=True, pooling="mean"),
        HeadConfig("tok", layer_hook=2, num_outputs=4),
    ]
    return HeadedModel(_gpt2(3), heads)


def cache_data(n: int = ROWS, without_cls_from: int | None = None) -> list[dict[str, Any]]:
    """``n`` examples of lengths 2..9 with both targets (no "cls" from row
    ``without_cls_from`` on)."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(n):
        length = 2 + (i * 5) % 8
        row = {
            "input_ids": torch.randint(3, 100, (length,), generator=g).tolist(),
            "tok": torch.randint(0, 4, (length,), generator=g).tolist(),
            "cls": i % 3,
        }
        if without_cls_from is not None and i >= without_cls_from:
            del row["cls"]
        rows.append(row)
    return rows


def run_cache(out: Path) -> dict[str, Any]:
    model = cache_model()
    mem = cache_features(model, cache_data(), batch_size=BATCH, progress=False)
    _save(out, "cache-mem", mem.arrays)
    own = cache_features(model, cache_data(), batch_size=BATCH, progress=False, gather=False)
    _save(out, "cache-own", own.arrays)
    folder = cache_features(model, cache_data(), BATCH, storage=out / "cache-dir", progress=False)
    loader = DataLoader(cache_data(), batch_size=BATCH, collate_fn=HeadedCollator(model))
    _save(out, "cache-loader", cache_features(model, loader, progress=False).arrays)
    one = cache_features(model, cache_data(1), batch_size=BATCH, progress=False)
    _save(out, "cache-one", one.arrays)

    bad = cache_data()
    bad[9]["input_ids"][0] = 100  # outside the vocabulary; row 9 is rank 1's
    full = out / "full"
    if rank() == 0:
        full.mkdir()
        (full / "notes.txt").write_text("not a cache")
    errors = {
        "bad_token": _error(lambda: cache_features(model, bad, BATCH, progress=False)),
        "targets": _error(
            lambda: cache_features(model, cache_data(without_cls_from=6), BATCH, progress=False)
        ),
        "full_folder": _error(
            lambda: cache_features(model, cache_data(), BATCH, storage=full, progress=False)
        ),
    }
    return {
        "world": ranks.current()[1],
        "mem_len": len(mem),
        "own_meta": own.meta,
        "folder_len": len(folder),
        "folder_files": sorted(p.name for p in (out / "cache-dir").iterdir()),
        "one_len": len(one),
        "errors": errors,
    }


# ---------------------------------------------------------------------- probing
def probe_data() -> tuple[list[str], list[int]]:
    """48 texts of 1 to 9 words, with labels drawn at random (a hard task for a random
    model: the scores differ from layer to layer)."""
    words = [
        "good",
        "bad",
        "film",
        "plot",
        "dull",
        "great",
        "fine",
        "poor",
        "story",
        "cast",
        "long",
        "short",
    ]
    g = torch.Generator().manual_seed(7)
    texts = []
    for _ in range(48):
        n = int(torch.randint(1, 10, (1,), generator=g))
        picks = torch.randint(0, len(words), (n,), generator=g)
        texts.append(" ".join(words[i] for i in picks.tolist()))
    return texts, torch.randint(0, 2, (48,), generator=g).tolist()


def probe_json(model_dir: str) -> dict[str, Any]:
    """``probe_layers`` on the tiny BERT: its JSON without timings (which vary)."""
    texts, labels = probe_data()
    results = probe_layers(model_dir, texts, labels, **PROBE)
    data = results.to_dict()
    data.pop("timings")
    return data


def run_probe(out: Path, model_dir: str) -> dict[str, Any]:
    from headkit.cli.main import main as cli

    report = {"results": probe_json(model_dir)}
    texts, labels = probe_data()
    data = out / f"probe-data-rank{rank()}.csv"
    data.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in zip(texts, labels)))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        report["cli_status"] = cli(
            ["probe", "--model", model_dir, "--data", str(data), "--output", str(out / "probe")]
            + ["--layers", "all", "--pooling", "mean,first", "--val-splits", "2", "--quiet"]
            + ["--batch-size", "4", "--max-length", "16", "--l2", "0.01,1.0"]
        )
    report["cli_stdout"] = printed.getvalue()
    return report


# ---------------------------------------------------------------------- FSDP2
def fsdp_model() -> HeadedModel:
    """A trainable GPT-2 (3 blocks): "cls" reads hidden state 2 (early exit: block 2 never
    runs), "tok" hidden state 1."""
    heads = [
        HeadConfig("cls", layer_hook=2, num_outputs=3, pred_for_sequence=True),
        HeadConfig("tok", layer_hook=1, num_outputs=4),
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the blocks early exit never runs are frozen
        return HeadedModel(_gpt2(3), heads, freeze_base_model=False)


def fsdp_batch() -> dict[str, torch.Tensor]:
    """One global batch of 8 examples of 6 tokens (no padding: every half counts alike)."""
    g = torch.Generator().manual_seed(5)
    return {
        "input_ids": torch.randint(3, 100, (GLOBAL_BATCH, 6), generator=g),
        "cls": torch.arange(GLOBAL_BATCH) % 3,
        "tok": torch.randint(0, 4, (GLOBAL_BATCH, 6), generator=g),
    }


def eval_batch() -> dict[str, torch.Tensor]:
    """Four padded rows of lengths 5, 3, 6, 2."""
    g = torch.Generator().manual_seed(6)
    mask = (torch.arange(6)[None, :] < torch.tensor([5, 3, 6, 2])[:, None]).long()
    return {"input_ids": torch.randint(3, 100, (4, 6), generator=g), "attention_mask": mask}


def train(model: HeadedModel, part: slice) -> list[float]:
    """3 AdamW steps on ``part`` of the global batch; the losses averaged over the ranks."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    batch = {k: v[part] for k, v in fsdp_batch().items()}
    model.train()
    losses = []
    for _ in range(STEPS):
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(mean, op=torch.distributed.ReduceOp.AVG)
        losses.append(float(mean))
    return losses


def predictions(model: HeadedModel) -> dict[str, torch.Tensor]:
    model.eval()
    with torch.no_grad():
        out = model(**eval_batch())
        states = model(**eval_batch(), output_hidden_states=True).hidden_states
    return {**out.preds_by_head, "hidden_states.3": states[3]}


def run_fsdp(out: Path) -> dict[str, Any]:
    r, world = ranks.current()
    model = sharding.shard(fsdp_model())
    part = slice(r * GLOBAL_BATCH // world, (r + 1) * GLOBAL_BATCH // world)
    losses = train(model, part)
    _save(out, "fsdp-preds", predictions(model))
    writes = []
    real_save = sharding.save_checkpoint

    def counting_save(m, path, **kwargs):  # the real save, counted per process
        writes.append(str(path))
        return real_save(m, path, **kwargs)

    sharding.save_checkpoint = counting_save
    model.save_pretrained(out / "fsdp-ckpt")
    sharding.save_checkpoint = real_save
    seen = sorted(p.name for p in (out / "fsdp-ckpt").iterdir())
    again = sharding.shard(HeadedModel.from_pretrained(out / "fsdp-ckpt"))
    _save(out, "fsdp-reloaded", predictions(again))
    return {
        "losses": losses,
        "sharded_class": type(model).__name__,
        "writes": writes,
        "seen_after_save": seen,
        "shard_twice": _error(lambda: sharding.shard(model)),
    }


# ---------------------------------------------------------------------- saves
def run_saves(out: Path) -> dict[str, Any]:
    """``save_pretrained`` of an unsharded model (in-memory backbone) by both ranks into one
    folder: rank 0 writes, both return once it is written; a failure on rank 0 (an option it
    refuses) is raised on both."""
    model = fsdp_model()
    model.save_pretrained(out / "shared-ckpt")
    seen = sorted(p.name for p in (out / "shared-ckpt").iterdir())
    bad = _error(lambda: model.save_pretrained(out / "bad-ckpt", safe_serialization=False))
    _save(out, "saves-preds", predictions(model))
    return {"seen_after_save": seen, "bad": bad}


def own_save(out: Path) -> dict[str, Any]:
    """Rank 1 alone saves its own model into its own folder (``main_process_only=False``):
    the checkpoint is complete, its in-memory backbone included."""
    model = fsdp_model()
    model.save_pretrained(out / "rank1-own", main_process_only=False)
    _save(out, "own-preds", predictions(model))
    backbones = sorted((out / "rank1-own").glob("backbone-*"))
    return {"backbone_files": sorted(p.name for p in backbones[0].iterdir())}


def trainer_on_cpu(out: Path) -> dict[str, Any]:
    """``HeadedTrainer`` with ``TrainingArguments(fsdp=...)`` on CPU ranks: DDP, warned."""
    from transformers import TrainingArguments

    from headkit import HeadedTrainer

    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        fsdp=True,
        fsdp_config={"fsdp_version": 2},
        use_cpu=True,
        ddp_backend="gloo",
        report_to=[],
        max_steps=1,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = HeadedTrainer(model=fsdp_model(), args=args)
    return {
        "fsdp_enabled": trainer.is_fsdp_enabled,
        "warnings": [str(w.message) for w in caught if "fsdp" in str(w.message).lower()],
    }


def main(out: Path, model_dir: str) -> dict[str, Any]:
    # DDP first (distributed_worker's runs: its accelerate loop starts the process group, as
    # in a launch of its own), then caching, the probe sweep and FSDP2 in the same group
    report = {"ddp_runs": distributed_worker.main(out)}
    report.update(cache=run_cache(out), probe=run_probe(out, model_dir))
    if rank() == 1:  # no collective in it: rank 1 runs it while rank 0 draws the probe plot
        report["trainer"] = trainer_on_cpu(out)
        report["own_save"] = own_save(out)
    report["fsdp"] = run_fsdp(out)
    report["saves"] = run_saves(out)
    return report


if __name__ == "__main__":
    run_rank(main)
