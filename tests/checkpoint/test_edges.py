"""Edges of saving: a checkpoint never depends on a folder another checkpoint owns, a save
deletes only what headkit provably wrote, the lock file is never followed, and a load that
overlaps another process's save retries. Each test builds the hostile folder itself.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import HEADS, MANIFEST, assert_same, predict
from conftest import build_tiny
from multiproc import fork
from safetensors.torch import load_file, save_file

from headkit import CheckpointError, HeadedModel, load_headed
from headkit.checkpoint.lock import LOCK

pytestmark = pytest.mark.usefixtures("single_thread")

MARKER = ".headkit-token"


def set_heads(model: HeadedModel, value: float) -> None:
    with torch.no_grad():
        for i, p in enumerate(model.heads.parameters()):
            p.fill_(value + i / 1000)


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())


def write_manifest(folder: Path, manifest: dict) -> None:
    (folder / MANIFEST).write_text(json.dumps(manifest))


def saved_backbone(folder: Path) -> Path:
    return folder / manifest_of(folder)["backbone"]["path"]


@pytest.fixture
def model() -> HeadedModel:
    """A tiny GPT-2 built in memory (so its checkpoints hold a saved backbone)."""
    torch.manual_seed(0)
    return HeadedModel(build_tiny("gpt2", num_layers=2), HEADS)


def plant_user_files(folder: Path) -> dict[str, str]:
    """User files whose names look like headkit's; returns {relative path: content}."""
    files = {
        "data-0123456789ab.csv": "id,text\n1,a user's table\n",
        "backbone-user/notes.txt": "the user's notes",
        "backbone-0123456789ab/config.json": '{"the": "user\'s config"}',
        "adapter-0123456789ab/adapter_config.json": '{"the": "user\'s adapter"}',
        "heads-0123456789ab.safetensors": None,  # a safetensors file of the user's own
        "heads-notes.md": "the user's notes",
    }
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            save_file({"w": torch.ones(3)}, str(path), metadata={"by": "the user"})
        else:
            path.write_text(text)
    return {rel: (folder / rel).read_bytes().hex() for rel in files}


def assert_intact(folder: Path, planted: dict[str, str]) -> None:
    for rel, content in planted.items():
        path = folder / rel
        assert path.is_file(), f"{rel} was deleted"
        assert path.read_bytes().hex() == content, f"{rel} was changed"


# ---------------------------------------------------------------------- no shared folders
def test_a_checkpoint_saved_from_another_checkpoints_backbone_survives_its_next_save(
    tmp_path, model
):
    """B is saved from A's backbone folder; A's next save deletes that folder, B still loads."""
    a, b = tmp_path / "A", tmp_path / "B"
    model.save_pretrained(a)
    a_backbone = saved_backbone(a)
    borrowed = load_headed(str(a_backbone), head_configs=HEADS)
    set_heads(borrowed, 0.25)
    borrowed.save_pretrained(b)
    expected = predict(borrowed)
    entry = manifest_of(b)["backbone"]
    assert entry["kind"] == "saved", entry  # its own folder, not '../A/backbone-...'
    ours = b / entry["path"]
    assert (ours / "model.safetensors").stat().st_ino == (
        a_backbone / "model.safetensors"
    ).stat().st_ino  # hard-linked: no second copy of the bytes on this file system
    # A moves on: new heads and a fine-tuned backbone, so its old backbone folder goes
    again = HeadedModel.from_pretrained(a)
    with torch.no_grad():
        again.backbone.wte.weight.mul_(1.5)
    set_heads(again, -0.5)
    again.save_pretrained(a)
    assert not a_backbone.exists()
    assert_same(predict(HeadedModel.from_pretrained(b)), expected)
    assert_same(predict(HeadedModel.from_pretrained(a)), predict(again))


def test_the_backbone_is_copied_where_the_file_system_refuses_hard_links(
    tmp_path, model, monkeypatch
):
    a, b = tmp_path / "A", tmp_path / "elsewhere" / "B"
    model.save_pretrained(a)
    a_backbone = saved_backbone(a)
    borrowed = load_headed(str(a_backbone), head_configs=HEADS)

    def no_links(src, dst, *args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    borrowed.save_pretrained(b)
    monkeypatch.undo()
    ours = saved_backbone(b)
    assert ours.parent == b
    assert (ours / "model.safetensors").stat().st_ino != (
        a_backbone / "model.safetensors"
    ).stat().st_ino
    expected = predict(borrowed)
    model.save_pretrained(a, save_backbone=True)  # a new backbone folder: the old one goes
    assert not a_backbone.exists()
    assert_same(predict(HeadedModel.from_pretrained(b)), expected)


def test_save_backbone_false_on_another_checkpoints_folder_is_refused(tmp_path, model):
    a = tmp_path / "A"
    model.save_pretrained(a)
    borrowed = load_headed(str(saved_backbone(a)), head_configs=HEADS)
    with pytest.raises(CheckpointError, match=r"save_backbone=False.*checkpoint '.*A' owns"):
        borrowed.save_pretrained(tmp_path / "B", save_backbone=False)
    assert not (tmp_path / "B" / MANIFEST).exists()


# ---------------------------------------------------------------------- deletion
HOSTILE_ENTRIES = {
    "weights-a-csv": lambda m: m.update(weights="data-0123456789ab.csv"),
    "weights-a-users-safetensors": lambda m: m.update(weights="heads-0123456789ab.safetensors"),
    "backbone-user": lambda m: m.update(backbone={"kind": "saved", "path": "backbone-user"}),
    "backbone-named-like-ours": lambda m: m["backbone"].update(path="backbone-0123456789ab"),
    "adapter-named-like-ours": lambda m: m.update(adapter={"path": "adapter-0123456789ab"}),
}


@pytest.mark.parametrize("edit", HOSTILE_ENTRIES.values(), ids=HOSTILE_ENTRIES)
def test_a_hand_edited_manifest_gets_no_users_file_deleted(tmp_path, model, edit):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    planted = plant_user_files(folder)
    manifest = manifest_of(folder)
    edit(manifest)
    write_manifest(folder, manifest)
    set_heads(model, 0.5)
    model.save_pretrained(folder, save_backbone=True)
    assert_intact(folder, planted)
    assert_same(predict(HeadedModel.from_pretrained(folder)), predict(model))


def plant_record(folder: Path, token: str, record: object) -> Path:
    path = folder / f".headkit-save-{token}.json"
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    return path


def test_a_planted_save_record_deletes_nothing_of_the_users(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    planted = plant_user_files(folder)
    (tmp_path / "outside.txt").write_text("outside")
    names = [*planted, "backbone-user", "../outside.txt", MANIFEST, "."]
    token = "0123456789ab"
    record = {"format": "headkit-save", "token": token, "created": names, "replaces": names}
    path = plant_record(folder, token, record)
    model.save_pretrained(folder)
    assert_intact(folder, planted)
    assert (tmp_path / "outside.txt").read_text() == "outside"
    assert not path.exists()  # a record in headkit's form is finished (deleting nothing here)
    assert_same(predict(HeadedModel.from_pretrained(folder)), predict(model))


MALFORMED_RECORDS = {
    "not-json": "rm -rf everything",
    "created-not-a-list": {"format": "headkit-save", "token": "0123456789ab", "created": 5},
    "token-of-another-record": {"format": "headkit-save", "token": "ffffffffffff", "created": []},
    "not-an-object": [1, 2, 3],
    "a-directory": None,
}


@pytest.mark.parametrize("record", MALFORMED_RECORDS.values(), ids=MALFORMED_RECORDS)
def test_a_malformed_save_record_is_reported_and_never_blocks_a_save(tmp_path, model, record):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    path = folder / ".headkit-save-0123456789ab.json"
    if record is None:
        path.mkdir()
        (path / "keep.txt").write_text("the user's")
    else:
        plant_record(folder, "0123456789ab", record)
    before = path.is_dir() or path.read_text()
    for value in (0.5, 0.75):  # every later save goes through, each one says so
        set_heads(model, value)
        with pytest.warns(UserWarning, match=r"ignored '.*\.headkit-save-0123456789ab\.json'"):
            model.save_pretrained(folder)
        assert_same(predict(HeadedModel.from_pretrained(folder)), predict(model))
    assert (path / "keep.txt").is_file() if record is None else path.read_text() == before


def test_a_record_torn_while_it_was_written_is_removed_without_a_warning(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    torn = plant_record(folder, "0123456789ab", '{"format": "headkit-save", "token": "0123')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.save_pretrained(folder)
    assert not torn.exists()


def test_files_a_save_wrote_carry_its_token(tmp_path, model):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    manifest = manifest_of(folder)
    backbone_token = manifest["backbone"]["path"].removeprefix("backbone-")
    assert (folder / manifest["backbone"]["path"] / MARKER).read_text() == backbone_token
    with open(folder / manifest["weights"], "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert header["__metadata__"]["token"] == manifest["weights"][6:18]


def test_a_checkpoint_written_before_tokens_is_still_cleaned_by_its_checksums(tmp_path, model):
    """Files of an older save carry no token: the previous manifest's checksums prove them."""
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    manifest = manifest_of(folder)
    old_backbone, old_heads = folder / manifest["backbone"]["path"], folder / manifest["weights"]
    (old_backbone / MARKER).unlink()
    save_file(load_file(str(old_heads)), str(old_heads), metadata={"format": "headkit"})
    from headkit.checkpoint.manifest import sha256_file

    manifest["weights_sha256"] = sha256_file(old_heads)
    write_manifest(folder, manifest)
    with torch.no_grad():
        model.backbone.wte.weight.mul_(1.5)
    model.save_pretrained(folder)
    assert not old_backbone.exists() and not old_heads.exists()
    assert_same(predict(HeadedModel.from_pretrained(folder)), predict(model))


# ---------------------------------------------------------------------- the lock file
def test_a_lock_file_that_is_a_symlink_is_never_followed(tmp_path, model):
    folder, outside = tmp_path / "ckpt", tmp_path / "outside" / "created-by-headkit"
    outside.parent.mkdir()
    folder.mkdir()
    (folder / LOCK).symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"'.*\.headkit\.lock' is a symlink.*remove it"):
        model.save_pretrained(folder)
    assert not outside.exists() and list(outside.parent.iterdir()) == []
    (folder / LOCK).unlink()  # the fix the error names
    model.save_pretrained(folder)
    assert not (folder / LOCK).exists()


@pytest.mark.parametrize("kind", ["directory", "non-empty-file"])
def test_a_lock_that_is_a_directory_or_holds_data_is_reported_with_the_fix(tmp_path, model, kind):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    lock = folder / LOCK
    if kind == "directory":
        lock.mkdir()
        (lock / "keep.txt").write_text("the user's")
    else:
        lock.write_text("the user's")
    with pytest.raises(CheckpointError, match=r"'.*\.headkit\.lock' is .*remove it"):
        model.save_pretrained(folder)
    assert (lock / "keep.txt").is_file() if kind == "directory" else lock.read_text()
    assert not (folder / MANIFEST).exists()


# ---------------------------------------------------------------------- loads during saves
def _keep_saving(folder: Path, rounds: int) -> None:
    """A saving process: a new backbone and heads each round, so every save deletes the
    previous save's folder right after its commit."""
    torch.manual_seed(0)
    model = HeadedModel(build_tiny("gpt2", num_layers=2), HEADS)
    for r in range(rounds):
        with torch.no_grad():
            model.backbone.wte.weight.add_(0.01)
        set_heads(model, r)
        model.save_pretrained(folder)
        time.sleep(0.05)  # a training loop saving often: the loads start between saves


@pytest.mark.skipif(sys.platform != "linux", reason="forks its saving process (Linux)")
def test_loads_overlapping_another_processs_saves_retry_and_all_succeed(tmp_path, model):
    folder, loads = tmp_path / "ckpt", 12
    model.save_pretrained(folder)
    saver = fork(_keep_saving, folder, 200, log=tmp_path / "saver.log")
    loaded, failures = 0, []
    try:
        for _ in range(loads):
            try:
                HeadedModel.from_pretrained(folder)
                loaded += 1
            except CheckpointError as e:
                failures.append(str(e)[:200])
        assert saver.is_alive(), "the saving process ended before the loads did"
    finally:
        saver.kill()
        saver.join(timeout=30)
    assert loaded == loads, failures
