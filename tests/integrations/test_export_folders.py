"""Exports never replace or delete what is not theirs: the API refuses like the CLI, and an
earlier export's sidecar proves files by checksum, never by listing them."""

from __future__ import annotations

import json
import math

import pytest
from conftest import build_tiny

import headkit
from headkit import HeadConfig, HeadedModel
from headkit.checkpoint.manifest import MANIFEST
from headkit.cli.main import main
from headkit.errors import ConfigError
from headkit.integrations.hf_classifiers import SIDECAR as HF_SIDECAR
from headkit.integrations.onnx import SIDECAR as ONNX_SIDECAR

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model():
    heads = [HeadConfig("tags", num_outputs=3)]
    return HeadedModel(build_tiny("bert", num_layers=2), heads).eval()


def _user_files(folder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "thesis.tex").write_text("\\chapter{mine}")
    (folder / "data.csv").write_text("text,label\n")
    return {"thesis.tex": "\\chapter{mine}", "data.csv": "text,label\n"}


def _still_there(folder, files):
    for name, text in files.items():
        assert (folder / name).read_text() == text


def test_the_api_refuses_a_folder_of_the_users_files_like_the_cli(model, tmp_path):
    out = tmp_path / "mine"
    mine = _user_files(out)
    (out / "config.json").write_text('{"mine": 1}')
    (out / "model.safetensors").write_text("my weights")
    for fmt in ("transformers", "onnx"):
        with pytest.raises(ConfigError, match="files that are not an earlier") as e:
            headkit.export(model, out, fmt, tokenizer=False)
        assert "config.json" in str(e.value) and "\n" not in str(e.value)
    _still_there(out, {**mine, "config.json": '{"mine": 1}', "model.safetensors": "my weights"})


def test_an_earlier_export_is_replaced_only_with_overwrite(model, tmp_path):
    out = tmp_path / "hf"
    headkit.export(model, out, "transformers", tokenizer=False)
    described = json.loads((out / HF_SIDECAR).read_text())
    # the export's card is a file headkit wrote too: proven by its checksum like the weights
    assert set(described["files_sha256"]) == {"config.json", "model.safetensors", "README.md"}
    with pytest.raises(ConfigError, match="pass overwrite=True"):
        headkit.export(model, out, "transformers", tokenizer=False)
    headkit.export(model, out, "transformers", tokenizer=False, overwrite=True)
    assert (out / "model.safetensors").is_file()


def test_a_sidecar_listing_the_users_files_deletes_none_of_them(model, tmp_path):
    out = tmp_path / "hf"
    headkit.export(model, out, "transformers", tokenizer=False)
    mine = _user_files(out)
    sidecar = json.loads((out / HF_SIDECAR).read_text())
    sidecar["files"] += ["thesis.tex", "data.csv"]  # listed: never a reason to delete
    sidecar["files_sha256"]["thesis.tex"] = "0" * 64  # a checksum the file does not have
    (out / HF_SIDECAR).write_text(json.dumps(sidecar))
    headkit.export(model, out, "transformers", tokenizer=False, overwrite=True)
    _still_there(out, mine)


def test_a_user_file_an_export_would_replace_is_refused_and_nothing_moves(model, tmp_path):
    out = tmp_path / "hf"
    headkit.export(model, out, "transformers", tokenizer=False)
    (out / "config.json").write_text('{"edited": "by the user"}')  # no longer headkit's bytes
    with pytest.raises(ConfigError, match="would replace 'config.json', which headkit did not"):
        headkit.export(model, out, "transformers", tokenizer=False, overwrite=True)
    assert json.loads((out / "config.json").read_text()) == {"edited": "by the user"}
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-export-")]


def test_a_transformers_export_never_deletes_a_checkpoints_manifest(model, tmp_path):
    folder = tmp_path / "ckpt"
    model.save_pretrained(folder)
    before = (folder / MANIFEST).read_text()
    with pytest.raises(ConfigError, match="not an earlier transformers export"):
        headkit.export(model, folder, "transformers", tokenizer=False, overwrite=True)
    # a planted sidecar naming the manifest, even with its true checksum, deletes nothing
    from headkit.checkpoint.manifest import sha256_file

    planted = {"format": "headkit-transformers", "files": [MANIFEST]}
    planted["files_sha256"] = {MANIFEST: sha256_file(folder / MANIFEST)}
    (folder / HF_SIDECAR).write_text(json.dumps(planted))
    headkit.export(model, folder, "transformers", tokenizer=False, overwrite=True)
    assert (folder / MANIFEST).read_text() == before
    HeadedModel.from_pretrained(folder)


def test_export_overwrite_on_the_cli_keeps_the_users_files(model, tmp_path, capsys):
    ckpt, out = tmp_path / "ckpt", tmp_path / "onnx"
    model.save_pretrained(ckpt)
    args = ["export", str(ckpt), "--output", str(out), "--exporter", "torchscript", "--quiet"]
    assert main(args) == 0
    mine = _user_files(out)
    sidecar = json.loads((out / ONNX_SIDECAR).read_text())
    sidecar["files"] += list(mine)
    (out / ONNX_SIDECAR).write_text(json.dumps(sidecar))
    assert main([*args, "--overwrite"]) == 0
    _still_there(out, mine)
    assert (out / "model.onnx").is_file()


@pytest.mark.parametrize(
    "options, allowed",
    [
        ({"opset": -5}, "an integer from 7 to 23"),
        ({"opset": 10**6}, "an integer from 7 to 23"),
        ({"opset": 21, "exporter": "torchscript"}, "an integer from 7 to 20"),
        ({"opset": True}, "an integer from 7"),
        ({"atol": math.nan}, "a finite number >= 0"),
        ({"atol": -1.0}, "a finite number >= 0"),
        ({"atol": "0.1"}, "a finite number >= 0"),
        ({"exporter": "x" * 10**6}, "allowed: auto, dynamo, torchscript"),
    ],
)
def test_onnx_options_are_refused_before_anything_is_built(model, tmp_path, options, allowed):
    with pytest.raises(ConfigError, match=allowed) as e:
        headkit.export(model, tmp_path / "out", "onnx", **options)
    assert len(str(e.value)) < 300
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, allowed",
    [
        (["--opset", "-5"], "opset=-5 is invalid"),
        (["--opset", str(10**6)], "an integer from 7 to 23"),
        (["--atol", "nan"], "atol=nan is invalid"),
        (["--atol", "-1"], "a finite number >= 0"),
    ],
)
def test_onnx_options_on_the_cli_are_one_line(model, tmp_path, capsys, flags, allowed):
    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    capsys.readouterr()
    code = main(["export", str(ckpt), "--output", str(tmp_path / "o"), *flags, "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and allowed in err
    assert not (tmp_path / "o").exists()


def test_a_format_that_cannot_tell_its_files_apart_writes_only_into_a_new_folder(model, tmp_path):
    from headkit.formats import EXPORTERS

    written = []

    def names_only(m, output_dir, **options):  # a registered exporter with no check_target
        written.append(output_dir)

    EXPORTERS.register("names-only-test", names_only)
    try:
        mine = _user_files(tmp_path / "mine")
        with pytest.raises(ConfigError, match="writes into a new or empty folder only") as e:
            headkit.export(model, tmp_path / "mine", format="names-only-test", overwrite=True)
        assert "'data.csv', 'thesis.tex'" in str(e.value) and not written
        _still_there(tmp_path / "mine", mine)
        headkit.export(model, tmp_path / "new", format="names-only-test")
        assert written == [tmp_path / "new"]
    finally:
        EXPORTERS.remove("names-only-test")
