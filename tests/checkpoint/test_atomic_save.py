"""A save interrupted at any moment leaves a checkpoint that loads as exactly v1 or exactly v2.

A child process (forked: it starts at once with this process's imports) builds a tiny model
(fixed seed) with a large head (so writes take a while), saves v1 into several folders,
changes its heads (v2) and saves v2 over each folder.

- At each step of the save protocol (before/after the heads file is renamed into place,
  before the backbone folder is renamed, before/after the manifest commit) the child freezes
  itself with SIGSTOP from inside ``os.replace`` (instrumented in the child only: headkit has
  no test hook). While it is frozen the parent copies the folder: exactly what a SIGKILL at
  that instant leaves on disk (written data is in the page cache, nothing more will be
  written). The child then continues, so one process covers every step.
- The last save is really killed: frozen the same way midway through save_pretrained, the
  child gets SIGKILL. Stopping inside ``os.replace`` makes every kill point deterministic;
  a kill in the middle of writing a temporary file leaves the same state as one just after
  it (a temporary name the loader never reads), so these points cover every state a crash
  can leave.

The parent then loads every copy and the killed folder and checks predictions are
bit-identical to v1 (commit not reached) or to v2 (commit done): never a mix, never an error.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import IDS, MASK, same
from conftest import build_tiny
from multiproc import fork
from safetensors.torch import load_file, save_file

from headkit import HeadConfig, HeadedModel

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists() or sys.platform != "linux",
    reason="reads process states from /proc (Linux)",
)

#: (name the os.replace destination starts with, "before" or "after" the rename)
STOPS = [
    ("heads-", "before"),
    ("heads-", "after"),
    ("backbone-", "before"),
    ("head_configs.json", "before"),
    ("head_configs.json", "after"),
]
#: Whether each stop is past the commit point (the manifest replace).
COMMITTED = [False, False, False, False, True]
#: Where the last save is stopped and then really killed: new heads file in place, new
#: backbone written to its temporary folder, manifest not yet replaced.
KILL_AT = ("backbone-", "before")


def freeze() -> None:
    """Stop this process; the parent inspects the folders, then sends SIGCONT."""
    os.kill(os.getpid(), signal.SIGSTOP)


def saving_child(work: Path, stops: list[tuple[str, str]]) -> None:
    """Save v1 into one folder per stop, then v2 over each, freezing at each stop."""
    heads = [
        HeadConfig("big", num_outputs=50_000),  # 6.4 MB of weights: the write takes a while
        HeadConfig("cls", num_outputs=3, pred_for_sequence=True, pooling="mean"),
    ]
    model = HeadedModel(build_tiny("gpt2", num_layers=2, task="base"), heads).eval()

    def predictions(name: str) -> None:
        with torch.no_grad():
            save_file(model(IDS, attention_mask=MASK).preds_by_head, str(work / name))

    for k in range(len(stops)):
        model.save_pretrained(work / f"ckpt{k}")
    predictions("v1.safetensors")
    with torch.no_grad():
        for p in model.heads.parameters():
            p.mul_(-0.5).add_(0.01)
    predictions("v2.safetensors")
    freeze()  # ready: every folder holds v1

    real_replace, stop = os.replace, None

    def replace(src, dst):
        hit = stop is not None and Path(dst).name.startswith(stop[0])
        if hit and stop[1] == "before":
            freeze()
        real_replace(src, dst)
        if hit and stop[1] == "after":
            freeze()

    os.replace = replace  # in the child only: headkit has no test hook
    for k, current in enumerate(stops):  # the parent kills the child at the last stop
        stop = current  # what replace() reads
        model.save_pretrained(work / f"ckpt{k}")
    print("the last save completed: the child was not killed", flush=True)


def wait_until_stopped(child, log: Path, timeout: float = 300.0) -> None:
    """Block until the child is in state T (stopped); fail with its log if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.is_alive():
            pytest.fail(f"child exited with {child.exitcode}:\n{log.read_text()[-3000:]}")
        state = Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state in ("T", "t"):
            return
        time.sleep(0.005)
    child.kill()
    pytest.fail(f"child did not reach its stop point:\n{log.read_text()[-3000:]}")


def predict(folder: Path, ids: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    model = HeadedModel.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(ids, attention_mask=mask).preds_by_head


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict:
    """Run the child once; return the folder copies left at each stop and the killed folder."""
    work = tmp_path_factory.mktemp("atomic")
    log = work / "child.log"
    stops = [*STOPS, KILL_AT]
    child = fork(saving_child, work, stops, log=log)
    try:
        wait_until_stopped(child, log)  # every folder holds v1
        v1 = [(work / f"ckpt{k}/head_configs.json").read_bytes() for k in range(len(stops))]
        snapshots, committed = [], []
        for k in range(len(STOPS)):
            os.kill(child.pid, signal.SIGCONT)
            wait_until_stopped(child, log)
            snap = Path(shutil.copytree(work / f"ckpt{k}", work / f"snapshot{k}"))
            snapshots.append(snap)
            committed.append((snap / "head_configs.json").read_bytes() != v1[k])
        os.kill(child.pid, signal.SIGCONT)
        wait_until_stopped(child, log)  # frozen inside the last save_pretrained ...
        os.kill(child.pid, signal.SIGKILL)  # ... and killed there
        child.join(timeout=60)
    finally:
        if child.exitcode is None:
            child.kill()
            child.join()
    killed = work / f"ckpt{len(STOPS)}"
    return {
        "v1": load_file(work / "v1.safetensors"),
        "v2": load_file(work / "v2.safetensors"),
        "snapshots": snapshots,
        "committed": committed,
        "killed": killed,
        "killed_committed": (killed / "head_configs.json").read_bytes() != v1[-1],
        "exitcode": child.exitcode,
    }


def test_versions_differ(interrupted):
    """Control: v1 and v2 predictions differ, so "equal to v1" really identifies v1."""
    assert not same(interrupted["v1"], interrupted["v2"])


def test_the_commit_point_is_the_manifest_replace(interrupted):
    assert interrupted["committed"] == COMMITTED


@pytest.mark.parametrize("k", range(len(STOPS)), ids=[f"{n}-{w}" for n, w in STOPS])
def test_a_save_stopped_at_each_step_loads_as_exactly_one_version(
    interrupted, k, tmp_path, single_thread
):
    # (a copy: a load finishes a dead save's cleanup, and the snapshots are shared)
    preds = predict(shutil.copytree(interrupted["snapshots"][k], tmp_path / "ckpt"), IDS, MASK)
    expected = "v2" if interrupted["committed"][k] else "v1"
    other = "v1" if expected == "v2" else "v2"
    assert same(preds, interrupted[expected])
    assert not same(preds, interrupted[other])


def test_a_save_killed_midway_loads_as_v1(interrupted, single_thread):
    assert interrupted["exitcode"] == -signal.SIGKILL  # killed, not finished
    folder = interrupted["killed"]
    assert list(folder.glob(".tmp-backbone-*")) and len(list(folder.glob("heads-*"))) == 2
    assert not interrupted["killed_committed"]
    preds = predict(folder, IDS, MASK)
    assert same(preds, interrupted["v1"]) and not same(preds, interrupted["v2"])


def test_the_next_save_clears_what_an_interrupted_one_left(interrupted, tmp_path, single_thread):
    """The folder stopped just before the commit holds the new heads file, the new backbone
    folder and the temporary manifest; loading it (writable, no save holding its lock: the
    save is dead) removes them, as the next save would, and saving again leaves it clean."""
    folder = Path(shutil.copytree(interrupted["snapshots"][3], tmp_path / "ckpt"))
    assert len(list(folder.glob("heads-*"))) == 2 and list(folder.glob(".tmp-*"))
    model = HeadedModel.from_pretrained(folder)
    assert len(list(folder.glob("heads-*"))) == 1 and not list(folder.glob(".tmp-*"))
    model.save_pretrained(folder)
    names = sorted(p.name for p in folder.iterdir())
    expected = ["README.md", "backbone", "head_configs.json", "heads"]
    assert [n.split("-")[0] for n in names] == expected, names
    assert same(predict(folder, IDS, MASK), interrupted["v1"])
