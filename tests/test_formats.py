"""Formats are registries: a new export format or checkpoint reader is one function or class
plus a registration, and the core asks the registry (``headkit/formats.py``)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import build_tiny

import headkit
from headkit import ConfigError, HeadConfig, HeadedModel
from headkit.checkpoint.restore import Checkpoint
from headkit.cli.main import main
from headkit.formats import EXPORTERS, READERS
from headkit.registry import Registry

ROOT = Path(__file__).resolve().parents[1]
CORE = ("config.py", "loading.py", "heads", "losses", "backbone", "model", "checkpoint")


def _model() -> HeadedModel:
    return HeadedModel(build_tiny("gpt2", num_layers=2), [HeadConfig("sent", num_outputs=2)])


# ---------------------------------------------------------------------- exporters
def test_an_export_format_is_a_function_and_a_registration(tmp_path: Path, capsys) -> None:
    seen = {}

    def to_json(model, output_dir, *, indent=None):
        seen["model"] = model
        Path(output_dir).mkdir()
        (Path(output_dir) / "heads.json").write_text(json.dumps(list(model.head_configs)))
        return indent

    EXPORTERS.register("heads-json", to_json)
    try:
        model = _model()
        assert headkit.EXPORTERS is EXPORTERS
        assert headkit.export(model, tmp_path / "out", format="heads-json", indent=2) == 2
        assert seen["model"] is model
        assert json.loads((tmp_path / "out" / "heads.json").read_text()) == ["sent"]
        with pytest.raises(SystemExit):
            main(["export", "--help"])
        assert "heads-json" in capsys.readouterr().out  # the command line lists the registry
    finally:
        EXPORTERS.remove("heads-json")


def test_an_unknown_export_format_names_the_field_and_the_registered_ones(tmp_path) -> None:
    with pytest.raises(ConfigError, match="format='svg' is invalid; allowed: .*onnx") as e:
        headkit.export(_model(), tmp_path, format="svg")
    assert (e.value.field, e.value.value) == ("format", "svg")


def test_built_in_formats_are_listed_without_importing_them() -> None:
    code = (
        "import sys, headkit; print(headkit.EXPORTERS.names(), headkit.formats.READERS.names());"
        "print('onnx' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert (
        out[0] == "['hub', 'onnx', 'sentence-transformers', 'transformers'] ['transformer-heads']"
    )
    assert out[1] == "False False"


# ---------------------------------------------------------------------- readers
class _ToyFormat:
    """A folder with ``toy.json`` ({"backbone": folder, "heads": [config dicts]}): the heads
    start as built (no weights saved) — a whole checkpoint format in one class."""

    def detect(self, root: Path) -> bool:
        return (root / "toy.json").is_file()

    def read(self, root: Path) -> Checkpoint:
        raw = json.loads((root / "toy.json").read_text())
        heads = [HeadConfig.from_dict(h) for h in raw["heads"]]
        manifest = {"heads": heads, "backbone": {"kind": "toy", "path": raw["backbone"]}}
        return Checkpoint(root, manifest, {}, format=self)

    def build_backbone(self, ckpt, model_class, torch_dtype, device_map, kwargs, trainable):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(ckpt.backbone["path"]), None

    def head_tensors(self, ckpt, model) -> dict[str, torch.Tensor]:
        return model.head_state_dict()

    def load_backbone_into(self, ckpt, model) -> None:
        pass


def test_a_checkpoint_format_is_a_reader_and_a_registration(tmp_path: Path) -> None:
    build_tiny("gpt2", num_layers=2).save_pretrained(tmp_path / "base")
    folder = tmp_path / "toy"
    folder.mkdir()
    heads = [{"name": "tag", "num_outputs": 3}]
    (folder / "toy.json").write_text(
        json.dumps({"backbone": str(tmp_path / "base"), "heads": heads})
    )
    with pytest.raises(Exception, match="head_configs.json"):  # not headkit's, nobody's yet
        HeadedModel.from_pretrained(folder)
    READERS.register("toy", _ToyFormat())
    try:
        model = HeadedModel.from_pretrained(folder)
        assert list(model.head_configs) == ["tag"]
        assert list(headkit.load_headed(folder).head_configs) == ["tag"]
    finally:
        READERS.remove("toy")


# ---------------------------------------------------------------------- the registry
def test_a_lazy_entry_is_imported_on_first_use() -> None:
    reg: Registry = Registry("thing", "kind")
    reg.register_lazy("dumps", "json:dumps")
    assert "dumps" in reg and reg.names() == ["dumps"]
    assert reg.get("dumps") is json.dumps
    with pytest.raises(ConfigError, match="already registered") as e:
        reg.register_lazy("DUMPS", "json:loads")
    assert (e.value.field, e.value.value) == ("kind", "DUMPS")
    with pytest.raises(ConfigError, match="kind='nope' is not a known thing") as e:
        reg.get("nope")
    assert (e.value.field, e.value.value) == ("kind", "nope")


# ---------------------------------------------------------------------- core and edges
def test_the_core_never_imports_the_compat_edge() -> None:
    found = []
    for part in CORE:
        path = ROOT / "headkit" / part
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            for node in ast.walk(ast.parse(file.read_text())):
                names = []
                if isinstance(node, ast.ImportFrom):
                    names = [("." * node.level) + (node.module or "")]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                found += [
                    (file.name, n) for n in names if "compat" in n or "transformer_heads" in n
                ]
    assert found == []


def test_the_core_never_mentions_transformer_heads() -> None:
    """Not even in a comment or a stored value: the edge registers its names (a reader, the
    ``ignore_pads`` alias) from ``headkit/__init__.py``."""
    pattern = re.compile(r"transformer[-_ ]heads|\bTH_", re.IGNORECASE)
    found = []
    for part in (*CORE, "metrics.py", "formats.py", "registry.py"):
        path = ROOT / "headkit" / part
        for file in [path] if path.is_file() else sorted(path.rglob("*.py")):
            found += [
                f"{file.relative_to(ROOT)}:{i}"
                for i, line in enumerate(file.read_text().splitlines(), 1)
                if pattern.search(line)
            ]
    assert found == []
    assert pattern.search("see transformer-heads' rule")  # the scan can fail


def test_a_peer_name_of_a_stored_value_is_an_alias_of_headkits() -> None:
    from headkit.formats import IGNORE_PADS_ALIASES

    assert IGNORE_PADS_ALIASES.get("transformer-heads") == "drop_last_real"
    cfg = HeadConfig("tok", num_outputs=3, ignore_pads="transformer-heads")
    assert cfg.ignore_pads == "drop_last_real"  # stored (and saved) as headkit's value
    assert cfg == HeadConfig("tok", num_outputs=3, ignore_pads="drop_last_real")
    with pytest.raises(
        ConfigError, match="ignore_pads='drop-last'.*also named 'transformer-heads'"
    ):
        HeadConfig("tok", num_outputs=3, ignore_pads="drop-last")


def test_a_lazy_entry_is_named_module_colon_attribute() -> None:
    reg: Registry = Registry("thing", "kind")
    with pytest.raises(ConfigError, match="a lazy thing is named as 'module:attribute'") as e:
        reg.register_lazy("dumps", "json.dumps")
    assert (e.value.field, e.value.value) == ("kind", "json.dumps")


def test_built_in_exporters_refuse_what_they_cannot_write(tmp_path: Path) -> None:
    two = HeadedModel(
        build_tiny("bert", num_layers=2),
        [HeadConfig(n, num_outputs=2, pred_for_sequence=True) for n in ("a", "b")],
    )
    with pytest.raises(ConfigError, match="head=None is ambiguous for a model with heads") as e:
        headkit.export(two, tmp_path / "st", format="sentence-transformers")
    assert e.value.field == "head"
    with pytest.raises(ConfigError, match="a SentenceTransformer needs the tokenizer") as e:
        headkit.export(two, tmp_path / "st", format="sentence-transformers", head="a")
    assert e.value.field == "tokenizer"
    with pytest.raises(ConfigError, match="format='hub' needs repo_id=") as e:
        headkit.export(two, tmp_path / "hub", format="hub")
    assert e.value.field == "repo_id"
