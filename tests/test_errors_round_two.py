"""Bad input that could pass unnoticed: every input that might give a silent wrong number or
an internal exception either works as documented or gets a headkit error naming the field,
the value and what is allowed. One row of docs/errors.md per case below; the case id is the
row.

Cases follow tests/test_errors.py: each builds the bad input, names the error type and lists
regexes that must all match the message. What is *accepted* (heads named like module
attributes, NumPy scalars, one HeadConfig for a list, float64 embeddings) has its own tests.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from conftest import HIDDEN, build_tiny
from test_errors import Case, assert_clear_error
from transformers import TrainingArguments

from headkit import (
    BatchError,
    CheckpointError,
    ConfigError,
    HeadConfig,
    HeadedCollator,
    HeadedModel,
    HeadedTrainer,
    HeadwiseMetrics,
    NonFiniteLossError,
    evaluate_head_wise,
)

pytestmark = pytest.mark.usefixtures("single_thread")

IDS = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
SEQ = {"num_outputs": 3, "pred_for_sequence": True}


def _gpt2(*heads: HeadConfig, **kwargs: Any) -> HeadedModel:
    return HeadedModel(build_tiny("gpt2", num_layers=2), list(heads), **kwargs)


def _bert(*heads: HeadConfig) -> HeadedModel:
    return HeadedModel(build_tiny("bert", num_layers=2), list(heads) or [HeadConfig("t")])


def _roberta() -> HeadedModel:
    """RoBERTa numbers positions from padding_idx + 1: at most 64 tokens."""
    return HeadedModel(build_tiny("roberta", num_layers=2), [HeadConfig("t")])


def _with_loss_free_head(**kwargs: Any) -> HeadedModel:
    heads = [HeadConfig("cls", **SEQ), HeadConfig("emb", **SEQ, loss_fct=None)]
    return _gpt2(*heads, **kwargs)


def _huge_weights(**kwargs: Any) -> HeadedModel:
    """Two heads whose finite losses times loss_weight=1e308 sum to inf."""
    heads = [HeadConfig(n, **SEQ, loss_weight=1e308) for n in ("a", "b")]
    return _gpt2(*heads, **kwargs)


def _two_labels(m: HeadedModel) -> Any:
    return m(input_ids=IDS, a=torch.tensor([0, 1]), b=torch.tensor([2, 0]))


TOKEN_ROWS = [{"input_ids": [5, 6, 7], "t": [1, 2, 3]}, {"input_ids": [5], "t": [1]}]

# ---------------------------------------------------------------------- config
CONFIG_CASES = [
    Case(
        "extra-not-json",
        "`extra` holding a value JSON cannot hold (refused when the config is built)",
        lambda: HeadConfig("h", extra={"when": object()}),
        ConfigError,
        (r"extra\['when'\]=<object object", r"expected JSON values \(None, bool, int, .*object"),
    ),
    Case(
        "extra-key-not-string",
        "`extra` with a non-string key (JSON would turn it into a string)",
        lambda: HeadConfig("h", extra={1: "one"}),
        ConfigError,
        (r"extra key=1 is invalid", r"dict keys are strings"),
    ),
    Case(
        "extra-not-finite",
        "`extra` holding NaN or infinity (not JSON)",
        lambda: HeadConfig("h", extra={"threshold": math.nan}),
        ConfigError,
        (r"extra\['threshold'\]=nan", r"finite numbers"),
    ),
    Case(
        "integer-beyond-int64",
        "a size or index beyond what a tensor can have (num_outputs=10**30)",
        lambda: HeadConfig("h", num_outputs=10**30),
        ConfigError,
        (r"num_outputs=1000000000000000000000000000000", r"within \+-2\*\*63"),
    ),
    Case(
        "from-json-5001-digit-integer",
        "HeadConfig.from_json with a 5,001-digit integer",
        lambda: HeadConfig.from_json('{"name": "h", "num_outputs": ' + "1" * 5001 + "}"),
        ConfigError,
        (r"HeadConfig.from_json: not valid JSON", r"5001 digits"),
    ),
    Case(
        "head-over-parameter-budget",
        "a head larger than max_head_parameters (num_outputs=10**12), refused before allocating",
        lambda: _gpt2(HeadConfig("h", num_outputs=10**12)),
        ConfigError,
        (
            r"\(name='h'\): num_outputs=1000000000000 makes a head of 32,000,000,000,000 ",
            r"max_head_parameters=2,147,483,648",
        ),
    ),
    Case(
        "head-over-custom-budget",
        "a head larger than a stated max_head_parameters",
        lambda: _gpt2(
            HeadConfig("h", num_outputs=10, num_layers=2, hidden_size=8), max_head_parameters=100
        ),
        ConfigError,
        (r"makes a head of 344 parameters", r"hidden_size=8", r"max_head_parameters=100"),
    ),
    Case(
        "max-head-parameters-invalid",
        "max_head_parameters that is not a positive integer or None",
        lambda: _gpt2(HeadConfig("h"), max_head_parameters=0),
        ConfigError,
        (r"max_head_parameters=0 is invalid", r"positive integer, or None"),
    ),
    Case(
        "target-self",
        "target='self' (forward's own first parameter)",
        lambda: _gpt2(HeadConfig("h", target="self")),
        ConfigError,
        (r"target='self' collides", r"reserved: .*self"),
    ),
]


@pytest.mark.parametrize("case", CONFIG_CASES, ids=lambda c: c.id)
def test_config_error(case: Case):
    assert_clear_error(case)


# ---------------------------------------------------------------------- batch
BATCH_CASES = [
    Case(
        "same-target-twice",
        "one target given both in labels={...} and as a keyword",
        lambda: _gpt2(HeadConfig("a", **SEQ))(
            input_ids=IDS, labels={"a": torch.tensor([0, 1])}, a=torch.tensor([2, 0])
        ),
        BatchError,
        (r"target\(s\) \['a'\] given twice", r"pass each label once"),
    ),
    Case(
        "label-for-loss-free-head",
        "a label only heads with loss_fct=None read (it would be ignored)",
        lambda: _with_loss_free_head()(input_ids=IDS, emb=torch.tensor([0, 1])),
        BatchError,
        (
            r"target\(s\) \['emb'\] would be ignored",
            r"head\(s\) \['emb'\] read them, and they have loss_fct=None",
            r"allow_unused_labels=True",
        ),
    ),
    Case(
        "string-label-for-loss-free-head",
        "a string label for a head with loss_fct=None",
        lambda: _with_loss_free_head()(input_ids=IDS, emb="positive"),
        BatchError,
        (r"\['emb'\] would be ignored",),
    ),
    Case(
        "nonfinite-total-loss",
        "finite head losses whose weighted total is inf (loss_weight=1e308 on two heads)",
        lambda: _two_labels(_huge_weights()),
        NonFiniteLossError,
        (r"total loss of heads \['a', 'b'\] is non-finite \(inf\)", r"loss_weight"),
    ),
    Case(
        "bert-sequence-too-long",
        "BERT with a sequence longer than max_position_embeddings (before the backbone runs)",
        lambda: _bert()(input_ids=torch.full((1, 65), 5)),
        BatchError,
        (
            r"the sequence reaches position 64",
            r"position table of BertModel \(max_position_embeddings=64\)",
            r"input shape \(1, 65\)",
            r"at most 64 positions",
        ),
    ),
    Case(
        "bert-position-ids-out-of-range",
        "BERT with position_ids=64 (the table has 64 rows)",
        lambda: _bert()(input_ids=IDS[:1], position_ids=torch.tensor([[0, 1, 2, 64]])),
        BatchError,
        (r"position_ids holds 64", r"BertModel", r"must lie in 0\.\.63"),
    ),
    Case(
        "position-ids-negative",
        "a negative position id",
        lambda: _gpt2(HeadConfig("t"))(
            input_ids=IDS[:1], position_ids=torch.tensor([[-1, 0, 1, 2]])
        ),
        BatchError,
        (r"position_ids holds -1", r"GPT2Model \(max_position_embeddings=64\)", r"0\.\.63"),
    ),
    Case(
        "roberta-sequence-too-long",
        "RoBERTa with more tokens than its offset position table holds",
        lambda: _roberta()(input_ids=torch.full((1, 65), 5), attention_mask=torch.ones(1, 65)),
        BatchError,
        (
            r"the attention_mask numbers a token 66",
            r"RobertaModel \(max_position_embeddings=66\)",
            r"at most 64 positions",
        ),
    ),
    Case(
        "token-type-id-out-of-range",
        "BERT with token_type_ids beyond type_vocab_size",
        lambda: _bert()(input_ids=IDS, token_type_ids=torch.full_like(IDS, 2)),
        BatchError,
        (r"token_type_ids holds 2", r"allowed: 0\.\.1 \(type_vocab_size=2\)"),
    ),
    Case(
        "inputs-embeds-overflow-backbone-dtype",
        "inputs_embeds whose values overflow the backbone's dtype when cast",
        lambda: _gpt2(HeadConfig("t"))(
            inputs_embeds=torch.full((1, 3, HIDDEN), 1e300, dtype=torch.float64)
        ),
        BatchError,
        (r"inputs_embeds of dtype torch.float64 hold 1e\+300", r"backbone's dtype torch.float32"),
    ),
]


@pytest.mark.parametrize("case", BATCH_CASES, ids=lambda c: c.id)
def test_batch_error(case: Case):
    assert_clear_error(case)


# ---------------------------------------------------------------------- checkpoint paths
CHECKPOINT_CASES = [
    Case(
        "from-pretrained-none",
        "HeadedModel.from_pretrained(None)",
        lambda: HeadedModel.from_pretrained(None),
        CheckpointError,
        (r"checkpoint_dir=None is a NoneType", r"expected a folder path \(str or os.PathLike\)"),
    ),
    Case(
        "from-pretrained-bytes",
        "HeadedModel.from_pretrained(b'...')",
        lambda: HeadedModel.from_pretrained(b"/tmp/ckpt"),
        CheckpointError,
        (r"checkpoint_dir=b'/tmp/ckpt' is a bytes", r"str or os.PathLike"),
    ),
]


@pytest.mark.parametrize("case", CHECKPOINT_CASES, ids=lambda c: c.id)
def test_checkpoint_path_error(case: Case):
    assert_clear_error(case)


# ---------------------------------------------------------------------- collator
COLLATOR_CASES = [
    Case(
        "collator-empty-input-ids",
        "an example with input_ids=[]",
        lambda: HeadedCollator()([{"input_ids": [5, 6]}, {"input_ids": []}]),
        BatchError,
        (r"feature 1 has input_ids empty \(\[\]\)", r"at least one token id"),
    ),
    Case(
        "collator-input-ids-string",
        "input_ids given as text",
        lambda: HeadedCollator()([{"input_ids": "hello"}]),
        BatchError,
        (r"feature 0 has input_ids='hello' \(str\)", r"tokenize the text first"),
    ),
    Case(
        "collator-input-ids-of-strings",
        "input_ids holding strings",
        lambda: HeadedCollator()([{"input_ids": ["he", "llo"]}]),
        BatchError,
        (r"feature 0 has input_ids holding <U3 values", r"1-D list of integers"),
    ),
    Case(
        "collator-label-pad-nan",
        "label_pad_value=nan",
        lambda: HeadedCollator(label_pad_value=math.nan),
        ConfigError,
        (r"label_pad_value=nan is invalid", r"a finite number \(default -100"),
    ),
    Case(
        "collator-label-pad-string",
        "label_pad_value='x'",
        lambda: HeadedCollator(label_pad_value="x"),
        ConfigError,
        (r"label_pad_value='x' is invalid",),
    ),
    Case(
        "collator-label-pad-none",
        "label_pad_value=None",
        lambda: HeadedCollator(label_pad_value=None),
        ConfigError,
        (r"label_pad_value=None is invalid",),
    ),
    Case(
        "collator-label-pad-by-target-invalid",
        "a per-target label_pad_value that is not a finite number",
        lambda: HeadedCollator(label_pad_value={"t": math.inf}),
        ConfigError,
        (r"label_pad_value\['t'\]=inf is invalid",),
    ),
    Case(
        "collator-features-generator",
        "features given as a generator",
        lambda: HeadedCollator()(dict(r) for r in TOKEN_ROWS),
        BatchError,
        (r"features must be a list of feature dicts, got generator", r"list\(\.\.\.\)"),
    ),
    Case(
        "collator-one-feature-dict",
        "one example (a dict) given instead of a list",
        lambda: HeadedCollator()(TOKEN_ROWS[0]),
        BatchError,
        (r"got dict \(one example\? wrap it in a list\)",),
    ),
    Case(
        "collator-labels-key-invalid",
        "labels_key that is not a non-empty string or None",
        lambda: HeadedCollator(labels_key=""),
        ConfigError,
        (r"labels_key='' is invalid", r"or None"),
    ),
    Case(
        "collator-token-targets-string",
        "token_targets given as one string",
        lambda: HeadedCollator(token_targets="tags"),
        ConfigError,
        (r"token_targets='tags' is invalid", r"\['tags'\]"),
    ),
]


@pytest.mark.parametrize("case", COLLATOR_CASES, ids=lambda c: c.id)
def test_collator_error(case: Case):
    assert_clear_error(case)


def test_case_ids_are_unique():
    ids = [c.id for c in CONFIG_CASES + BATCH_CASES + CHECKPOINT_CASES + COLLATOR_CASES]
    assert len(ids) == len(set(ids))


# ---------------------------------------------------------------------- what is accepted
ATTRIBUTE_NAMES = (
    "type", "values", "keys", "items", "update", "pop", "to", "cuda", "forward", "training",
    "state_dict", "_modules", "heads",
)  # fmt: skip


def test_heads_named_like_module_attributes_work_and_round_trip(tmp_path):
    heads = [HeadConfig(n, **SEQ) for n in ATTRIBUTE_NAMES]
    model = _gpt2(*heads)
    labels = {n: torch.tensor([0, 2]) for n in ATTRIBUTE_NAMES}
    out = model(input_ids=IDS, **labels)
    assert set(out.loss_by_head) == set(ATTRIBUTE_NAMES)
    assert {k.split(".")[1] for k in model.head_state_dict() if k.startswith("heads.")} == set(
        ATTRIBUTE_NAMES
    )
    for n in ATTRIBUTE_NAMES:
        assert model.get_submodule(f"heads.{n}") is model.heads[n]
    assert callable(model.heads.keys) and model.heads.training is model.training
    model.save_pretrained(tmp_path)
    again = HeadedModel.from_pretrained(tmp_path)
    with torch.no_grad():
        want, got = model(input_ids=IDS).preds_by_head, again(input_ids=IDS).preds_by_head
    assert all(torch.equal(want[n], got[n]) for n in ATTRIBUTE_NAMES)


def test_numpy_scalars_are_stored_as_python_numbers_and_saved(tmp_path):
    cfg = HeadConfig(
        "h",
        num_outputs=np.int64(3),
        layer_hook=np.int32(-1),
        loss_weight=np.float32(0.5),
        pred_for_sequence=np.bool_(True),
        extra={"seed": np.int64(7), "scale": np.float64(0.25), "dims": (np.int8(1), 2)},
    )
    assert type(cfg.num_outputs) is int and type(cfg.layer_hook) is int
    assert type(cfg.loss_weight) is float and cfg.pred_for_sequence is True
    assert cfg.extra == {"seed": 7, "scale": 0.25, "dims": [1, 2]}
    assert type(cfg.extra["seed"]) is int
    model = _gpt2(cfg)
    model.save_pretrained(tmp_path)
    assert HeadedModel.from_pretrained(tmp_path).head_configs["h"] == model.head_configs["h"]


def test_one_head_config_is_taken_as_a_list_of_one():
    model = HeadedModel(build_tiny("gpt2", num_layers=2), HeadConfig("h", **SEQ))
    assert list(model.head_configs) == ["h"]
    from_dict = HeadedModel(build_tiny("gpt2", num_layers=2), {"name": "h", **SEQ})
    assert list(from_dict.head_configs) == ["h"]


def test_float64_inputs_embeds_are_cast_to_the_backbone_dtype():
    model = _gpt2(HeadConfig("t", num_outputs=3)).eval()
    embeds = torch.randn(2, 4, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(inputs_embeds=embeds).preds_by_head["t"]
        got = model(inputs_embeds=embeds.double()).preds_by_head["t"]
    assert torch.equal(got, want)


def test_a_too_long_sequence_is_refused_before_the_backbone_runs():
    model = _bert()
    calls = []
    model.backbone.embeddings.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(BatchError):
        model(input_ids=torch.full((1, 65), 5))
    assert not calls
    model(input_ids=torch.full((1, 64), 5))  # exactly the table: fine
    assert calls


def test_rotary_positions_have_no_table_to_outgrow():
    """Llama's max_position_embeddings is no hard limit (rotary): 70 tokens run."""
    model = HeadedModel(build_tiny("llama", num_layers=1), [HeadConfig("t")])
    assert model(input_ids=torch.full((1, 70), 5)).preds_by_head["t"].shape == (1, 70, 1)


def test_nonfinite_total_loss_skip_gives_no_loss_in_eval_and_in_training():
    model = _huge_weights(nonfinite_loss="skip").eval()
    with pytest.warns(UserWarning, match=r"heads \['a', 'b'\]: non-finite total loss"):
        assert _two_labels(model).loss is None
    model.train()
    with pytest.warns(UserWarning, match=r"step skipped"):
        out = _two_labels(model)
    # no loss, so nothing (not even weight decay) moves: HeadedTrainer skips such batches
    assert out.loss is None and set(out.loss_by_head) == {"a", "b"}


def test_allow_unused_labels_lets_labels_of_loss_free_heads_through():
    model = _with_loss_free_head(allow_unused_labels=True)
    out = model(input_ids=IDS, cls=torch.tensor([0, 1]), emb=torch.tensor([1, 1]))
    assert set(out.loss_by_head) == {"cls"}


def _eval_rows() -> list[dict]:
    return [
        {"input_ids": [5, 6, 7][: 1 + i % 3], "cls": i % 3, "emb": (i + 1) % 3} for i in range(6)
    ]


def test_evaluation_scores_loss_free_heads_from_their_labels():
    """Metrics still read a loss-free head's labels; the model call leaves them out."""
    model = _with_loss_free_head()
    results = evaluate_head_wise(model, _eval_rows(), batch_size=4, progress=False)
    assert set(results) == {"cls", "emb"}
    assert "loss" in results["cls"] and "loss" not in results["emb"]
    assert set(results["emb"]) == {"accuracy", "macro_f1"}


def test_headed_trainer_evaluates_loss_free_heads(tmp_path):
    # two trained heads, so EvalPrediction holds dicts by head (one trained head gives that
    # head's plain arrays, the usual compute_metrics form)
    heads = [HeadConfig("cls", **SEQ), HeadConfig("cls2", **SEQ, target="cls")]
    model = _gpt2(*heads, HeadConfig("emb", **SEQ, loss_fct=None))
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to=[], use_cpu=True
    )
    trainer = HeadedTrainer(
        model=model, args=args, eval_dataset=_eval_rows(), compute_metrics=HeadwiseMetrics(model)
    )
    metrics = trainer.evaluate()  # the loss-free head's labels do not reach the model call
    assert "eval_cls2_accuracy" in metrics and "eval_cls_loss" in metrics
    # HeadwiseMetrics scores heads that learn; evaluate_head_wise scores all
    assert not any(k.startswith("eval_emb_") for k in metrics)


def test_collator_makes_no_label_a_batch_does_not_have():
    model = _with_loss_free_head()
    batch = HeadedCollator(model)([{"input_ids": [5, 6], "cls": 1}, {"input_ids": [7], "cls": 0}])
    # the one trained head's labels, as a plain tensor; nothing for the loss-free "emb"
    assert torch.equal(batch["labels"], torch.tensor([1, 0])) and "emb" not in batch
    model(**batch)  # and the model accepts it
