"""Checkpoints never lose a user's file, never run a checkpoint's code, and refuse what they
cannot verify: data loss and code execution first, then concurrent saves, then
malformed manifests, the size guard and feature-cache manifests.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import runpy
import shutil
import sys
import threading
import tracemalloc
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import HEADS, IDS, MANIFEST, MASK, predict, same
from conftest import build_tiny
from multiproc import fork
from safetensors.torch import save_file

import headkit.checkpoint.lock
from headkit import (
    CachedFeatures,
    CheckpointError,
    HeadConfig,
    HeadedModel,
    cache_features,
    load_headed,
)
from headkit.checkpoint import read_checkpoint
from headkit.checkpoint.lock import LOCK, folder_lock

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("single_thread")]


def set_heads(model: HeadedModel, value: float) -> None:
    """Give every head tensor a value that identifies one saved version."""
    with torch.no_grad():
        for i, p in enumerate(model.heads.parameters()):
            p.fill_(value + i / 1000)


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def edit_manifest(folder: Path, edit) -> None:
    manifest = manifest_of(folder)
    edit(manifest)
    (folder / MANIFEST).write_text(json.dumps(manifest))


@pytest.fixture
def model() -> HeadedModel:
    """A tiny GPT-2 built in memory (so its checkpoints hold a saved backbone)."""
    torch.manual_seed(0)
    return HeadedModel(build_tiny("gpt2", num_layers=2), HEADS)


@pytest.fixture
def gpt2_dir(tmp_path: Path) -> Path:
    path = tmp_path / "gpt2"
    build_tiny("gpt2", num_layers=2).save_pretrained(path)
    return path


# ---------------------------------------------------------------------- 1. data loss
USER_FILES = {
    "backbone-finetuned": "dir",
    "heads-notes.md": "file",
    "heads-v1.safetensors": "file",
    ".tmp-data": "dir",
    "backbone-0123456789ab.txt": "file",
}


def plant(folder: Path, name: str, kind: str) -> None:
    if kind == "dir":
        (folder / name).mkdir(parents=True)
        (folder / name / "keep.txt").write_text(f"the user's {name}")
    else:
        (folder / name).write_text(f"the user's {name}")


def intact(folder: Path, name: str, kind: str) -> bool:
    file = folder / name / "keep.txt" if kind == "dir" else folder / name
    return file.is_file() and file.read_text() == f"the user's {name}"


@pytest.mark.parametrize(("name", "kind"), list(USER_FILES.items()))
def test_saving_never_deletes_a_users_file(tmp_path, model, name, kind):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    plant(folder, name, kind)
    model.save_pretrained(folder)
    set_heads(model, 0.5)
    model.save_pretrained(folder)  # replaces the first save: its heads and backbone go
    model.save_pretrained(folder, save_backbone=True)
    assert intact(folder, name, kind)
    headkit_names = {p.name for p in folder.iterdir()} - {name}
    # manifest, heads, backbone, model card: nothing else
    assert len(headkit_names) == 4, headkit_names
    assert same(predict(HeadedModel.from_pretrained(folder)), predict(model))


def test_saving_heads_back_keeps_the_backbone_folder_they_were_loaded_from(tmp_path, model):
    """load_headed(ckpt/backbone-*) then save into ckpt: the backbone is referenced in place
    and must survive, or the checkpoint would no longer load."""
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    backbone = next(folder.glob("backbone-*"))
    again = load_headed(str(backbone), head_configs=list(model.head_configs.values()))
    set_heads(again, 0.25)
    again.save_pretrained(folder)
    assert backbone.is_dir() and (backbone / "config.json").is_file()
    assert manifest_of(folder)["backbone"]["source"] == {"checkpoint": backbone.name}
    assert same(predict(HeadedModel.from_pretrained(folder)), predict(again))
    again.save_pretrained(folder)  # and again: still referenced, still there
    assert backbone.is_dir()
    assert same(predict(HeadedModel.from_pretrained(folder)), predict(again))


def test_a_restored_model_saved_back_keeps_its_backbone_folder_in_place(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    backbone = next(folder.glob("backbone-*"))
    restored = HeadedModel.from_pretrained(folder)
    set_heads(restored, -0.5)
    restored.save_pretrained(folder)  # heads only: the saved backbone folder is kept as is
    assert [p.name for p in folder.glob("backbone-*")] == [backbone.name]
    assert same(predict(HeadedModel.from_pretrained(folder)), predict(restored))


def test_a_model_restored_in_another_dtype_saves_its_backbone_as_it_is(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)  # a float32 backbone
    old = next(folder.glob("backbone-*"))
    restored = HeadedModel.from_pretrained(folder, dtype=torch.bfloat16)
    restored.save_pretrained(folder)  # the folder holds float32: not the model's backbone
    assert not old.exists()
    again = HeadedModel.from_pretrained(folder)
    assert again.backbone.dtype == torch.bfloat16
    assert same(predict(again), predict(restored))


def test_a_restored_model_whose_backbone_changed_writes_a_new_one(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    old = next(folder.glob("backbone-*"))
    restored = HeadedModel.from_pretrained(folder)
    with torch.no_grad():
        restored.backbone.wte.weight.mul_(1.5)
    restored.save_pretrained(folder)
    assert not old.exists() and len(list(folder.glob("backbone-*"))) == 1
    assert same(predict(HeadedModel.from_pretrained(folder)), predict(restored))


def test_a_failed_save_removes_only_what_it_wrote(tmp_path, model, monkeypatch):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    plant(folder, "heads-notes.md", "file")
    before = sorted(p.name for p in folder.iterdir())
    real = headkit.checkpoint.os.replace

    def crash(src, dst):
        if Path(dst).name == MANIFEST:
            raise OSError("disk full")
        return real(src, dst)

    monkeypatch.setattr(headkit.checkpoint.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(folder, save_backbone=True)
    monkeypatch.undo()
    assert sorted(p.name for p in folder.iterdir()) == before


# ---------------------------------------------------------------------- 3. code execution
def make_hostile(folder: Path, marker: Path) -> Path:
    """Turn a checkpoint's backbone into one whose config asks to run its own code."""
    backbone = next(folder.glob("backbone-*"))
    config = json.loads((backbone / "config.json").read_text())
    config["model_type"] = "evilnet"  # unknown to transformers: only the auto_map could load it
    config["auto_map"] = {"AutoConfig": "modeling_evil.EvilConfig", "AutoModel": "modeling_evil.M"}
    (backbone / "config.json").write_text(json.dumps(config))
    (backbone / "modeling_evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('the checkpoint ran code')\n"
        "from transformers import GPT2Config as EvilConfig, GPT2Model as M\n"
    )
    return backbone


def test_the_hostile_code_is_live(tmp_path, model):
    """Control: running the planted module does create the marker."""
    model.save_pretrained(tmp_path / "ckpt")
    marker = tmp_path / "control"
    backbone = make_hostile(tmp_path / "ckpt", marker)
    runpy.run_path(str(backbone / "modeling_evil.py"))
    assert marker.exists()


def test_a_checkpoint_never_runs_its_code_even_when_stdin_answers_yes(
    tmp_path, model, monkeypatch, capsys
):
    """Both routes (the checkpoint, and its backbone folder given to load_headed) with a
    standard input that answers "y" to any prompt: refused at once, nothing read, nothing run."""
    model.save_pretrained(tmp_path / "ckpt")
    marker = tmp_path / "code_was_run"
    backbone = make_hostile(tmp_path / "ckpt", marker)
    answers = io.StringIO("y\n" * 8)
    monkeypatch.setattr(sys, "stdin", answers)  # what input() reads when not a terminal
    routes = [
        lambda: HeadedModel.from_pretrained(tmp_path / "ckpt"),
        lambda: load_headed(str(backbone), head_configs=[{"name": "h"}]),
    ]
    for route in routes:
        with pytest.raises(CheckpointError, match="contains custom code"):
            route()
    assert answers.tell() == 0  # no prompt read an answer
    assert "Do you wish to run the custom code" not in "".join(capsys.readouterr())
    assert not marker.exists()


def test_trust_remote_code_is_refused_when_loading_a_checkpoint(tmp_path, model):
    model.save_pretrained(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="trust_remote_code=True is not accepted"):
        HeadedModel.from_pretrained(tmp_path / "ckpt", trust_remote_code=True)


# ---------------------------------------------------------------------- 3. symlinks, checksums
def test_a_backbone_folder_symlinked_outside_the_checkpoint_is_refused(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    backbone = next(folder.glob("backbone-*"))
    other = tmp_path / "other-model"
    shutil.move(backbone, other)  # same files, so every checksum still matches
    backbone.symlink_to(other, target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"backbone folder .* leads outside the checkpoint"):
        HeadedModel.from_pretrained(folder)


def test_a_weights_file_symlinked_outside_the_checkpoint_is_refused(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    weights = folder / manifest_of(folder)["weights"]
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(weights, outside)
    weights.symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"weights file .* leads outside the checkpoint"):
        HeadedModel.from_pretrained(folder)


def test_a_symlink_inside_the_backbone_folder_leading_outside_is_refused(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    config = next(folder.glob("backbone-*/config.json"))
    shutil.move(config, tmp_path / "config.json")
    config.symlink_to(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"backbone folder entry .* leads outside"):
        HeadedModel.from_pretrained(folder)


@pytest.mark.parametrize(
    ("value", "shown"),
    [("", "''"), (None, "None"), ("abc", "'abc'"), ("A" * 64, "'AAAA")],
    ids=["empty", "null", "short", "upper-case"],
)
def test_a_checksum_that_cannot_verify_is_refused(tmp_path, model, value, shown):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    edit_manifest(folder, lambda m: m.update(weights_sha256=value))
    with pytest.raises(CheckpointError, match=rf"weights_sha256={shown}.*cannot be verified"):
        HeadedModel.from_pretrained(folder)


def test_a_missing_checksum_is_refused(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    edit_manifest(folder, lambda m: m.pop("weights_sha256"))
    with pytest.raises(CheckpointError, match=r"weights_sha256=None is invalid"):
        HeadedModel.from_pretrained(folder)


def test_a_saved_backbone_without_its_checksums_is_refused(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    edit_manifest(folder, lambda m: m["backbone"].pop("files_sha256"))
    with pytest.raises(CheckpointError, match=r"backbone\.files_sha256=None is invalid"):
        HeadedModel.from_pretrained(folder)


@pytest.mark.parametrize("version", [0, -1, "1", True, 1.0, 3])
def test_format_versions_other_than_known_positive_ints_are_refused(tmp_path, model, version):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    edit_manifest(folder, lambda m: m.update(format_version=version))
    with pytest.raises(CheckpointError, match="format_version"):
        HeadedModel.from_pretrained(folder)


# ---------------------------------------------------------------------- 3. malformed manifests
def _huge_int(folder: Path, where: str) -> None:
    text = (folder / MANIFEST).read_text()
    manifest = json.loads(text)
    if where == "num_outputs":
        manifest["heads"][0]["num_outputs"] = "@HUGE@"
    else:
        manifest["format_version"] = "@HUGE@"
    (folder / MANIFEST).write_text(json.dumps(manifest).replace('"@HUGE@"', "9" * 5001))


MALFORMED = {
    "head-named-type": lambda f: edit_manifest(f, lambda m: m["heads"][0].update(name="type")),
    "head-named-values": lambda f: edit_manifest(f, lambda m: m["heads"][0].update(name="values")),
    "head-named-to": lambda f: edit_manifest(f, lambda m: m["heads"][1].update(name="to")),
    "5001-digit-num-outputs": lambda f: _huge_int(f, "num_outputs"),
    "5001-digit-format-version": lambda f: _huge_int(f, "format_version"),
    "312-char-weights-name": lambda f: edit_manifest(
        f, lambda m: m.update(weights="w" * 300 + ".safetensors")
    ),
    "312-char-backbone-path": lambda f: edit_manifest(
        f, lambda m: m["backbone"].update(path="backbone-" + "b" * 303)
    ),
    "312-char-backbone-file": lambda f: edit_manifest(
        f, lambda m: m["backbone"].update(files_sha256={"f" * 300 + ".safetensors": "0" * 64})
    ),
    "source-of-another-shape": lambda f: edit_manifest(
        f, lambda m: m.update(backbone={"kind": "reference", "source": {"url": "http://x"}})
    ),
    "manifest-is-a-list": lambda f: (f / MANIFEST).write_text("[]"),
    "manifest-is-a-folder": lambda f: (
        (f / MANIFEST).unlink(),
        (f / MANIFEST / "x").mkdir(parents=True),
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_every_malformed_manifest_gives_a_checkpoint_error(tmp_path, model, case):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    MALFORMED[case](folder)
    with pytest.raises(CheckpointError) as info:
        HeadedModel.from_pretrained(folder)
    assert len(str(info.value)) < 2000  # huge values are cut in messages, never echoed whole
    with pytest.raises(CheckpointError):
        load_headed(build_tiny("gpt2", num_layers=2), head_folder_path=folder)


def test_a_head_renamed_like_a_module_attribute_is_a_checkpoint_error_not_a_key_error(
    tmp_path, model
):
    # heads may be named "type", "to", ... (HeadDict); a manifest renaming one no longer
    # matches its weights, which the error says (not nn.ModuleDict's KeyError)
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    MALFORMED["head-named-type"](folder)
    with pytest.raises(CheckpointError, match=r"head weights do not match.*heads\.type"):
        HeadedModel.from_pretrained(folder)


# ---------------------------------------------------------------------- 3. the size guard
def test_150000_layers_with_in_size_null_are_refused_before_anything_is_built(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    edit_manifest(
        folder,
        lambda m: m["heads"][1].update(in_size=None, num_layers=150_000, hidden_size=1),
    )
    tracemalloc.start()
    try:
        with pytest.raises(CheckpointError, match=r"150001 tensors in all.*num_layers=150000"):
            read_checkpoint(folder)  # the manifest stage: no backbone, no head is built
        with pytest.raises(CheckpointError, match=r"holds \d+ tensors"):
            HeadedModel.from_pretrained(folder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, peak  # 150,000 Linear modules would take hundreds of MB


def test_the_size_guard_counts_the_backbone_width_and_concatenated_poolings(tmp_path, model):
    """in_size null is the backbone's width (32, read from its config.json before loading),
    and "mean+max" doubles it: 64 × 20,000 outputs (+ 32 × 4 for "tok") cannot fit."""
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    edit_manifest(
        folder,
        lambda m: m["heads"][0].update(in_size=None, pooling="mean+max", num_outputs=20_000),
    )
    with pytest.raises(CheckpointError, match=r"at least 1280128 parameters"):
        read_checkpoint(folder)


# ---------------------------------------------------------------------- 2. concurrent saves
def test_flock_serialises_threads_of_one_process(tmp_path, model):
    """The folder lock taken by this thread makes a save in another thread wait."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    started, errors = threading.Event(), []

    def save() -> None:
        started.set()
        try:
            model.save_pretrained(folder)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    with folder_lock(folder):
        worker = threading.Thread(target=save)
        worker.start()
        started.wait()
        worker.join(timeout=1.0)  # a save takes well under a second when nothing blocks it
        assert worker.is_alive() and not (folder / MANIFEST).exists()
    worker.join()
    assert not errors and (folder / MANIFEST).is_file()
    assert not (folder / LOCK).exists()  # removed by the save that held it last


def test_a_save_that_cannot_get_the_lock_raises_a_clear_error(tmp_path, model, monkeypatch):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    monkeypatch.setattr(headkit.checkpoint.lock, "LOCK_TIMEOUT_S", 0.2)
    with folder_lock(folder), pytest.raises(CheckpointError, match=r"another save into .* held"):
        model.save_pretrained(folder)


def check_round(folder: Path, expected: list[dict[str, torch.Tensor]], model_factory) -> None:
    """The folder holds exactly one of the versions saved in this round, and nothing else."""
    loaded = model_factory(folder).head_state_dict()
    matches = [e for e in expected if all(torch.equal(loaded[k], v) for k, v in e.items())]
    assert len(matches) == 1, "the folder loads as none of the versions saved in this round"
    names = sorted(p.name for p in folder.iterdir())
    assert [n.split("-")[0] for n in names if not n.startswith("backbone")] == [
        "README.md",
        "head_configs.json",
        "heads",
    ], names


def test_two_threads_saving_50_times_into_one_folder(tmp_path, gpt2_dir):
    folder = tmp_path / "ckpt"
    models = [load_headed(str(gpt2_dir), head_configs=HEADS) for _ in range(2)]
    barrier, rounds, errors = threading.Barrier(3), 50, []
    saved: list[list[dict[str, torch.Tensor]]] = [[], []]

    def work(k: int) -> None:
        for r in range(rounds):
            set_heads(models[k], 1.0 + k + r * 10)
            saved[k].append({n: v.clone() for n, v in models[k].head_state_dict().items()})
            barrier.wait()
            try:
                models[k].save_pretrained(folder)
            except Exception as e:
                errors.append(e)
            barrier.wait()

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    try:
        for r in range(rounds):
            barrier.wait()  # both threads save now
            barrier.wait()  # both are done
            assert not errors, errors
            check_round(folder, [saved[0][r], saved[1][r]], HeadedModel.from_pretrained)
    finally:
        barrier.abort()
        for t in threads:
            t.join()


def _saver(k: int, folder: Path, conn) -> None:
    """A saving process: builds its model, then saves round ``r`` when told ``r``."""
    heads = [
        HeadConfig("cls", num_outputs=3, pred_for_sequence=True, pooling="mean"),
        HeadConfig("big", num_outputs=20_000),  # 2.6 MB of weights: saves overlap
    ]
    model = HeadedModel(build_tiny("gpt2", num_layers=2), heads)
    conn.send("ready")
    while (r := conn.recv()) is not None:
        with torch.no_grad():
            for i, p in enumerate(model.heads.parameters()):
                p.fill_(1.0 + k + r * 10 + i / 1000)
        try:
            model.save_pretrained(folder)
            conn.send(f"saved {r}")
        except Exception as e:
            conn.send(f"failed {r} {type(e).__name__} {e}")


def _reply(conn) -> str:
    assert conn.poll(120), "a saving process did not answer within 120 s"
    return conn.recv()


@pytest.mark.skipif(sys.platform != "linux", reason="forks its saving processes (Linux)")
def test_two_processes_saving_20_times_into_one_folder(tmp_path):
    folder, rounds = tmp_path / "ckpt", 20
    pipes = [multiprocessing.Pipe() for _ in range(2)]
    children = [
        fork(_saver, k, folder, child, log=tmp_path / f"saver{k}.log")
        for k, (_, child) in enumerate(pipes)
    ]
    conns = [parent for parent, _ in pipes]
    try:
        assert [_reply(c) for c in conns] == ["ready", "ready"]
        for r in range(rounds):
            for conn in conns:  # both start their save at once
                conn.send(r)
            replies = [_reply(c) for c in conns]
            assert replies == [f"saved {r}", f"saved {r}"], replies
            params = list(HeadedModel.from_pretrained(folder).heads.parameters())
            values = [{round(float(v), 4) for v in p.detach().flatten().unique()} for p in params]
            versions = [
                [{round(1.0 + k + r * 10 + i / 1000, 4)} for i in range(len(params))]
                for k in (0, 1)
            ]
            assert values in versions, (r, values)  # every tensor from one save: no mix
            names = sorted(p.name for p in folder.iterdir())
            assert [n.split("-")[0] for n in names] == [
                "README.md",
                "backbone",
                MANIFEST,
                "heads",
            ], names
    finally:
        for conn, child in zip(conns, children):
            conn.send(None)
            child.join(timeout=60)
            if child.exitcode is None:
                child.kill()
    assert [c.exitcode for c in children] == [0, 0]


# ---------------------------------------------------------------------- feature caches
@pytest.fixture
def cache_dir(tmp_path) -> Path:
    model = HeadedModel(build_tiny("gpt2", num_layers=2), HEADS[:1])
    batches = [{"input_ids": IDS, "attention_mask": MASK, "cls": torch.tensor([0, 2])}]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    cache_features(model, loader, storage=tmp_path / "features", progress=False)
    return tmp_path / "features"


def _point_first_array_at(folder: Path, name: str) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    first = next(iter(manifest["arrays"].values()))
    first["file"] = name
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "name", ["../secret.txt", "/etc/passwd", "sub/../../secret.txt", "x" * 312, "manifest.json"]
)
def test_a_feature_cache_manifest_may_only_name_files_in_its_folder(cache_dir, name):
    (cache_dir.parent / "secret.txt").write_bytes(b"\0" * 64)
    _point_first_array_at(cache_dir, name)
    with pytest.raises(CheckpointError, match="plain file name"):
        CachedFeatures.load(cache_dir)


def test_a_feature_cache_file_symlinked_outside_is_refused(cache_dir):
    manifest = json.loads((cache_dir / "manifest.json").read_text())
    file = cache_dir / next(iter(manifest["arrays"].values()))["file"]
    secret = cache_dir.parent / "secret.bin"
    secret.write_bytes(file.read_bytes())  # same size: only the symlink check can refuse it
    file.unlink()
    file.symlink_to(secret)
    with pytest.raises(CheckpointError, match="symlink"):
        CachedFeatures.load(cache_dir)


def test_a_feature_cache_manifest_that_is_not_an_object_is_refused(cache_dir):
    (cache_dir / "manifest.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="JSON object"):
        CachedFeatures.load(cache_dir)


def test_the_untouched_feature_cache_loads(cache_dir):
    assert len(CachedFeatures.load(cache_dir)) == 2


# ---------------------------------------------------------------------- helpers used above
def forge_weights(folder: Path, state: dict[str, torch.Tensor]) -> None:
    """Replace the heads file with ``state`` and record its checksum (a consistent forgery)."""
    weights = folder / manifest_of(folder)["weights"]
    save_file(state, str(weights))
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    edit_manifest(folder, lambda m: m.update(weights_sha256=digest))


def test_a_consistent_forgery_with_a_huge_head_is_refused_by_sizes(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    forge_weights(folder, {"heads.cls.mlp.0.weight": torch.zeros(1, 1)})
    edit_manifest(folder, lambda m: m["heads"][0].update(num_outputs=10**8))
    with pytest.raises(CheckpointError, match=r"describes heads with at least \d{9,} parameters"):
        read_checkpoint(folder)
