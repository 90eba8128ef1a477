"""No command writes over its inputs or a user's file: outputs are checked before any work and
written under a fresh exclusive name, then renamed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from cli_helpers import one_error_line, review_files, tiny_model, train_checkpoint, write_config

from headkit import ConfigError
from headkit.cli.main import main
from headkit.cli.outputs import check_output_folder, fresh_file, write_file

pytestmark = pytest.mark.usefixtures("single_thread")

MISSING_MODEL = "/nonexistent/model/folder"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("outputs")
    model = tiny_model(root)
    data = review_files(root)
    return {"model": model, **data, "ckpt": train_checkpoint(root, model, data["train"])}


def _data_copy(files: dict, tmp_path: Path) -> Path:
    data = tmp_path / "data.csv"
    shutil.copy(files["test"], data)
    return data


@pytest.mark.parametrize("command", ["predict", "eval"])
@pytest.mark.parametrize("alias", ["same path", "symlink", "hard link", "dot-dot path"])
def test_an_output_that_is_the_data_file_is_refused(files, tmp_path, capsys, command, alias):
    """Even with --overwrite: the data file keeps every byte (its other columns too)."""
    data = _data_copy(files, tmp_path)
    before = data.read_bytes()
    output = {
        "same path": data,
        "symlink": tmp_path / "link.csv",
        "hard link": tmp_path / "hard.csv",
        "dot-dot path": tmp_path / "sub" / ".." / "data.csv",
    }[alias]
    if alias == "symlink":
        output.symlink_to(data)
    elif alias == "hard link":
        os.link(data, output)
    args = [command, str(files["ckpt"]), "--data", str(data), "--output", str(output)]
    line = one_error_line(main([*args, "--overwrite", "--quiet"]), capsys.readouterr().err)
    assert "is the input" in line and str(data) in line
    assert data.read_bytes() == before


def test_an_existing_output_file_needs_overwrite(files, tmp_path, capsys) -> None:
    out = tmp_path / "pred.csv"
    out.write_text("my own notes\n")
    args = ["predict", str(files["ckpt"]), "--data", str(files["test"]), "--output", str(out)]
    line = one_error_line(main([*args, "--quiet"]), capsys.readouterr().err)
    assert f"--output='{out}' exists; pass --overwrite to replace it" in line
    assert out.read_text() == "my own notes\n"
    assert main([*args, "--quiet", "--overwrite"]) == 0
    assert out.read_text().startswith("row,text,sentiment,")


def test_predict_leaves_a_users_tmp_file_and_follows_no_symlink(files, tmp_path) -> None:
    """``pred.csv.tmp`` (the fixed name a writer might use) is the user's: untouched; the
    output itself a symlink: replaced by the predictions, its target untouched."""
    victim = tmp_path / "victim.csv"
    victim.write_text("precious\n")
    mine = tmp_path / "pred.csv.tmp"
    mine.write_text("mine\n")
    out = tmp_path / "pred.csv"
    out.symlink_to(victim)
    args = ["predict", str(files["ckpt"]), "--data", str(files["test"]), "--output", str(out)]
    assert main([*args, "--quiet", "--overwrite"]) == 0
    assert mine.read_text() == "mine\n" and victim.read_text() == "precious\n"
    assert not out.is_symlink() and out.read_text().startswith("row,text,")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pred.csv", "pred.csv.tmp", "victim.csv"]


def test_train_into_a_folder_of_user_files_is_refused_naming_them(files, tmp_path, capsys):
    """Refused before the model is loaded (the model does not even exist), with or without
    --overwrite; the user's tokenizer files keep their bytes."""
    out = tmp_path / "mine"
    out.mkdir()
    (out / "tokenizer.json").write_text('{"mine": true}')
    (out / "tokenizer_config.json").write_text('{"mine": true}')
    config = write_config(tmp_path / "c.yaml", Path(MISSING_MODEL), files["train"])
    for extra in ([], ["--overwrite"]):
        code = main(["train", str(config), "--output", str(out), "--quiet", *extra])
        line = one_error_line(code, capsys.readouterr().err)
        assert "is a folder with files that are not a headkit checkpoint" in line
        assert "(tokenizer.json, tokenizer_config.json)" in line
    assert (out / "tokenizer.json").read_text() == '{"mine": true}'
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]


def test_train_over_a_checkpoint_needs_overwrite(files, tmp_path, capsys) -> None:
    out = tmp_path / "ckpt"
    shutil.copytree(files["ckpt"], out)
    config = write_config(tmp_path / "c.yaml", files["model"], files["train"], "{epochs: 2}")
    line = one_error_line(
        main(["train", str(config), "--output", str(out), "--quiet"]), capsys.readouterr().err
    )
    assert "holds a headkit checkpoint already; pass --overwrite" in line
    assert main(["train", str(config), "--output", str(out), "--quiet", "--overwrite"]) == 0


def test_probe_output_is_checked_before_the_model_is_loaded(files, tmp_path, capsys) -> None:
    out = tmp_path / "probe"
    out.mkdir()
    (out / "probe_results.json").write_text("{}")
    base = ["probe", "--model", MISSING_MODEL, "--data", str(files["train"]), "--quiet"]
    line = one_error_line(main([*base, "--output", str(out)]), capsys.readouterr().err)
    assert "holds probe_results.json already; pass --overwrite" in line
    line = one_error_line(main([*base, "--output", str(files["train"])]), capsys.readouterr().err)
    assert "is a file; a folder is written there" in line
    assert (out / "probe_results.json").read_text() == "{}"


def test_export_refuses_its_checkpoint_and_a_folder_of_user_files(files, tmp_path, capsys):
    line = one_error_line(
        main(["export", str(files["ckpt"]), "--output", str(files["ckpt"]), "--quiet"]),
        capsys.readouterr().err,
    )
    assert "is the input" in line
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    line = one_error_line(
        main(["export", str(files["ckpt"]), "--output", str(mine), "--quiet", "--overwrite"]),
        capsys.readouterr().err,
    )
    assert "files that are not an earlier onnx export" in line and "(config.json)" in line


def test_an_output_folder_holding_an_input_is_refused(tmp_path) -> None:
    (tmp_path / "data.csv").write_text("text,label\n")
    with pytest.raises(ConfigError, match="holds the input"):
        check_output_folder(tmp_path, [tmp_path / "data.csv"], True, lambda p: True, "ours")


def test_files_are_written_under_a_fresh_name_and_renamed(tmp_path) -> None:
    """A write that fails leaves the old file and no temporary; each temporary name is new,
    hidden, beside the target, and created by this writer (O_EXCL)."""
    out = tmp_path / "metrics.json"
    out.write_text("old")

    def broken(f) -> None:
        f.write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_file(out, broken)
    assert out.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["metrics.json"]
    with fresh_file(out) as a, fresh_file(out) as b:
        assert a != b and a.parent == b.parent == tmp_path
        assert a.name.startswith(".metrics.json.") and a.stat().st_size == 0
    assert not a.exists() and not b.exists()
    write_file(out, lambda f: f.write("new"))
    assert out.read_text() == "new"


def test_the_demo_refuses_a_folder_of_other_files(tmp_path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    line = one_error_line(main(["demo", "--output", str(tmp_path)]), capsys.readouterr().err)
    assert "files that are not an earlier headkit demo's output (notes.txt)" in line
    assert (tmp_path / "notes.txt").read_text() == "mine"
