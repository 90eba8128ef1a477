"""Fuzzing the checkpoint loader: corrupted head_configs.json and heads safetensors files.

Each case starts from a good checkpoint and corrupts it one way (seeded, a few hundred cases):
byte flips, truncation and inserted garbage in either file; JSON edits (fields removed,
values of other types, huge numbers, nested junk, unknown fields). Loading must then either
raise a headkit error (CheckpointError, or ConfigError for a config the backbone refuses:
both ValueError subclasses) or succeed with exactly the saved head weights: and with
bit-identical predictions whenever the head configs came through unchanged. Never another
exception, never a hang (each load runs under an alarm).
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
import shutil
import signal
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoint_helpers import predict
from conftest import build_tiny

from headkit import HeadConfig, HeadedModel, HeadkitError

pytestmark = pytest.mark.usefixtures("single_thread")

MANIFEST = "head_configs.json"
JUNK: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2.5,
    -0.0,
    1e308,
    "",
    "x",
    "None",
    [],
    {},
    [1, "a"],
    {"k": [None]},
    10**30,
    -(10**30),
    2**63,
]
HUGE = [10**9, 10**12, 10**18, 2**63, 10**100, -(10**18)]


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> dict[str, Any]:
    """A saved checkpoint (two heads, moved off their init) with what loading must give."""
    torch.manual_seed(0)
    model = HeadedModel(
        build_tiny("gpt2", num_layers=2),
        [
            HeadConfig("cls", num_outputs=3, pred_for_sequence=True, pooling="mean+attention"),
            HeadConfig("tok", num_outputs=4, num_layers=2, hidden_size=8, layer_hook=1),
        ],
    )
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(0.25)
    folder = tmp_path_factory.mktemp("fuzz") / "ckpt"
    model.save_pretrained(folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests run (single_thread): bit-identical references
    try:
        preds = predict(model)
    finally:
        torch.set_num_threads(threads)
    return {
        "folder": folder,
        "manifest": manifest,
        "weights": (folder / manifest["weights"]).read_bytes(),
        "configs": [c.to_dict() for c in model.head_configs.values()],
        "state": {k: v.clone() for k, v in model.head_state_dict().items()},
        "preds": preds,
    }


# ---------------------------------------------------------------------- corruptions
def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (the root excluded)."""
    out = [prefix] if prefix else []
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    )
    for key, value in items:
        out += _paths(value, (*prefix, key))
    return out


def _set(obj: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def _remove(obj: Any, path: tuple) -> None:
    for key in path[:-1]:
        obj = obj[key]
    del obj[path[-1]]


def _flip(data: bytes, rng: random.Random, n: int, end: int | None = None) -> bytes:
    buf = bytearray(data)
    for _ in range(n):
        i = rng.randrange(end or len(buf))
        buf[i] ^= rng.choice([1 << rng.randrange(8), rng.randrange(1, 256)])  # always changes
    return bytes(buf)


# Each family: (rng, manifest dict, manifest bytes, weights bytes) -> (manifest, weights)
Corruption = Callable[[random.Random, dict, bytes, bytes], tuple[bytes, bytes]]


def manifest_byte_flips(rng, m, text, w):
    return _flip(text, rng, rng.randint(1, 4)), w


def manifest_truncation(rng, m, text, w):
    return text[: rng.randrange(len(text))], w


def manifest_garbage(rng, m, text, w):
    i = rng.randrange(len(text) + 1)
    return text[:i] + rng.randbytes(rng.randint(1, 40)) + text[i:], w


def json_remove_field(rng, m, text, w):
    _remove(m, rng.choice([p for p in _paths(m) if p]))
    return json.dumps(m).encode(), w


def json_change_type(rng, m, text, w):
    _set(m, rng.choice(_paths(m)), copy.deepcopy(rng.choice(JUNK)))
    return json.dumps(m).encode(), w


def json_huge_number(rng, m, text, w):
    numeric = [p for p in _paths(m) if _is_number(_get(m, p))]
    _set(m, rng.choice(numeric), rng.choice(HUGE))
    return json.dumps(m).encode(), w


def json_nested_junk(rng, m, text, w):
    depth = rng.choice([5, 100, 900, 50_000])
    _set(m, rng.choice(_paths(m)), "__JUNK__")
    opening, closing = rng.choice([("[", "]"), ('{"a":', "}")])
    junk = opening * depth + "1" + closing * depth
    return json.dumps(m).replace('"__JUNK__"', junk).encode(), w


def json_unknown_field(rng, m, text, w):
    target = rng.choice([m, *m["heads"], m["backbone"]])
    target[rng.choice(["hiden_size", "extra_field", "__class__", "weights2"])] = rng.choice(JUNK)
    return json.dumps(m).encode(), w


def weights_byte_flips(rng, m, text, w):
    return text, _flip(w, rng, rng.randint(1, 4))


def weights_truncation(rng, m, text, w):
    return text, w[: rng.randrange(len(w))]


def weights_garbage(rng, m, text, w):
    i = rng.randrange(len(w) + 1)
    return text, w[:i] + rng.randbytes(rng.randint(1, 64)) + w[i:]


def weights_header_flips_checksum_recomputed(rng, m, text, w):
    """The checksum is recomputed over the corrupted file (a missing one is refused), so it
    cannot catch it: the safetensors header itself must be validated."""
    header_end = 8 + int.from_bytes(w[:8], "little")
    w = _flip(w, rng, rng.randint(1, 3), end=header_end)
    m["weights_sha256"] = hashlib.sha256(w).hexdigest()
    return json.dumps(m).encode(), w


def _get(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


#: Corruptions of the weights file that its checksum in the manifest must always catch.
CHECKSUMMED = {"weights-byte-flips", "weights-truncation", "weights-garbage"}
FAMILIES: dict[str, tuple[Corruption, int]] = {
    "manifest-byte-flips": (manifest_byte_flips, 40),
    "manifest-truncation": (manifest_truncation, 25),
    "manifest-garbage": (manifest_garbage, 25),
    "json-remove-field": (json_remove_field, 40),
    "json-change-type": (json_change_type, 60),
    "json-huge-number": (json_huge_number, 30),
    "json-nested-junk": (json_nested_junk, 20),
    "json-unknown-field": (json_unknown_field, 10),
    "weights-byte-flips": (weights_byte_flips, 30),
    "weights-truncation": (weights_truncation, 20),
    "weights-garbage": (weights_garbage, 10),
    "weights-header-flips-checksum-recomputed": (weights_header_flips_checksum_recomputed, 40),
}


# ---------------------------------------------------------------------- the loader under fuzz
class _Hang(Exception):
    pass


def _alarm(signum, frame):
    raise _Hang


def load_with_alarm(folder: Path, seconds: int = 20) -> HeadedModel:
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return HeadedModel.from_pretrained(folder)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def check_outcome(folder: Path, original: dict[str, Any]) -> str:
    """Load ``folder``; return the outcome, or raise AssertionError for a bad one."""
    try:
        model = load_with_alarm(folder)
    except _Hang:
        raise AssertionError("loading hung") from None
    except HeadkitError as e:
        assert isinstance(e, ValueError) and str(e)
        return f"refused ({type(e).__name__})"
    state = model.head_state_dict()
    assert state.keys() == original["state"].keys(), "loaded other head tensors"
    for k, v in state.items():
        assert torch.equal(v, original["state"][k]), f"tensor {k} differs from the saved one"
    preds = predict(model)
    if [c.to_dict() for c in model.head_configs.values()] == original["configs"]:
        for name, p in preds.items():
            assert torch.equal(p, original["preds"][name]), f"predictions of {name} differ"
        return "loaded identically"
    for name, cfg in model.head_configs.items():  # another valid config: documented shapes
        lead = (2,) if cfg.pred_for_sequence else (2, 5)
        assert preds[name].shape == (*lead, cfg.num_outputs)
    return "loaded another valid config"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_corrupted_checkpoints_load_exactly_or_raise_a_headkit_error(
    family: str, original, tmp_path
):
    corrupt, cases = FAMILIES[family]
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for entry in original["folder"].iterdir():  # the backbone is copied, never corrupted
        if entry.is_dir():  # (a copy: symlinks leading outside a checkpoint are refused)
            shutil.copytree(entry, folder / entry.name)
    text = (original["folder"] / MANIFEST).read_bytes()
    weights_name = original["manifest"]["weights"]
    outcomes: dict[str, int] = {}
    for seed in range(cases):
        rng = random.Random(f"{family}-{seed}")
        manifest, weights = corrupt(
            rng, copy.deepcopy(original["manifest"]), text, original["weights"]
        )
        (folder / MANIFEST).write_bytes(manifest)
        (folder / weights_name).write_bytes(weights)
        try:
            outcome = check_outcome(folder, original)
        except AssertionError as e:
            saved = tmp_path / f"failing-{seed}"
            shutil.copytree(folder, saved, symlinks=True)
            raise AssertionError(f"{family} seed {seed} (kept in {saved}): {e}") from None
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(family, outcomes)  # shown with pytest -s
    refused = sum(n for outcome, n in outcomes.items() if outcome.startswith("refused"))
    if family == "json-unknown-field":
        # Tolerant reader: a field this version does not know (a newer version's) is ignored
        # with a warning, so checkpoints travel between versions; nothing else changes.
        assert outcomes == {"loaded identically": cases}, outcomes
        return
    assert refused > 0, outcomes  # the family really corrupts something
    if family in CHECKSUMMED:
        assert outcomes == {"refused (CheckpointError)": cases}, outcomes
