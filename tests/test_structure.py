"""Structure: one objective, one restore path, one input stage, head kinds, shared poolings.

Each test pins a rule that lives in one place, so that its callers cannot disagree.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import VOCAB, build_tiny
from safetensors.torch import load_file, save_file
from transformers import TrainingArguments

import headkit
from headkit import (
    HEADS,
    LOSSES,
    BatchError,
    CheckpointError,
    ConfigError,
    HeadConfig,
    HeadedModel,
    HeadedTrainer,
    LossSpec,
    MLPHead,
    SequencePooling,
    cache_features,
    load_headed,
)
from headkit.metrics import compute_head_metrics

pytestmark = pytest.mark.usefixtures("single_thread")

BATCH = {
    "input_ids": torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 2, 2]]),
    "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]),
}


# ---------------------------------------------------------------------- objective
def _focal(p: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    ce = F.cross_entropy(p, y, reduction="none", ignore_index=-100)
    return (1 - torch.exp(-ce)) ** 2 * ce


@pytest.fixture
def focal():
    LOSSES.register("focal_test", LossSpec(_focal, classes=True, ignores_minus_100=True))
    yield "focal_test"
    LOSSES.remove("focal_test")


def test_a_registered_class_loss_works_like_a_built_in_one(focal):
    heads = [
        HeadConfig("tok", num_outputs=4, loss_fct=focal),
        HeadConfig("seq", num_outputs=3, pred_for_sequence=True, loss_fct=focal),
        HeadConfig("lm_head", is_causal_lm=True, loss_fct=focal),
    ]
    model = HeadedModel(build_tiny("gpt2"), heads)
    tok = BATCH["input_ids"] % 4
    out = model(**BATCH, tok=tok, seq=torch.tensor([0, 2]), lm_head=BATCH["input_ids"])
    assert set(out.loss_by_head) == {"tok", "seq", "lm_head"}
    keep = BATCH["attention_mask"].bool()
    want = _focal(out.preds_by_head["tok"][keep], tok[keep]).mean()
    torch.testing.assert_close(out.loss_by_head["tok"], want)
    out.loss.backward()  # it trains
    assert compute_head_metrics(heads[1].replace(num_outputs=3), torch.eye(3), [0, 1, 2]) == {
        "accuracy": 1.0,
        "macro_f1": 1.0,
    }
    with pytest.raises(ConfigError, match=r"is_regression=True needs a regression loss"):
        HeadConfig("reg", is_regression=True, loss_fct=focal)


def test_loss_names_are_normalised_once_for_metrics_too():
    preds = torch.tensor([[0.9, 0.2], [0.1, 0.7]])
    labels = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    results = [
        compute_head_metrics(
            HeadConfig(
                "p",
                num_outputs=2,
                pred_for_sequence=True,
                loss_fct=name,
                output_activation="sigmoid",
            ),
            preds,
            labels,
        )
        for name in ("bce", "BCE", "Bce")
    ]
    assert results[0] == results[1] == results[2]
    assert results[0]["accuracy"] == pytest.approx(3 / 4)  # binary metrics, threshold 0.5


def test_minus_100_under_plain_mse_is_refused_not_trained_towards():
    model = HeadedModel(
        build_tiny("bert"),
        [HeadConfig("r", pred_for_sequence=True, is_regression=True, loss_fct="mse")],
    )
    with pytest.raises(BatchError, match=r"-100.*masked_mse"):
        model(**BATCH, r=torch.tensor([0.5, -100.0]))
    masked = HeadedModel(
        build_tiny("bert"),
        [HeadConfig("r", pred_for_sequence=True, is_regression=True, loss_fct="masked_mse")],
    ).eval()
    out = masked(**BATCH, r=torch.tensor([0.5, -100.0]))
    torch.testing.assert_close(out.loss_by_head["r"], (out.preds_by_head["r"][0, 0] - 0.5) ** 2)


# ---------------------------------------------------------------------- one restore path
HEADS_CFG = [
    HeadConfig("tag", layer_hook=2, num_outputs=5, loss_weight=0.5),
    HeadConfig("cls", num_outputs=3, pred_for_sequence=True, pooling="mean+max"),
]


def _labels() -> dict[str, torch.Tensor]:
    return {"tag": BATCH["input_ids"] % 5, "cls": torch.tensor([0, 2])}


def _fresh(base_dir: Path) -> HeadedModel:
    from transformers import AutoModel

    return HeadedModel(
        AutoModel.from_pretrained(base_dir),
        HEADS_CFG,
        freeze_base_model=False,
        loss_weighting="uncertainty",
    )


@pytest.fixture
def trained(tmp_path):
    """(base_dir, ckpt_dir, model): a fine-tuned backbone, uncertainty weighting, 'skip'."""
    base_dir = tmp_path / "base"
    build_tiny("gpt2").transformer.save_pretrained(base_dir)
    model = _fresh(base_dir)
    model.nonfinite_loss = "skip"
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    model(**BATCH, **_labels()).loss.backward()
    opt.step()
    model.eval()
    model.save_pretrained(tmp_path / "ckpt")
    return base_dir, tmp_path / "ckpt", model


def _restored_four_ways(base_dir: Path, ckpt: Path, tmp_path: Path) -> dict[str, HeadedModel]:
    out = {"from_pretrained": HeadedModel.from_pretrained(ckpt)}
    out["load_headed"] = load_headed(str(base_dir), head_folder_path=ckpt)
    args = TrainingArguments(str(tmp_path / "run"), report_to=[], use_cpu=True)
    resumed = _fresh(base_dir)
    HeadedTrainer(model=resumed, args=args)._load_from_checkpoint(str(ckpt))
    out["trainer_resume"] = resumed
    best = _fresh(base_dir)
    trainer = HeadedTrainer(model=best, args=args)
    trainer.state.best_model_checkpoint = str(ckpt)
    trainer._load_best_model()
    out["load_best_model_at_end"] = best
    return out


def test_the_four_restore_routes_give_identical_models(trained, tmp_path):
    base_dir, ckpt, model = trained
    model.eval()
    want = model(**BATCH).preds_by_head
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for route, again in _restored_four_ways(base_dir, ckpt, tmp_path).items():
        again.eval()
        assert again.nonfinite_loss == "skip", route
        assert again.loss_weighting.name == "uncertainty", route
        got = again.state_dict()
        assert got.keys() == state.keys(), route
        for k, v in state.items():
            assert torch.equal(got[k], v), f"{route}: {k} differs"
        for name, p in again(**BATCH).preds_by_head.items():
            assert torch.equal(p, want[name]), f"{route}: predictions of {name} differ"


def _backbone_file(ckpt: Path) -> Path:
    return next(ckpt.glob("backbone-*/model.safetensors"))


def _drop_checksums(ckpt: Path) -> None:
    manifest = json.loads((ckpt / "head_configs.json").read_text())
    del manifest["backbone"]["files_sha256"]
    (ckpt / "head_configs.json").write_text(json.dumps(manifest))


def _flip_bytes(ckpt: Path) -> None:
    path = _backbone_file(ckpt)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def _drop_tensor(ckpt: Path) -> None:
    _drop_checksums(ckpt)
    path = _backbone_file(ckpt)
    state = load_file(path)
    state.pop(sorted(state)[0])
    save_file(state, path, metadata={"format": "pt"})


def _nan_tensor(ckpt: Path) -> None:
    _drop_checksums(ckpt)
    path = _backbone_file(ckpt)
    state = load_file(path)
    state[sorted(state)[-1]][0] = float("nan")
    save_file(state, path, metadata={"format": "pt"})


@pytest.mark.parametrize("corrupt", [_flip_bytes, _drop_tensor, _nan_tensor])
def test_a_corrupted_saved_backbone_is_refused_by_all_four_routes(trained, tmp_path, corrupt):
    base_dir, ckpt, _ = trained
    corrupt(ckpt)
    routes = {
        "from_pretrained": lambda: HeadedModel.from_pretrained(ckpt),
        "load_headed": lambda: load_headed(str(base_dir), head_folder_path=ckpt),
    }
    args = TrainingArguments(str(tmp_path / "run"), report_to=[], use_cpu=True)
    routes["trainer_resume"] = lambda: HeadedTrainer(
        model=_fresh(base_dir), args=args
    )._load_from_checkpoint(str(ckpt))

    def best():
        trainer = HeadedTrainer(model=_fresh(base_dir), args=args)
        trainer.state.best_model_checkpoint = str(ckpt)
        trainer._load_best_model()

    routes["load_best_model_at_end"] = best
    for route, load in routes.items():
        with pytest.raises(CheckpointError):
            load()
            pytest.fail(f"{route} accepted a corrupted backbone")


def test_source_is_given_to_the_model_not_set_afterwards(tmp_path):
    build_tiny("bert").save_pretrained(tmp_path / "bert")
    model = load_headed(str(tmp_path / "bert"), head_configs=[HeadConfig("h")])
    assert model.source is not None and model.source.source == str((tmp_path / "bert").resolve())
    assert HeadedModel(build_tiny("bert"), [HeadConfig("h")]).source is None


# ---------------------------------------------------------------------- layering
def _package_imports() -> dict[str, set[str]]:
    """Module → headkit modules it imports, counting imports inside functions (not those
    under ``if TYPE_CHECKING``)."""
    root = Path(headkit.__file__).parent
    mods = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        name = ".".join(rel.parts)
        mods[name.removesuffix(".__init__")] = path
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        package = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - max(node.level - 1, 0)]
                target = ".".join(base + [node.module or ""]) if node.level else node.module or ""
                if node.level and not node.module:
                    target = ".".join(base)
                names = [f"{target}.{a.name}" for a in node.names]
                names += [target] if node.module else []  # `from . import x`: x, not the package
            else:
                names = [a.name for a in node.names]
            for t in names:
                while t and t not in mods:
                    t = t.rsplit(".", 1)[0] if "." in t else ""
                if t and t != mod and t != "headkit":  # the top level re-exports everything
                    edges[mod].add(t)
    return edges


def test_the_package_has_no_import_cycles():
    edges = _package_imports()
    assert "headkit.model.headed" in edges and "headkit.checkpoint.save" in edges
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in edges[m]:
            if state.get(n) == 1:
                cycles.append(path[path.index(n) :] + [n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in edges:
        if m not in state:
            visit(m, [m])
    assert not cycles, cycles
    # the documented direction: nothing below the model imports checkpoints' users
    assert not any(e.startswith("headkit.model") for e in edges["headkit.checkpoint.restore"])
    assert "headkit.loading" not in edges["headkit.checkpoint.manifest"]


# ---------------------------------------------------------------------- one input stage
def test_feature_caching_gets_the_same_input_checks_as_forward():
    model = HeadedModel(
        build_tiny("gpt2"), [HeadConfig("s", pred_for_sequence=True, loss_fct=None)]
    )
    bad_mask = {"input_ids": BATCH["input_ids"], "attention_mask": BATCH["attention_mask"] * 2}
    bad_ids = {"input_ids": BATCH["input_ids"] + VOCAB, "attention_mask": BATCH["attention_mask"]}
    for batch, pattern in ((bad_mask, r"attention_mask holds 2"), (bad_ids, r"outside the vocab")):
        with pytest.raises(BatchError, match=pattern):
            model(**batch)
        with pytest.raises(BatchError, match=pattern):
            cache_features(model, [batch], collate_fn=lambda b: b[0], progress=False)


# ---------------------------------------------------------------------- heads and poolings
@HEADS.register("scaled_linear_test")
class ScaledLinear(MLPHead):
    """A head kind of a test: MLPHead whose output is multiplied by a learned scalar."""

    def __init__(self, config, pooler_size=None, pooler=None):
        super().__init__(config, pooler_size, pooler)
        self.scale = torch.nn.Parameter(torch.tensor(2.0))

    def from_features(self, features):
        return super().from_features(features) * self.scale


def test_a_registered_head_kind_is_chosen_by_config_and_saved(tmp_path):
    cfg = HeadConfig("s", num_outputs=2, pred_for_sequence=True, head_type="scaled_linear_test")
    model = HeadedModel(build_tiny("llama"), [cfg]).eval()
    assert isinstance(model.heads["s"], ScaledLinear)
    with torch.no_grad():
        model.heads["s"].scale.fill_(3.0)
    want = model(**BATCH).preds_by_head["s"]
    model.save_pretrained(tmp_path / "c")
    again = HeadedModel.from_pretrained(tmp_path / "c").eval()
    assert isinstance(again.heads["s"], ScaledLinear)
    assert torch.equal(again(**BATCH).preds_by_head["s"], want)
    with pytest.raises(ConfigError, match=r"head_type='nope'.*allowed: .*mlp"):
        HeadConfig("x", head_type="nope")


def test_a_pooling_is_computed_once_per_layer_and_shared():
    heads = [
        HeadConfig(f"h{i}", num_outputs=2, pred_for_sequence=True, pooling="mean+max")
        for i in range(5)
    ]
    heads.append(HeadConfig("att", num_outputs=2, pred_for_sequence=True, pooling="attention"))
    heads.append(HeadConfig("other", layer_hook=1, pred_for_sequence=True, pooling="mean+max"))
    model = HeadedModel(build_tiny("gpt2"), heads).eval()
    calls = []
    for name, head in model.heads.items():
        head.pooling.register_forward_hook(lambda *a, name=name: calls.append(name))
    shared = model(**BATCH).preds_by_head
    assert sorted(calls) == ["att", "h0", "other"]  # one per (layer, pooling); attention learns
    for name, head in model.heads.items():  # the same values as each head pooling on its own
        hidden = model.backbone(**BATCH, output_hidden_states=True).hidden_states
        own = head(hidden[model.hooked_layers()[name]], BATCH["attention_mask"])
        torch.testing.assert_close(shared[name], own)


def test_the_backbone_pooler_is_bound_where_it_is_used():
    model = HeadedModel(
        build_tiny("bert"), [HeadConfig("p", pred_for_sequence=True, pooling="pooler")]
    )
    pooling: SequencePooling = model.heads["p"].pooling
    assert pooling.pooler is model.backbone.pooler
    assert not any("pooler" in k for k in model.head_state_dict())  # not a head parameter


# ---------------------------------------------------------------------- block stack
def test_block_stack_discovery_fails_clearly_and_accepts_an_override(tmp_path):
    gpt2 = build_tiny("gpt2").transformer
    gpt2.config.n_layer = 7  # no ModuleList of 7 blocks: inspection cannot be sure
    with pytest.raises(ConfigError, match=r"no nn.ModuleList has num_hidden_layers=7.*h \(3\)"):
        HeadedModel(gpt2, [HeadConfig("h")])
    with pytest.raises(ConfigError, match=r"layers_path='blocks' is not"):
        HeadedModel(gpt2, [HeadConfig("h")], layers_path="blocks")
    model = HeadedModel(gpt2, [HeadConfig("h", layer_hook=2)], layers_path="h").eval()
    assert model.info.num_layers == 3
    ids = BATCH["input_ids"][:1]  # unpadded: HF's own positions are then the same
    hidden = gpt2(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(model(input_ids=ids).preds_by_head["h"], model.heads["h"](hidden[2]))
    # the override travels with the checkpoint
    named = HeadedModel(build_tiny("gpt2").transformer, [HeadConfig("h")], layers_path="h")
    named.save_pretrained(tmp_path / "c")
    assert HeadedModel.from_pretrained(tmp_path / "c").layers_path == "h"


# ---------------------------------------------------------------------- tolerant readers
def test_saved_configs_leave_defaults_out_and_readers_ignore_unknown_fields(tmp_path):
    model = HeadedModel(build_tiny("bert"), [HeadConfig("h", num_outputs=3)]).eval()
    model.save_pretrained(tmp_path)
    manifest = json.loads((tmp_path / "head_configs.json").read_text())
    saved = manifest["heads"][0]
    assert saved == {"name": "h", "in_size": 32, "num_outputs": 3}
    saved["added_in_a_later_version"] = 1
    manifest["also_new"] = {"x": 1}
    (tmp_path / "head_configs.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match=r"added_in_a_later_version"):
        again = HeadedModel.from_pretrained(tmp_path).eval()
    assert torch.equal(again(**BATCH).preds_by_head["h"], model(**BATCH).preds_by_head["h"])
    with pytest.raises(ConfigError, match=r"unknown field"):  # a user's own dict stays strict
        HeadConfig.from_dict(saved)
