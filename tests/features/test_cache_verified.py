"""A feature cache on disk is verified when it is opened: checksums, shapes, offsets and the
backbone it came from. Tampered, mixed or old caches are refused saying what is wrong, and
``overwrite=True`` deletes nothing of the user's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import build_tiny
from test_features import collate, make_rows

from headkit import (
    CachedFeatures,
    CheckpointError,
    ConfigError,
    HeadConfig,
    HeadedModel,
    cache_features,
    train_heads_on_features,
)

HEADS = [
    HeadConfig("tags", layer_hook=1, num_outputs=5),
    HeadConfig("label", pred_for_sequence=True, num_outputs=3, pooling="mean"),
]
ROWS = [{k: r[k] for k in ("input_ids", "label", "tags")} for r in make_rows(12)]
KW = {"batch_size": 6, "collate_fn": collate, "progress": False}


def _cache(folder, seed=0):
    model = HeadedModel(build_tiny("bert", num_layers=2, seed=seed), HEADS)
    cache_features(model, ROWS, storage=folder, **KW)
    return model


def _manifest(folder):
    return json.loads((folder / "manifest.json").read_text())


def _write_manifest(folder, manifest):
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_the_manifest_records_checksums_shapes_dtypes_and_the_backbone(tmp_path):
    _cache(tmp_path / "c")
    manifest = _manifest(tmp_path / "c")
    assert manifest["version"] == 2
    for spec in manifest["arrays"].values():
        assert len(spec["sha256"]) == 64 and spec["dtype"] and spec["shape"]
    assert manifest["meta"]["backbone"]["fingerprint"].startswith("tensors:")


def test_arrays_swapped_for_another_backbones_are_refused(tmp_path):
    _cache(tmp_path / "a", seed=0)
    _cache(tmp_path / "b", seed=1)  # same class and sizes, other weights
    specs = _manifest(tmp_path / "a")["arrays"]
    key = next(n for n in specs if n.startswith("features/"))
    shutil.copy(tmp_path / "b" / specs[key]["file"], tmp_path / "a" / specs[key]["file"])
    with pytest.raises(CheckpointError, match="does not have the sha256 the manifest records"):
        CachedFeatures.load(tmp_path / "a")


def test_a_whole_cache_of_another_backbone_does_not_train(tmp_path):
    _cache(tmp_path / "b", seed=1)
    model = HeadedModel(build_tiny("bert", num_layers=2, seed=0), HEADS)
    with pytest.raises(ConfigError, match="weights' fingerprint differs"):
        train_heads_on_features(model, CachedFeatures.load(tmp_path / "b"), epochs=1)


@pytest.mark.parametrize(
    "tamper, message",
    [
        (lambda m: m["meta"].pop("num_tokens"), "meta num_tokens=None is invalid"),
        (lambda m: m["meta"].update(num_sequences="12"), "meta num_sequences='12' is invalid"),
        (lambda m: m["meta"].pop("feature_keys"), "meta feature_keys=None is invalid"),
        (lambda m: m["meta"]["labels"].update(label={}), "meta labels=.* is invalid"),
        (lambda m: m["meta"]["heads"]["tags"].pop("layer"), "meta heads=.* is invalid"),
        (lambda m: m["meta"].update(num_sequences=11), "expected 11 rows"),
        (lambda m: m["meta"].update(num_tokens=10**9), "expected 1000000000 rows"),
        (lambda m: m["arrays"]["offsets"].pop("sha256"), "records sha256=None"),
        (lambda m: m.update(version=1), "format version 1, written before caches"),
    ],
)
def test_a_tampered_manifest_is_one_headkit_error(tmp_path, tamper, message):
    _cache(tmp_path / "c")
    manifest = _manifest(tmp_path / "c")
    tamper(manifest)
    _write_manifest(tmp_path / "c", manifest)
    with pytest.raises(CheckpointError, match=message) as e:
        CachedFeatures.load(tmp_path / "c")
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda o: o.__setitem__(3, o[2] - 1), "token offsets decrease at sequence 2"),
        (lambda o: o.__setitem__(-1, 10**9), "token offsets run from 0 to 1000000000"),
        (lambda o: o.__setitem__(0, 5), "token offsets run from 5"),
    ],
)
def test_offsets_not_monotonic_or_out_of_range_are_refused(tmp_path, change, message):
    folder = tmp_path / "c"
    _cache(folder)
    manifest = _manifest(folder)
    spec = manifest["arrays"]["offsets"]
    offsets = torch.from_numpy(
        __import__("numpy").fromfile(folder / spec["file"], dtype="int64")
    ).clone()
    change(offsets)
    offsets.numpy().tofile(folder / spec["file"])
    with pytest.raises(CheckpointError, match="sha256"):  # the checksum sees it first
        CachedFeatures.load(folder)
    with pytest.raises(CheckpointError, match=message):  # and the offsets check without it
        CachedFeatures.load(folder, verify=False)


def test_overwrite_deletes_no_file_of_the_users(tmp_path):
    folder = tmp_path / "c"
    model = _cache(folder)
    (folder / "notes.bin").write_bytes(b"my own binary")
    (folder / "README.md").write_text("what this cache is")
    with pytest.raises(ConfigError, match="'README.md', 'notes.bin'"):
        cache_features(model, ROWS, storage=folder, overwrite=True, **KW)
    assert (folder / "notes.bin").read_bytes() == b"my own binary"
    (folder / "README.md").unlink()
    (folder / "notes.bin").unlink()
    # an array file the user replaced (same name, other bytes) is not headkit's either
    name = _manifest(folder)["arrays"]["offsets"]["file"]
    (folder / name).write_bytes(b"\0" * (folder / name).stat().st_size)
    with pytest.raises(ConfigError, match=f"'{name}'"):
        cache_features(model, ROWS, storage=folder, overwrite=True, **KW)
    assert (folder / name).read_bytes().count(0) == (folder / name).stat().st_size


def test_an_old_cache_is_rebuilt_with_overwrite(tmp_path):
    folder = tmp_path / "c"
    model = _cache(folder)
    manifest = _manifest(folder)
    manifest["version"] = 1
    for spec in manifest["arrays"].values():
        del spec["sha256"]
    _write_manifest(folder, manifest)
    with pytest.raises(CheckpointError, match=r"overwrite=True\) replaces it"):
        CachedFeatures.load(folder)
    cache_features(model, ROWS, storage=folder, overwrite=True, **KW)
    assert len(CachedFeatures.load(folder)) == len(ROWS)
