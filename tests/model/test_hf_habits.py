"""Hugging Face habits: Trainer metrics and collators the usual way, gradient
checkpointing and the other PreTrainedModel conveniences, idle heads left alone, frozen
backbones in eval mode, Trainer robustness, datasets columns.

Real Trainer, DataCollatorWithPadding, datasets and the packaged MiniLM tokenizer; the models
are tiny random ones (a BERT with MiniLM's vocabulary, so its tokenizer fits).
"""

from __future__ import annotations

import logging
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from conftest import build_tiny
from transformers import (
    BertModel,
    DataCollatorWithPadding,
    Trainer,
    TrainingArguments,
)

from headkit import (
    BatchError,
    HeadConfig,
    HeadedCollator,
    HeadedModel,
    HeadedTrainer,
    HeadwiseMetrics,
    cache_features,
    evaluate_head_wise,
)
from headkit.packaged import rotten_tomatoes

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tokenizer(minilm_tokenizer):
    """The packaged all-MiniLM-L6-v2 tokenizer (BERT WordPiece, 30522 tokens); read-only."""
    return minilm_tokenizer


def _bert(vocab: int, dropout: float = 0.0) -> BertModel:
    """A tiny 2-block BERT with the tokenizer's vocabulary, so real text fits it."""
    return build_tiny("bert", num_layers=2, vocab_size=vocab, dropout=dropout)


@pytest.fixture(scope="module")
def reviews(tokenizer) -> datasets.Dataset:
    """24 real reviews, ``.map``-tokenised: columns text, label, input_ids, ... (as in HF docs)."""
    rows = rotten_tomatoes(24, seed=0)
    ds = datasets.Dataset.from_dict({"text": [t for t, _ in rows], "label": [y for _, y in rows]})
    return ds.map(lambda b: tokenizer(b["text"], truncation=True, max_length=24), batched=True)


def _args(out: Path, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=8,
        per_device_eval_batch_size=8,
        max_steps=3,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    return TrainingArguments(**{**base, **kw})


def accuracy(eval_pred) -> dict[str, float]:
    """The compute_metrics every Hugging Face tutorial writes."""
    logits, labels = eval_pred
    return {"accuracy": float((np.argmax(logits, -1) == labels).mean())}


def _hand_accuracy(model: HeadedModel, ds: datasets.Dataset, tokenizer) -> float:
    """Accuracy counted by hand: one forward over the whole set, argmax against the labels."""
    batch = tokenizer(
        list(ds["text"]), truncation=True, max_length=24, padding=True, return_tensors="pt"
    )
    model.eval()
    with torch.no_grad():
        preds = model(**batch).preds_by_head["sentiment"].argmax(-1)
    right = sum(int(p) == y for p, y in zip(preds, list(ds["label"])))
    return right / len(ds)


# ---------------------------------------------------------------------- (1, 2, 8) metrics
@pytest.mark.parametrize("trainer_cls", [Trainer, HeadedTrainer])
def test_one_head_compute_metrics_the_usual_way(trainer_cls, tokenizer, reviews, tmp_path):
    """A .map-tokenised datasets.Dataset with a `label` column, processing_class=tokenizer
    (Trainer: DataCollatorWithPadding renames label → labels), the usual compute_metrics."""
    head = HeadConfig("sentiment", num_outputs=2, pred_for_sequence=True, pooling="mean")
    model = HeadedModel(_bert(tokenizer.vocab_size), [head])
    trainer = trainer_cls(
        model=model,
        args=_args(tmp_path),
        train_dataset=reviews,
        eval_dataset=reviews,
        processing_class=tokenizer,
        compute_metrics=accuracy,
    )
    trainer.train()
    metrics = trainer.evaluate()
    assert metrics["eval_accuracy"] == pytest.approx(_hand_accuracy(model, reviews, tokenizer))
    pred = trainer.predict(reviews)
    assert isinstance(pred.predictions, np.ndarray) and pred.predictions.shape == (24, 2)
    assert isinstance(pred.label_ids, np.ndarray)
    assert pred.label_ids.tolist() == list(reviews["label"])


@pytest.mark.parametrize("trainer_cls", [Trainer, HeadedTrainer])
def test_several_heads_give_dicts_by_head_and_target_never_losses(trainer_cls, tmp_path):
    heads = [
        HeadConfig("sent", num_outputs=3, pred_for_sequence=True),
        HeadConfig("ner", num_outputs=4),
    ]
    model = HeadedModel(build_tiny("gpt2", num_layers=2), heads)
    g = torch.Generator().manual_seed(0)
    data = []
    for i in range(8):
        ids = torch.randint(3, 100, (3 + i % 3,), generator=g).tolist()
        data.append({"input_ids": ids, "sent": i % 3, "ner": [t % 4 for t in ids]})
    seen = {}

    def metrics(eval_pred):
        seen["predictions"], seen["label_ids"] = eval_pred.predictions, eval_pred.label_ids
        return {}

    trainer = trainer_cls(
        model=model,
        # HeadedTrainer keeps the target columns; a vanilla Trainer with several heads
        # needs remove_unused_columns=False (forward's signature lists `labels`, not targets)
        args=_args(tmp_path, remove_unused_columns=trainer_cls is HeadedTrainer),
        eval_dataset=data,
        data_collator=HeadedCollator(model),
        compute_metrics=metrics,
    )
    trainer.evaluate()
    preds, labels = seen["predictions"], seen["label_ids"]
    assert isinstance(preds, dict) and set(preds) == {"sent", "ner"}
    assert preds["sent"].shape == (8, 3) and preds["ner"].shape[::2] == (8, 4)
    assert isinstance(labels, dict) and set(labels) == {"sent", "ner"}
    assert labels["sent"].tolist() == [i % 3 for i in range(8)]


# ---------------------------------------------------------------------- (2) collators
def test_labels_tensor_is_the_one_trained_heads_label(tiny_gpt2, token_batch):
    heads = [
        HeadConfig("sent", num_outputs=3, pred_for_sequence=True),
        HeadConfig("features", num_outputs=8, pred_for_sequence=True, loss_fct=None),
    ]
    model = HeadedModel(tiny_gpt2, heads)
    y = torch.tensor([0, 2, 1])
    by_target = model(**token_batch, sent=y)
    by_labels = model(**token_batch, labels=y)
    assert torch.equal(by_labels.loss, by_target.loss)
    assert set(by_labels.loss_by_head) == {"sent"}
    assert torch.equal(by_labels.logits, by_labels.preds_by_head["sent"])
    with pytest.raises(BatchError, match=r"target 'sent' given twice"):
        model(**token_batch, labels=y, sent=y)


def test_a_labels_tensor_with_several_heads_explains_the_rename(tokenizer):
    """The issue's case: a head with target 'label' next to another; DataCollatorWithPadding
    renamed the column to 'labels'."""
    heads = [
        HeadConfig("sentiment", num_outputs=2, pred_for_sequence=True, target="label"),
        HeadConfig("topic", num_outputs=3, pred_for_sequence=True),
    ]
    model = HeadedModel(_bert(tokenizer.vocab_size), heads)
    features = [{**tokenizer(t), "label": y} for t, y in [("good", 1), ("bad film", 0)]]
    batch = DataCollatorWithPadding(tokenizer)(features)
    assert torch.is_tensor(batch["labels"]) and "label" not in batch
    with pytest.raises(BatchError) as err:
        model(**batch)
    msg = str(err.value)
    for part in (
        "batch key 'labels' holds a tensor",
        "2 heads with a loss: 'sentiment' (target 'label'), 'topic' (target 'topic')",
        "DataCollatorWithPadding",
        "renamed your 'label' column",
        "target='labels'",
        "HeadedCollator(model, tokenizer)",
    ):
        assert part in msg, part
    # fix 1: the head reads 'labels'
    fixed = HeadedModel(_bert(tokenizer.vocab_size), [heads[0].replace(target="labels"), heads[1]])
    assert set(fixed(**batch).loss_by_head) == {"sentiment"}
    # fix 2: HeadedCollator keeps the column under the head's target
    assert set(model(**HeadedCollator(model, tokenizer)(features)).loss_by_head) == {"sentiment"}


def test_headed_collator_gives_a_label_column_to_the_one_trained_head(tiny_gpt2):
    model = HeadedModel(tiny_gpt2, [HeadConfig("sent", num_outputs=3, pred_for_sequence=True)])
    batch = HeadedCollator(model)(
        [{"input_ids": [5, 6], "label": 2}, {"input_ids": [7], "label": 0}]
    )
    assert batch["labels"].tolist() == [2, 0]  # a plain tensor, as transformers' collators
    assert set(model(**batch).loss_by_head) == {"sent"}
    with pytest.raises(BatchError, match=r"features hold both 'label' and 'sent'"):
        HeadedCollator(model)([{"input_ids": [5], "label": 2, "sent": 2}])
    two = HeadedModel(tiny_gpt2, [HeadConfig("a", num_outputs=2), HeadConfig("b", num_outputs=2)])
    with pytest.raises(BatchError, match=r"'label' is neither .* only when the model has exactly"):
        HeadedCollator(two)([{"input_ids": [5], "label": 1}])


# ---------------------------------------------------------------------- (3) checkpointing
def _grads(model: HeadedModel) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layer_hook", [2, -1])  # early exit (a private exception) or not
@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_gives_the_same_gradients(layer_hook, reentrant, token_batch):
    grads = []
    for checkpointing in (False, True):
        head = HeadConfig("p", layer_hook=layer_hook, num_outputs=3, pred_for_sequence=True)
        model = HeadedModel(build_tiny("gpt2", num_layers=4), [head], freeze_base_model=False)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable({"use_reentrant": reentrant})
            assert model.is_gradient_checkpointing and model.is_activation_checkpointing
        model(**token_batch, p=torch.tensor([0, 1, 2])).loss.backward()
        grads.append(_grads(model))
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys()
    assert any(k.startswith("backbone.") for k in plain)  # the backbone trains
    for k in plain:
        torch.testing.assert_close(checkpointed[k], plain[k], rtol=1e-5, atol=1e-7)


def test_checkpointing_a_frozen_backbone_trains_the_heads_only(tiny_gpt2, token_batch):
    model = HeadedModel(tiny_gpt2, [HeadConfig("p", num_outputs=3, pred_for_sequence=True)])
    model.gradient_checkpointing_enable()
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda m, a, o: seen.append(o.requires_grad))
    model.train()(**token_batch, p=torch.tensor([0, 1, 2])).loss.backward()
    assert seen == [False]  # no graph through a frozen backbone
    assert all(p.grad is not None for p in model.heads.parameters())
    model.gradient_checkpointing_disable()
    assert not model.is_gradient_checkpointing
    model.enable_input_require_grads()  # transformers' habit for adapters: now it does
    model.get_input_embeddings().register_forward_hook(lambda m, a, o: seen.append(o.requires_grad))
    model(**token_batch)
    assert seen[-1] is True
    model.disable_input_require_grads()


def _cls_data(n: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        ids = torch.randint(3, 100, (4 + i % 3,), generator=g).tolist()
        out.append({"input_ids": ids, "sent": ids[0] % 3})
    return out


@pytest.mark.parametrize("trainer_cls", [Trainer, HeadedTrainer])
def test_training_arguments_gradient_checkpointing_end_to_end(trainer_cls, tmp_path):
    head = HeadConfig("sent", num_outputs=3, pred_for_sequence=True)
    model = HeadedModel(build_tiny("gpt2", num_layers=2), [head], freeze_base_model=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = _args(tmp_path, gradient_checkpointing=True, max_steps=8, learning_rate=5e-3)
    # one head: its labels in a `label` column, which a vanilla Trainer keeps
    data = [{"input_ids": ex["input_ids"], "label": ex["sent"]} for ex in _cls_data()]
    trainer = trainer_cls(
        model=model, args=args, train_dataset=data, data_collator=HeadedCollator(model)
    )
    trainer.train()
    assert model.is_gradient_checkpointing
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert np.mean(losses[-2:]) < np.mean(losses[:2])  # the loss goes down
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert {n for n in before if n.startswith("heads.")} <= moved
    assert any(n.startswith("backbone.h.0.") for n in moved)  # the backbone trained too


# ---------------------------------------------------------------------- (3) conveniences
def test_parameter_counts_dtype_and_embeddings(tiny_gpt2, capsys):
    model = HeadedModel(tiny_gpt2, [HeadConfig("p", num_outputs=3, pred_for_sequence=True)])
    total = sum(p.numel() for p in model.parameters())
    heads = sum(p.numel() for p in model.heads.parameters())
    embeddings = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    assert model.num_parameters() == total
    assert model.num_parameters(only_trainable=True) == heads == 32 * 3  # one Linear, no bias
    assert model.num_parameters(exclude_embeddings=True) == total - embeddings
    assert model.get_nb_trainable_parameters() == (heads, total)
    model.print_trainable_parameters()
    share = 100 * heads / total
    assert capsys.readouterr().out.strip() == (
        f"trainable params: {heads:,d} || all params: {total:,d} || trainable%: {share:.4f}"
    )
    assert model.dtype == torch.float32
    assert model.get_input_embeddings() is tiny_gpt2.transformer.wte


@pytest.mark.parametrize("new_size", [110, 90])
def test_resize_token_embeddings_takes_the_lm_head_along(new_size, token_batch, tmp_path):
    heads = [HeadConfig("lm_head", is_causal_lm=True), HeadConfig("tag", num_outputs=5)]
    model = HeadedModel(build_tiny("gpt2"), heads)
    old = model.heads["lm_head"].linears[0].weight.detach().clone()
    tag = model.heads["tag"].linears[0].weight.detach().clone()
    emb = model.resize_token_embeddings(new_size)
    assert emb.weight.shape == (new_size, 32) and model.info.vocab_size == new_size
    lin = model.heads["lm_head"].linears[0]
    assert lin.weight.shape == (new_size, 32) and lin.out_features == new_size
    keep = min(new_size, 100)
    assert torch.equal(lin.weight[:keep], old[:keep])  # the old rows stay
    assert torch.isfinite(lin.weight).all()
    assert torch.equal(model.heads["tag"].linears[0].weight, tag)  # other heads untouched
    assert model.head_configs["lm_head"].num_outputs == new_size
    assert model.heads["lm_head"].config.num_outputs == new_size
    ids = token_batch["input_ids"] % keep
    out = model(input_ids=ids, lm_head=ids)
    assert out.preds_by_head["lm_head"].shape == (3, 8, new_size)
    model.save_pretrained(tmp_path / "ckpt")  # the checkpoint stays consistent
    again = HeadedModel.from_pretrained(tmp_path / "ckpt")
    assert again.head_configs["lm_head"].num_outputs == new_size
    torch.testing.assert_close(
        again(input_ids=ids).preds_by_head["lm_head"],
        model.eval()(input_ids=ids).preds_by_head["lm_head"],
    )


# ---------------------------------------------------------------------- (4) idle heads
def test_a_head_without_labels_is_not_moved_by_adamw_weight_decay():
    heads = [
        HeadConfig("sent", num_outputs=3, pred_for_sequence=True),
        HeadConfig("aux", num_outputs=2, pred_for_sequence=True),
    ]
    model = HeadedModel(build_tiny("gpt2", num_layers=2), heads, loss_weighting="uncertainty")
    idle = {k: v.detach().clone() for k, v in model.head_state_dict().items() if "aux" in k}
    trained = model.heads["sent"].linears[0].weight.detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], weight_decay=0.1)
    model.train()
    batch = HeadedCollator(model)(_cls_data(8))
    for _ in range(20):
        opt.zero_grad()
        model(**batch).loss.backward()
        opt.step()
    after = model.head_state_dict()
    for k, v in idle.items():
        assert torch.equal(after[k], v), k  # bit-identical, its log-variance included
    assert not torch.equal(model.heads["sent"].linears[0].weight, trained)


# ---------------------------------------------------------------------- (5) eval mode
def test_a_frozen_backbone_is_in_eval_mode_from_construction(tokenizer):
    backbone = _bert(tokenizer.vocab_size, dropout=0.3).train()  # as built from a config
    model = HeadedModel(backbone, [HeadConfig("p", num_outputs=2, pred_for_sequence=True)])
    assert not model.backbone.training
    batch = tokenizer(["a gorgeous, witty film", "dull"], padding=True, return_tensors="pt")
    first, second = (model(**batch).preds_by_head["p"] for _ in range(2))
    assert torch.equal(first, second)


# ---------------------------------------------------------------------- (6) robustness
def test_a_batch_whose_every_loss_is_skipped_is_skipped(tmp_path, caplog):
    head = HeadConfig("score", pred_for_sequence=True, is_regression=True, loss_fct="mse")
    model = HeadedModel(build_tiny("gpt2", num_layers=2), [head], nonfinite_loss="skip")
    data = [{"input_ids": [5 + i, 6, 7], "score": 1e30 if i < 4 else i / 8} for i in range(8)]
    before = model.heads["score"].linears[0].weight.detach().clone()
    # in order: every loss of the first batch overflows, the second batch trains
    args = _args(
        tmp_path, per_device_train_batch_size=4, max_steps=2, train_sampling_strategy="sequential"
    )
    trainer = HeadedTrainer(model=model, args=args, train_dataset=data)
    with caplog.at_level(logging.WARNING), pytest.warns(UserWarning, match="non-finite loss"):
        trainer.train()
    assert trainer.state.global_step == 2 and trainer.skipped_batches == 1
    assert "batch is skipped" in caplog.text
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert logged[-1]["skipped_batches"] == 1
    assert not torch.equal(model.heads["score"].linears[0].weight, before)  # batch 2 trained


def test_headwise_metrics_skips_heads_without_a_loss_or_labels(tmp_path):
    heads = [
        HeadConfig("sent", num_outputs=3, pred_for_sequence=True),
        HeadConfig("features", num_outputs=8, pred_for_sequence=True, loss_fct=None),
        HeadConfig("other", num_outputs=2, pred_for_sequence=True),
    ]
    model = HeadedModel(build_tiny("gpt2", num_layers=2), heads)
    data = [{**ex, "features": [0.5] * 8} for ex in _cls_data(8)]  # "other": no labels
    trainer = HeadedTrainer(
        model=model, args=_args(tmp_path), eval_dataset=data, compute_metrics=HeadwiseMetrics(model)
    )
    metrics = trainer.evaluate()
    assert {"eval_sent_accuracy", "eval_sent_macro_f1"} <= set(metrics)
    assert not any(k.startswith(("eval_features_", "eval_other_")) for k in metrics)


# ---------------------------------------------------------------------- (8) datasets
def test_unused_columns_are_dropped_and_named(tokenizer, reviews, caplog):
    head = HeadConfig("sentiment", num_outputs=2, pred_for_sequence=True, target="label")
    model = HeadedModel(_bert(tokenizer.vocab_size), [head])
    collate = HeadedCollator(model, tokenizer)
    with pytest.raises(BatchError, match=r"'text' is neither a model input"):
        collate([reviews[0]])  # the collator itself still refuses unknown keys
    with caplog.at_level(logging.WARNING, logger="headkit"):
        feats = cache_features(model, reviews, batch_size=8, collate_fn=collate, progress=False)
        results = evaluate_head_wise(model, reviews, collate, progress=False)
        listed = evaluate_head_wise(model, list(reviews), collate, progress=False)
    assert len(feats) == 24 and feats.labels["label"].tolist() == list(reviews["label"])
    assert results == listed and set(results) == {"sentiment"}
    dropped = [r.getMessage() for r in caplog.records if "ignoring column(s)" in r.getMessage()]
    assert len(dropped) == 3 and all("['text']" in m for m in dropped)
    assert dropped[0].startswith("cache_features:")
