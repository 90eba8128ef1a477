"""transformer-heads folders are read with headkit's own discipline: nothing outside the
folder, sizes checked against the config before anything is built, short messages, and
non-finite weights refused. Every hostile folder is built here from the recorded fixtures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from th_fixtures import FULL, GPT2_BASE, HEADS_ONLY, LLAMA_BASE, LORA

from headkit import CheckpointError, HeadedModel, load_headed
from headkit.checkpoint.manifest import MANIFEST
from headkit.cli.main import main as cli_main

pytestmark = pytest.mark.usefixtures("single_thread")


def _copy(tmp_path: Path, source: Path) -> Path:
    """A copy of a fixture folder (LoRA: with its base beside it, where its config names it)."""
    out = tmp_path / "ckpt" / source.name
    shutil.copytree(source, out)
    if source == LORA:
        shutil.copytree(LLAMA_BASE, out.parent / LLAMA_BASE.name)
    return out


def _outside(tmp_path: Path, file: Path) -> Path:
    """A copy of ``file`` outside the checkpoint's folder."""
    target = tmp_path / "elsewhere" / file.name
    target.parent.mkdir(exist_ok=True)
    shutil.copy(file, target)
    return target


@pytest.mark.parametrize(
    "fixture, name",
    [
        (FULL, "model.safetensors"),
        (FULL, "config.json"),
        (FULL, "seq.safetensors"),
        (LORA, "adapter_model.safetensors"),
        (LORA, "tok.safetensors"),
        (LORA, MANIFEST),
        (LORA, "adapter_config.json"),
    ],
)
def test_a_file_that_is_a_symlink_out_of_the_folder_is_refused(tmp_path, fixture, name):
    folder = _copy(tmp_path, fixture)
    if name == "seq.safetensors":  # a full save holds its heads in model.safetensors too:
        state = load_file(folder / "model.safetensors")  # drop them, so seq's file is read
        save_file(
            {k: v for k, v in state.items() if not k.startswith("heads.seq.")},
            folder / "model.safetensors",
        )
    target = _outside(tmp_path, folder / name)
    (folder / name).unlink()
    (folder / name).symlink_to(target)
    with pytest.raises(CheckpointError, match="leads outside the checkpoint"):
        HeadedModel.from_pretrained(folder)


@pytest.mark.parametrize("layout", ["lora", "heads"])
def test_a_head_named_by_a_path_is_refused_and_nothing_outside_is_read(tmp_path, layout):
    folder = _copy(tmp_path, LORA if layout == "lora" else HEADS_ONLY)
    secret = _outside(tmp_path, folder / "seq.safetensors")  # what the name would read
    heads = json.loads((folder / MANIFEST).read_text())
    for bad in (str(secret.with_suffix("")), "../elsewhere/seq", ".hidden"):
        fields = {**heads["seq"], "name": bad}
        (folder / MANIFEST).write_text(json.dumps({**heads, "seq": fields}))
        with pytest.raises(CheckpointError, match=r"name[= ].* is invalid") as e:
            if layout == "lora":
                HeadedModel.from_pretrained(folder)
            else:
                load_headed(GPT2_BASE, head_folder_path=folder)
        assert "\n" not in str(e.value)


def test_a_config_of_a_million_blocks_is_refused_before_anything_is_built(tmp_path):
    folder = _copy(tmp_path, FULL)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "n_layer": 10**6}))
    with pytest.raises(CheckpointError, match=r"n_layer=1000000 blocks, but model.safetensors"):
        HeadedModel.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 10**9}))
    with pytest.raises(CheckpointError, match="vocab_size=1000000000 x n_embd=32"):
        HeadedModel.from_pretrained(folder)


def test_a_lora_saves_base_of_a_million_blocks_is_refused_before_it_is_built(tmp_path):
    folder = _copy(tmp_path, LORA)
    base = folder.parent / LLAMA_BASE.name
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**6}))
    with pytest.raises(CheckpointError, match="num_hidden_layers=1000000 blocks, but"):
        HeadedModel.from_pretrained(folder)


def test_a_head_of_a_million_layers_gets_a_short_error(tmp_path):
    folder = _copy(tmp_path, LORA)
    heads = json.loads((folder / MANIFEST).read_text())
    heads["tok"]["num_layers"] = 10**6
    (folder / MANIFEST).write_text(json.dumps(heads))
    with pytest.raises(CheckpointError, match=r"head 'tok' \(num_layers=1000000\)") as e:
        HeadedModel.from_pretrained(folder)
    assert len(str(e.value)) < 300
    heads["tok"]["num_layers"] = 2
    heads["tok"]["name"] = "t" * 10**6  # a huge value is echoed cut short
    (folder / MANIFEST).write_text(json.dumps(heads))
    with pytest.raises(CheckpointError) as e:
        HeadedModel.from_pretrained(folder)
    assert len(str(e.value)) < 500


@pytest.mark.parametrize("fixture, file", [(FULL, "model.safetensors"), (LORA, "tok.safetensors")])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, fixture, file):
    folder = _copy(tmp_path, fixture)
    state = load_file(folder / file)
    key = sorted(k for k, v in state.items() if v.is_floating_point())[0]
    state[key] = torch.full_like(state[key], float("nan"))
    save_file(state, folder / file)
    with pytest.raises(CheckpointError, match=f"tensor '{key}' holds NaN or infinite values"):
        HeadedModel.from_pretrained(folder)


def test_convert_overwrite_replaces_only_headkits_files(tmp_path):
    out = tmp_path / "converted"
    assert cli_main(["convert", str(LORA), str(out), "--quiet"]) == 0
    mine = {
        "thesis.tex": "\\chapter{one}",
        "README.md": "# my notes on this run\n",
        "tokenizer.json": '{"mine": true}',
        "notes/day1.md": "lr 1e-4",
    }
    (out / "README.md").unlink()  # the card: replaced by the user's own README below
    for name, text in mine.items():
        (out / name).parent.mkdir(exist_ok=True)
        (out / name).write_text(text)
    assert cli_main(["convert", str(LORA), str(out), "--quiet", "--overwrite"]) == 0
    for name, text in mine.items():
        assert (out / name).read_text() == text
    assert HeadedModel.from_pretrained(out).head_configs.keys() == {
        "lm_head",
        "tok",
        "seq",
        "reg",
        "seqreg",
    }
