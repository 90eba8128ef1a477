"""A save that fails part-way (the disk full) or is killed while it cleans up leaves no stray:
no ``.headkit-save-*`` record, no temporary file, no replaced backbone's shards for ever."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import build_tiny

from headkit import ConfigError, HeadConfig, HeadedModel
from headkit.checkpoint import journal, save

HEADS = [HeadConfig("cls", num_outputs=2, pred_for_sequence=True, pooling="mean")]


def _full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _strays(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith((".headkit-", ".tmp-")))


def _model(seed: int = 0) -> HeadedModel:
    return HeadedModel(build_tiny("bert", num_layers=2, seed=seed), HEADS).eval()


def _preds(model: HeadedModel) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([[5, 6, 7]])).preds_by_head["cls"]


def _half_then_full(real):
    """A writer that writes part of its file, then finds the disk full."""

    def write(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"\0" * 64)
        _full()

    return write


@pytest.mark.parametrize("where", ["record", "heads", "backbone", "manifest"])
def test_a_full_disk_during_a_save_leaves_no_stray_and_the_old_checkpoint(
    tmp_path, monkeypatch, where
):
    folder = tmp_path / "ckpt"
    old = _model(0)
    old.save_pretrained(folder)
    before = sorted(p.name for p in folder.iterdir())
    if where == "record":
        real = journal.write_record

        def record(path, text):
            real(path, text[: len(text) // 2])  # torn: half of it on disk
            _full()

        monkeypatch.setattr(journal, "write_record", record)
    elif where == "heads":
        monkeypatch.setattr(save, "save_file", _half_then_full(save.save_file))
    elif where == "backbone":
        real_fsync = save.fsync_file

        def fsync(path):
            if ".tmp-backbone-" in str(path):
                _full()
            real_fsync(path)

        monkeypatch.setattr(save, "fsync_file", fsync)
    else:
        real_fsync = save.fsync_file

        def fsync(path):
            if Path(path).name.startswith(".tmp-head_configs.json-"):
                _full()
            real_fsync(path)

        monkeypatch.setattr(save, "fsync_file", fsync)
    with pytest.raises(OSError, match="No space left"):
        _model(1).save_pretrained(folder)
    assert _strays(folder) == []
    assert sorted(p.name for p in folder.iterdir()) == before
    torch.testing.assert_close(_preds(HeadedModel.from_pretrained(folder)), _preds(old))


KILLED_CLEANUP = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    from conftest import build_tiny
    from headkit import HeadConfig, HeadedModel
    from headkit.checkpoint import journal

    heads = [HeadConfig("cls", num_outputs=2, pred_for_sequence=True, pooling="mean")]
    real = journal.delete_entry

    def delete_then_die(entry):  # the first file of the replaced backbone goes, then kill -9
        real(entry)
        os.kill(os.getpid(), signal.SIGKILL)

    journal.delete_entry = delete_then_die
    HeadedModel(build_tiny("bert", num_layers=2, seed=1), heads).save_pretrained({folder!r})
    """
)


@pytest.mark.parametrize("then", ["load", "save"])
def test_kill_9_during_the_cleanup_after_a_commit_is_finished_by_the_next_save_or_load(
    tmp_path, then
):
    folder = tmp_path / "ckpt"
    _model(0).save_pretrained(folder)
    (old_backbone,) = folder.glob("backbone-*")
    code = KILLED_CLEANUP.format(tests=str(Path(__file__).parents[1]), folder=str(folder))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    # committed; the old backbone is half deleted (its marker still in it), its record left
    assert old_backbone.exists() and (old_backbone / journal.MARKER).is_file()
    assert len(list(old_backbone.iterdir())) < 4
    assert [p.name for p in folder.glob(".headkit-save-*.json")]
    if then == "load":  # the next load finishes what the killed save left
        new = HeadedModel.from_pretrained(folder)
    else:  # so does the next save
        _model(1).save_pretrained(folder, save_backbone=True)
        new = HeadedModel.from_pretrained(folder)
    torch.testing.assert_close(_preds(new), _preds(_model(1)))
    assert not old_backbone.exists()
    assert _strays(folder) == []
    assert len(list(folder.glob("backbone-*"))) == 1


def test_main_process_only_must_be_a_bool(tmp_path):
    with pytest.raises(ConfigError, match="main_process_only='yes' is invalid; True"):
        _model().save_pretrained(tmp_path / "x", main_process_only="yes")
    _model().save_pretrained(tmp_path / "x", main_process_only=False)  # no process group
    assert (tmp_path / "x" / "head_configs.json").is_file()
