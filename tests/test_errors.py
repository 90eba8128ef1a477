"""Every bad input gets a clear headkit error: its type, and a message naming the field, the
value and what is allowed. One row of docs/errors.md per case below; the case id is the row.

Cases are tables (``CONFIG_CASES``, ``BATCH_CASES``, ``CHECKPOINT_CASES``): each builds the bad
input, names the expected error type and lists regexes that must all match the message.
Pickle files get their own tests: a real payload that would create a marker file is planted
in checkpoints and the marker must never appear.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import HIDDEN, VOCAB, build_tiny
from safetensors.torch import load_file, save_file

from headkit import (
    BatchError,
    CheckpointError,
    ConfigError,
    HeadConfig,
    HeadedModel,
    HeadkitError,
    load_headed,
)

pytestmark = [
    pytest.mark.usefixtures("single_thread"),
    # torch warns that it reads the planted pickles only with its restricted unpickler
    pytest.mark.filterwarnings("ignore:Detected pickle protocol"),
]

LAYERS = 2  # hidden_states has LAYERS + 1 entries: valid layer_hook -3..2


@dataclass(frozen=True)
class Case:
    """One bad input: ``make`` triggers it; ``patterns`` must all be found in the message."""

    id: str
    input: str  # what is wrong, in words (the docs table's first column)
    make: Callable[..., Any]
    error: type[HeadkitError]
    patterns: tuple[str, ...]


def assert_clear_error(case: Case, *args: Any) -> str:
    """Run the case; assert the exact error type and every message pattern; return the text."""
    with pytest.raises(HeadkitError) as info:
        case.make(*args)
    assert type(info.value) is case.error, f"{type(info.value).__name__}: {info.value}"
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    for pattern in case.patterns:
        assert re.search(pattern, message), f"{pattern!r} not in {message!r}"
    return message


# ---------------------------------------------------------------------- shared model
HEADS = [
    HeadConfig("cls", num_outputs=3, pred_for_sequence=True),
    HeadConfig("tok", num_outputs=4),
    HeadConfig("reg", num_outputs=2, pred_for_sequence=True, is_regression=True, loss_fct="mse"),
    # upper-case loss name: losses are looked up case-insensitively, checks must be too
    HeadConfig(
        "prob", pred_for_sequence=True, output_activation="sigmoid", loss_fct="BCE", target="p"
    ),
]
IDS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
GOOD_LABELS = {
    "cls": torch.tensor([0, 2]),
    "tok": torch.tensor([[0, 1, 2, 3, 0], [1, 1, 1, -100, -100]]),
    "reg": torch.tensor([[0.5, -1.0], [2.0, 0.0]]),
    "p": torch.tensor([0.0, 1.0]),
}


def _backbone():
    return build_tiny("gpt2", num_layers=LAYERS)


@pytest.fixture(scope="module")
def model() -> HeadedModel:
    """A tiny GPT-2 with a sequence, token, regression and probability head (read-only)."""
    torch.manual_seed(0)
    return HeadedModel(_backbone(), HEADS).eval()


def run(model: HeadedModel, **batch: Any):
    inputs = {"input_ids": IDS, "attention_mask": MASK}
    inputs.update(batch)
    with torch.no_grad():
        return model(**{k: v for k, v in inputs.items() if v is not None})


def test_the_valid_batch_trains_every_head(model):
    """The control for every batch case below: the same batch with good labels just works."""
    out = run(model, **GOOD_LABELS)
    assert set(out.loss_by_head) == {"cls", "tok", "reg", "prob"}
    assert all(torch.isfinite(v) for v in out.loss_by_head.values())
    assert out.preds_by_head["tok"].shape == (2, 5, 4)


# ---------------------------------------------------------------------- config
def _headed(*configs: HeadConfig) -> HeadedModel:
    return HeadedModel(_backbone(), list(configs))


CONFIG_CASES = [
    Case(
        "unknown-output-activation",
        "output_activation not in the activation registry",
        lambda: HeadConfig("h", output_activation="relu2"),
        ConfigError,
        (r"HeadConfig\(name='h'\)", r"output_activation='relu2'", r"allowed: .*gelu.*relu"),
    ),
    Case(
        "unknown-hidden-activation",
        "hidden_activation not in the activation registry",
        lambda: HeadConfig("h", num_layers=2, hidden_size=8, hidden_activation="Relu6"),
        ConfigError,
        (r"hidden_activation='Relu6'", r"allowed: .*silu"),
    ),
    Case(
        "unknown-loss",
        "loss_fct not in the loss registry",
        lambda: HeadConfig("h", loss_fct="cross_entropyy"),
        ConfigError,
        (r"loss_fct='cross_entropyy'", r"allowed: .*cross_entropy.*mse.* or None"),
    ),
    Case(
        "unknown-pooling",
        "pooling strategy not in the pooling registry",
        lambda: HeadConfig("h", pred_for_sequence=True, pooling="mean+meen"),
        ConfigError,
        (r"pooling='mean\+meen'", r"'meen' is not a known pooling", r"allowed: .*max.*mean"),
    ),
    Case(
        "pooling-on-token-head",
        "pooling set on a head with pred_for_sequence=False",
        lambda: HeadConfig("h", pooling="mean"),
        ConfigError,
        (r"pooling='mean'", r"only to sequence heads \(pred_for_sequence=True\)"),
    ),
    Case(
        "num-layers-below-1",
        "num_layers < 1",
        lambda: HeadConfig("h", num_layers=0),
        ConfigError,
        (r"num_layers=0", r"integer >= 1"),
    ),
    Case(
        "mlp-without-hidden-size",
        "num_layers > 1 without hidden_size",
        lambda: HeadConfig("h", num_layers=3),
        ConfigError,
        (r"hidden_size=0", r"num_layers=3 needs hidden_size >= 1"),
    ),
    Case(
        "regression-with-class-loss",
        "is_regression=True with loss_fct='cross_entropy'",
        lambda: HeadConfig("h", is_regression=True),
        ConfigError,
        (r"loss_fct='cross_entropy'", r"is_regression=True needs a regression loss \(.*mse"),
    ),
    Case(
        "bce-without-probabilities",
        "loss_fct='bce' on a head whose outputs are not probabilities",
        lambda: HeadConfig("h", loss_fct="bce"),
        ConfigError,
        (r"loss_fct='bce'", r"output_activation='sigmoid'", r"'linear'", r"bce_with_logits"),
    ),
    Case(
        "causal-lm-sequence-head",
        "is_causal_lm=True and pred_for_sequence=True",
        lambda: HeadConfig("h", is_causal_lm=True, pred_for_sequence=True),
        ConfigError,
        (r"is_causal_lm=True and pred_for_sequence=True", r"one token per position"),
    ),
    Case(
        "unknown-field",
        "a misspelt field in a config dict",
        lambda: HeadConfig.from_dict({"name": "h", "hiden_size": 8}),
        ConfigError,
        (r"unknown field\(s\) \['hiden_size'\]", r"allowed: .*hidden_size"),
    ),
    Case(
        "wrong-field-type",
        "a field of the wrong type (num_outputs='3')",
        lambda: HeadConfig("h", num_outputs="3"),
        ConfigError,
        (r"num_outputs='3'", r"positive integer or None"),
    ),
    Case(
        "in-size-mismatch",
        "in_size different from the hooked layer's width (at load)",
        lambda: _headed(HeadConfig("h", in_size=16, layer_hook=1)),
        ConfigError,
        (r"in_size=16", r"hooked layer 1", rf"\({HIDDEN}, the backbone's hidden size\)"),
    ),
    Case(
        "layer-hook-outside-backbone",
        "layer_hook outside the backbone's hidden states (at load)",
        lambda: _headed(HeadConfig("h", layer_hook=LAYERS + 1)),
        ConfigError,
        (rf"layer_hook={LAYERS + 1}", rf"allowed: -{LAYERS + 1}\.\.{LAYERS}", r"0 = embeddings"),
    ),
    Case(
        "duplicate-head-names",
        "two heads with the same name",
        lambda: _headed(HeadConfig("h"), HeadConfig("h", num_outputs=2)),
        ConfigError,
        (r"two heads are named 'h'", r"must be unique"),
    ),
    Case(
        "target-collides-with-input",
        "a head target equal to a model input name",
        lambda: _headed(HeadConfig("h", target="attention_mask")),
        ConfigError,
        (r"target='attention_mask'", r"collides with a model input", r"reserved: .*input_ids"),
    ),
    Case(
        "pooler-without-pooler",
        "pooling='pooler' on a backbone without a pooler",
        lambda: _headed(HeadConfig("h", pred_for_sequence=True, pooling="pooler")),
        ConfigError,
        (r"pooling='pooler'", r"GPT2Model has none", r"use 'first', 'mean'"),
    ),
]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: c.id)
def test_config_error(case: Case):
    assert_clear_error(case)


# ---------------------------------------------------------------------- batch
BATCH_CASES = [
    Case(
        "labels-wrong-batch-size",
        "labels whose first dimension is not the batch size",
        lambda m: run(m, cls=torch.tensor([0, 1, 2])),
        BatchError,
        (r"head 'cls'", r"labels of shape \(3,\)", r"batch size 2"),
    ),
    Case(
        "labels-wrong-shape",
        "regression labels of the wrong width",
        lambda m: run(m, reg=torch.zeros(2, 3)),
        BatchError,
        (r"head 'reg'", r"labels of shape \(2, 3\) do not fit", r"expected \(2, 2\)"),
    ),
    Case(
        "labels-wrong-dtype",
        "float labels for a cross-entropy head",
        lambda m: run(m, cls=torch.tensor([0.0, 1.0])),
        BatchError,
        (r"head 'cls'", r"loss_fct='cross_entropy'", r"integer class indices", r"float32"),
    ),
    Case(
        "labels-strings",
        "string labels",
        lambda m: run(m, cls=["pos", "neg"]),
        BatchError,
        (r"head 'cls'", r"labels of type list cannot become a tensor"),
    ),
    Case(
        "labels-not-array-like",
        "labels that are not numbers at all (a dict)",
        lambda m: run(m, cls={"a": 1}),
        BatchError,
        (r"head 'cls'", r"labels of type dict cannot become a tensor"),
    ),
    Case(
        "class-index-too-large",
        "class index >= num_outputs (caught before cross-entropy)",
        lambda m: run(m, cls=torch.tensor([0, 3])),
        BatchError,
        (r"class index 3", r"num_outputs=3", r"allowed: 0\.\.2 \(or -100 to ignore\)"),
    ),
    Case(
        "class-index-negative",
        "negative class index other than -100",
        lambda m: run(m, tok=torch.tensor([[0, 1, 2, 3, 0], [1, -1, 1, 1, 1]])),
        BatchError,
        (r"head 'tok'", r"class index -1", r"allowed: 0\.\.3"),
    ),
    Case(
        "regression-label-nan",
        "NaN regression label",
        lambda m: run(m, reg=torch.tensor([[0.0, float("nan")], [1.0, 1.0]])),
        BatchError,
        (r"head 'reg'", r"NaN or infinite", r"must be finite"),
    ),
    Case(
        "regression-label-inf",
        "infinite regression label",
        lambda m: run(m, reg=torch.tensor([[0.0, 1.0], [float("-inf"), 1.0]])),
        BatchError,
        (r"head 'reg'", r"NaN or infinite", r"must be finite"),
    ),
    Case(
        "bce-target-outside-0-1",
        "binary target outside [0, 1] (loss name in any case)",
        lambda m: run(m, p=torch.tensor([0.5, 2.0])),
        BatchError,
        (r"head 'prob' \(target 'p'\)", r"loss_fct='BCE'", r"targets in \[0, 1\]", r"2\.0"),
    ),
    Case(
        "token-labels-wrong-length",
        "token-level labels whose length differs from input_ids",
        lambda m: run(m, tok=torch.zeros(2, 4, dtype=torch.long)),
        BatchError,
        (r"token head", r"\(2, 4\)", r"expected \(2, 5\)", r"length 4 != input length 5"),
    ),
    Case(
        "sequence-labels-for-token-head",
        "one label per sequence given to a token head",
        lambda m: run(m, tok=torch.tensor([1, 2])),
        BatchError,
        (r"head 'tok'.*token head", r"expected \(2, 5\)", r"set pred_for_sequence=True"),
    ),
    Case(
        "token-labels-for-sequence-head",
        "one label per token given to a sequence head",
        lambda m: run(m, cls=torch.zeros(2, 5, dtype=torch.long)),
        BatchError,
        (r"head 'cls'.*sequence head", r"expected \(2,\)", r"token-level labels"),
    ),
    Case(
        "label-for-unknown-head",
        "a batch key that is no head's target",
        lambda m: run(m, sentiment=torch.tensor([0, 1])),
        BatchError,
        (r"unexpected batch key\(s\) \['sentiment'\]", r"targets: \['cls', 'p', 'reg', 'tok'\]"),
    ),
    Case(
        "label-dict-with-unknown-head",
        "labels={...} naming an unknown head",
        lambda m: run(m, labels={"cls": torch.tensor([0, 1]), "sentimnt": torch.tensor([0, 1])}),
        BatchError,
        (r"unexpected batch key\(s\) \['sentimnt'\]", r"targets: \['cls'"),
    ),
    Case(
        "empty-batch",
        "a batch of zero sequences",
        lambda m: run(m, input_ids=IDS[:0], attention_mask=MASK[:0]),
        BatchError,
        (r"empty or malformed batch", r"input_ids of shape \(0, 5\)", r"batch >= 1, seq >= 1"),
    ),
    Case(
        "empty-sequences",
        "sequences of length zero",
        lambda m: run(m, input_ids=IDS[:, :0], attention_mask=None),
        BatchError,
        (r"input_ids of shape \(2, 0\)", r"seq >= 1"),
    ),
    Case(
        "no-inputs",
        "neither input_ids nor inputs_embeds",
        lambda m: run(m, input_ids=None, attention_mask=None),
        BatchError,
        (r"needs input_ids or inputs_embeds",),
    ),
    Case(
        "input-ids-float",
        "input_ids of a floating dtype",
        lambda m: run(m, input_ids=IDS.float()),
        BatchError,
        (r"input_ids must hold integer ids", r"torch\.int64 or torch\.int32, got torch\.float32"),
    ),
    Case(
        "input-ids-bool",
        "input_ids of dtype bool",
        lambda m: run(m, input_ids=IDS > 7),
        BatchError,
        (r"input_ids must hold integer ids", r"got torch\.bool"),
    ),
    Case(
        "input-ids-int16",
        "input_ids of an integer dtype embeddings do not take",
        lambda m: run(m, input_ids=IDS.short()),
        BatchError,
        (r"input_ids must hold integer ids", r"got torch\.int16"),
    ),
    Case(
        "input-ids-3d",
        "3-D input_ids",
        lambda m: run(m, input_ids=IDS.unsqueeze(-1)),
        BatchError,
        (r"input_ids of shape \(2, 5, 1\)", r"expected 2-D \(batch >= 1, seq >= 1\)"),
    ),
    Case(
        "input-ids-list",
        "input_ids as a Python list",
        lambda m: run(m, input_ids=IDS.tolist()),
        BatchError,
        (r"input_ids must be a torch\.Tensor, got list", r"return_tensors='pt'"),
    ),
    Case(
        "token-id-outside-vocab",
        "a token id >= the vocabulary size",
        lambda m: run(m, input_ids=IDS + VOCAB - 10),
        BatchError,
        (rf"token id {VOCAB + 4}", rf"allowed: 0\.\.{VOCAB - 1}"),
    ),
    Case(
        "attention-mask-wrong-shape",
        "attention_mask of another shape than input_ids",
        lambda m: run(m, attention_mask=MASK[:, :3]),
        BatchError,
        (r"attention_mask of shape \(2, 3\)", r"inputs \(2, 5\)"),
    ),
    Case(
        "attention-mask-not-binary",
        "attention_mask values other than 0/1",
        lambda m: run(m, attention_mask=MASK * 2),
        BatchError,
        (r"attention_mask holds 2", r"allowed: 0 \(padding\) or 1 \(token\)"),
    ),
    Case(
        "attention-mask-list",
        "attention_mask as a Python list",
        lambda m: run(m, attention_mask=MASK.tolist()),
        BatchError,
        (r"attention_mask must be a torch\.Tensor, got list",),
    ),
    Case(
        "ids-and-embeds",
        "both input_ids and inputs_embeds",
        lambda m: run(m, inputs_embeds=torch.zeros(2, 5, HIDDEN)),
        BatchError,
        (r"input_ids or inputs_embeds, not both",),
    ),
    Case(
        "inputs-embeds-wrong-width",
        "inputs_embeds of another width than the embeddings",
        lambda m: run(m, input_ids=None, inputs_embeds=torch.zeros(2, 5, 7)),
        BatchError,
        (r"inputs_embeds of width 7", rf"embedding width {HIDDEN}"),
    ),
    Case(
        "token-type-ids-wrong-shape",
        "token_type_ids of another shape than input_ids",
        lambda m: run(m, token_type_ids=torch.zeros(2, 3, dtype=torch.long)),
        BatchError,
        (r"token_type_ids of shape \(2, 3\)", r"expected \(2, 5\)"),
    ),
    Case(
        "position-ids-wrong-shape",
        "position_ids of another length than input_ids",
        lambda m: run(m, position_ids=torch.arange(3).unsqueeze(0)),
        BatchError,
        (r"position_ids of shape \(1, 3\)", r"expected \(2, 5\) or \(1, 5\)"),
    ),
    Case(
        "sequence-too-long",
        "a sequence longer than the backbone's position table",
        lambda m: run(m, input_ids=torch.full((1, 65), 5), attention_mask=None),
        BatchError,
        (r"rejected an index", r"input shape \(1, 65\)", r"max_position_embeddings=64"),
    ),
]


@pytest.mark.parametrize("case", BATCH_CASES, ids=lambda c: c.id)
def test_batch_error(model, case: Case):
    assert_clear_error(case, model)


def test_list_and_numpy_labels_give_the_same_loss_as_tensors(model):
    """Array-like labels are accepted (converted), not rejected."""
    ref = run(model, **GOOD_LABELS).loss
    assert torch.equal(run(model, **{k: v.tolist() for k, v in GOOD_LABELS.items()}).loss, ref)
    assert torch.equal(run(model, **{k: v.numpy() for k, v in GOOD_LABELS.items()}).loss, ref)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_labels_on_another_device_are_moved_to_the_predictions():
    torch.manual_seed(0)
    gpu = HeadedModel(_backbone(), HEADS).eval().cuda()
    ref = run(gpu, input_ids=IDS.cuda(), attention_mask=MASK.cuda(), **GOOD_LABELS).loss
    on_gpu = {k: v.cuda() for k, v in GOOD_LABELS.items()}
    assert torch.allclose(
        run(gpu, input_ids=IDS.cuda(), attention_mask=MASK.cuda(), **on_gpu).loss, ref
    )


# ---------------------------------------------------------------------- checkpoint
MANIFEST = "head_configs.json"


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A saved checkpoint (heads moved off their init) and its predictions on (IDS, MASK)."""
    torch.manual_seed(1)
    m = HeadedModel(_backbone(), HEADS[:2]).eval()
    with torch.no_grad():
        for p in m.heads.parameters():
            p.add_(0.5)
    path = tmp_path_factory.mktemp("errors") / "ckpt"
    m.save_pretrained(path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the tests (single_thread), so results are bit-identical
    try:
        return path, predict(m)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def ckpt(saved, tmp_path) -> Path:
    """A fresh copy of the saved checkpoint, for a test to corrupt."""
    return Path(shutil.copytree(saved[0], tmp_path / "ckpt"))


def predict(m: HeadedModel) -> dict[str, torch.Tensor]:
    return run(m.eval()).preds_by_head


def edit_manifest(path: Path, edit: Callable[[dict], Any]) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    edit(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


def weights_file(path: Path) -> Path:
    return path / json.loads((path / MANIFEST).read_text())["weights"]


def rewrite_weights(path: Path, change: Callable[[dict], None]) -> None:
    """Change the head tensors and record the new file's checksum (a consistent forgery)."""
    file = weights_file(path)
    state = load_file(file)
    change(state)
    save_file(state, file)
    digest = hashlib.sha256(file.read_bytes()).hexdigest()
    edit_manifest(path, lambda m: m.update(weights_sha256=digest))


def truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _load(path: Path) -> HeadedModel:
    return HeadedModel.from_pretrained(path)


def _no_checksum_then_truncate(p: Path) -> None:
    edit_manifest(p, lambda m: m.pop("weights_sha256"))
    truncate(weights_file(p))


CHECKPOINT_CASES = [
    Case(
        "missing-directory",
        "a checkpoint directory that does not exist",
        lambda p: _load(p / "nope"),
        CheckpointError,
        (r"checkpoint directory '.*nope' does not exist",),
    ),
    Case(
        "missing-manifest",
        "a directory without head_configs.json",
        lambda p: ((p / MANIFEST).unlink(), _load(p)),
        CheckpointError,
        (r"head_configs\.json' is missing", r"not a headkit checkpoint"),
    ),
    Case(
        "missing-weights",
        "the heads' safetensors file is missing",
        lambda p: (weights_file(p).unlink(), _load(p)),
        CheckpointError,
        (r"weights file '.*heads-\w+\.safetensors'", r"named in head_configs\.json is missing"),
    ),
    Case(
        "truncated-weights",
        "the heads' safetensors file is truncated",
        lambda p: (truncate(weights_file(p)), _load(p)),
        CheckpointError,
        (r"heads-\w+\.safetensors' is corrupt or truncated", r"sha256 differs"),
    ),
    Case(
        # a missing checksum is refused, never read as "do not verify"
        "weights-checksum-missing",
        "head_configs.json without weights_sha256 (even before a truncated file is read)",
        lambda p: (_no_checksum_then_truncate(p), _load(p)),
        CheckpointError,
        (r"weights_sha256=None is invalid", r"cannot be verified and is refused"),
    ),
    Case(
        "weights-shape-mismatch",
        "head weights whose shape differs from head_configs.json",
        lambda p: (edit_manifest(p, lambda m: m["heads"][0].update(num_outputs=5)), _load(p)),
        CheckpointError,
        (r"tensor 'heads\.cls\.mlp\.0\.weight'", r"shape \(3, 32\)", r"describes \(5, 32\)"),
    ),
    Case(
        "weights-names-mismatch",
        "head weights for another head than head_configs.json names",
        lambda p: (edit_manifest(p, lambda m: m["heads"][0].update(name="topic")), _load(p)),
        CheckpointError,
        (
            r"do not match head_configs\.json",
            r"missing \['heads\.topic",
            r"unexpected \['heads\.cls",
        ),
    ),
    Case(
        "weights-far-too-small",
        "head_configs.json sizes far beyond the weights (never allocated)",
        lambda p: (
            edit_manifest(p, lambda m: m["heads"][0].update(num_layers=10**9, hidden_size=4)),
            _load(p),
        ),
        CheckpointError,
        (r"describes heads with at least \d{10,} parameters", r"holds 22\d values"),
    ),
    Case(
        "weights-integer-dtype",
        "a head tensor of an integer dtype",
        lambda p: (
            rewrite_weights(p, lambda s: s.update({k: v.int() for k, v in s.items()})),
            _load(p),
        ),
        CheckpointError,
        (r"tensor 'heads\.\w+\.mlp\.0\.weight' has dtype torch\.int32", r"floating-point"),
    ),
    Case(
        "weights-nan",
        "a head tensor holding NaN",
        lambda p: (
            rewrite_weights(p, lambda s: s["heads.tok.mlp.0.weight"].fill_(float("nan"))),
            _load(p),
        ),
        CheckpointError,
        (r"tensor 'heads\.tok\.mlp\.0\.weight' holds NaN or infinite values",),
    ),
    Case(
        "newer-format-version",
        "a checkpoint written by a newer format version",
        lambda p: (edit_manifest(p, lambda m: m.update(format_version=3)), _load(p)),
        CheckpointError,
        (r"format_version=3", r"newer headkit", r"reads format_version <= 2"),
    ),
    Case(
        "manifest-not-json",
        "head_configs.json that is not JSON",
        lambda p: ((p / MANIFEST).write_bytes(b"\xff{heads"), _load(p)),
        CheckpointError,
        (r"head_configs\.json' is not valid JSON",),
    ),
    Case(
        "manifest-deeply-nested",
        "head_configs.json nested beyond the recursion limit",
        lambda p: ((p / MANIFEST).write_text("[" * 100_000 + "]" * 100_000), _load(p)),
        CheckpointError,
        (r"is not valid JSON", r"recursion"),
    ),
    Case(
        "manifest-bad-head-config",
        "a head config in head_configs.json that is invalid",
        lambda p: (edit_manifest(p, lambda m: m["heads"][1].update(loss_fct="hinge")), _load(p)),
        CheckpointError,
        (r"invalid head config", r"loss_fct='hinge'", r"allowed: .*cross_entropy"),
    ),
    Case(
        "backbone-kind-unknown",
        "an unknown backbone kind",
        lambda p: (edit_manifest(p, lambda m: m["backbone"].update(kind="zip")), _load(p)),
        CheckpointError,
        (r"backbone\.kind='zip'", r"'saved' or 'reference'"),
    ),
    Case(
        "backbone-path-escapes",
        "a saved-backbone path outside the checkpoint",
        lambda p: (edit_manifest(p, lambda m: m["backbone"].update(path="..")), _load(p)),
        CheckpointError,
        (r"backbone\.path='\.\.'", r"'backbone-\*' folder in the checkpoint"),
    ),
    Case(
        "backbone-kwargs-not-allowed",
        "a referenced backbone with other from_pretrained kwargs (trust_remote_code)",
        lambda p: (
            edit_manifest(
                p,
                lambda m: m.update(
                    backbone={
                        "kind": "reference",
                        "source": str(next(p.glob("backbone-*"))),
                        "kwargs": {"trust_remote_code": True},
                    }
                ),
            ),
            _load(p),
        ),
        CheckpointError,
        (r"backbone\.kwargs=\{'trust_remote_code': True\}", r"\['gguf_file', 'revision'"),
    ),
    Case(
        "loss-weighting-invalid",
        "loss_weighting that is not a dict",
        lambda p: (edit_manifest(p, lambda m: m.update(loss_weighting=["fixed"])), _load(p)),
        CheckpointError,
        (r"loss_weighting=\['fixed'\]", r"\{\"name\": \"fixed\"\}"),
    ),
    Case(
        "loss-weighting-unknown-option",
        "loss_weighting with an option its scheme does not take",
        lambda p: (
            edit_manifest(p, lambda m: m.update(loss_weighting={"name": "fixed", "warmup": 3})),
            _load(p),
        ),
        CheckpointError,
        (r"loss_weighting=\{'name': 'fixed', 'warmup': 3\} is invalid", r"'warmup'"),
    ),
    Case(
        "backbone-weights-truncated",
        "the saved backbone's safetensors file is truncated",
        lambda p: (truncate(next(p.glob("backbone-*/model.safetensors"))), _load(p)),
        CheckpointError,
        # checked against the sha256 recorded at save time, before anything is loaded
        (
            r"backbone file '.*backbone-\w+/model\.safetensors' is corrupt or truncated",
            r"sha256 differs",
        ),
    ),
    Case(
        "head-folder-weights-mismatch",
        "load_headed(head_folder_path=...) with weights that do not fit",
        lambda p: (
            edit_manifest(p, lambda m: m["heads"][1].update(num_outputs=6)),
            load_headed(_backbone(), head_folder_path=p),
        ),
        CheckpointError,
        (r"tensor 'heads\.tok\.mlp\.0\.weight'", r"shape \(4, 32\)", r"describes \(6, 32\)"),
    ),
]


@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=lambda c: c.id)
def test_checkpoint_error(ckpt, case: Case):
    assert_clear_error(case, ckpt)


def test_the_untouched_copy_loads_with_identical_predictions(saved, ckpt):
    """The control for every checkpoint case: the copy itself is a good checkpoint."""
    for name, pred in predict(_load(ckpt)).items():
        assert torch.equal(pred, saved[1][name]), name


# ---------------------------------------------------------------------- pickle files
class _Payload:
    """Unpickling this runs a shell command that creates ``marker`` (os.system)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def plant_pickles(folder: Path, marker: Path, names: tuple[str, ...]) -> None:
    payload = pickle.dumps({"state_dict": _Payload(marker)})
    for name in names:
        (folder / name).write_bytes(payload)


def test_the_pickle_payload_is_live(tmp_path):
    """Control: unpickling the planted file does run the command, so the tests below would
    see the marker if headkit (or anything it calls) ever unpickled a file."""
    marker = tmp_path / "control"
    plant_pickles(tmp_path, marker, ("payload.bin",))
    pickle.loads((tmp_path / "payload.bin").read_bytes())
    assert marker.exists()


def test_pickle_files_next_to_a_checkpoint_are_never_loaded(saved, ckpt, tmp_path):
    marker = tmp_path / "pickle_was_executed"
    plant_pickles(ckpt, marker, ("pytorch_model.bin", "heads.bin", "heads.pt"))
    plant_pickles(next(ckpt.glob("backbone-*")), marker, ("pytorch_model.bin",))
    loaded = _load(ckpt)
    assert not marker.exists()
    for name, pred in predict(loaded).items():
        assert torch.equal(pred, saved[1][name]), name


PICKLE_ONLY = Case(
    "pickle-only-directory",
    "a directory holding only pickle files (never loaded)",
    lambda p: _load(p),
    CheckpointError,
    (r"not a headkit checkpoint", r"pickle files \['heads\.bin', 'pytorch_model\.bin'\]"),
)
PICKLE_REFERENCE = Case(
    "pickle-only-referenced-backbone",
    "a referenced backbone folder holding only a pickled pytorch_model.bin",
    lambda p: _load(p),
    CheckpointError,
    (r"the backbone folder '.*evil' holds no safetensors weights", r"\['pytorch_model\.bin'\]"),
)


def test_a_directory_of_pickle_files_is_refused_unread(tmp_path):
    folder, marker = tmp_path / "pickles", tmp_path / "pickle_was_executed"
    folder.mkdir()
    plant_pickles(folder, marker, ("pytorch_model.bin", "heads.bin"))
    assert_clear_error(PICKLE_ONLY, folder)
    assert not marker.exists()


def test_a_referenced_backbone_of_pickle_files_is_refused_unexecuted(ckpt, tmp_path):
    """A referenced folder of pickle weights is refused before anything reads them: the
    payload is never unpickled, let alone executed."""
    marker, evil = tmp_path / "pickle_was_executed", tmp_path / "evil"
    evil.mkdir()
    shutil.copy(next(ckpt.glob("backbone-*/config.json")), evil / "config.json")
    plant_pickles(evil, marker, ("pytorch_model.bin",))
    edit_manifest(ckpt, lambda m: m.update(backbone={"kind": "reference", "source": str(evil)}))
    assert_clear_error(PICKLE_REFERENCE, ckpt)
    assert not marker.exists()


ALL_CASES = CONFIG_CASES + BATCH_CASES + CHECKPOINT_CASES + [PICKLE_ONLY, PICKLE_REFERENCE]


def test_case_ids_are_unique():
    ids = [c.id for c in ALL_CASES]
    assert len(ids) == len(set(ids))
