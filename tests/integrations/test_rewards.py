"""Reward models with HeadedTrainer, side by side with TRL's RewardTrainer and PRMTrainer.

The same tiny model (identical weights), the same pairs and the same budget: the loss of
each step's batch equals TRL's, and the held-out pairwise accuracy is within 0.02 of it.
"""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch
from conftest import build_tiny
from datasets import Dataset
from tiny_text import WORDS, tiny_tokenizer
from transformers import TrainingArguments
from trl import RewardConfig, RewardTrainer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # PRMTrainer lives in trl.experimental
from trl.experimental.prm import PRMConfig, PRMTrainer  # noqa: E402

import headkit
from headkit import HeadConfig, HeadedModel, HeadedTrainer
from headkit.data.preferences import PreferenceCollator, tokenize_preferences
from headkit.data.stepwise import step_end_scores, step_scores, tokenize_steps
from headkit.errors import BatchError, ConfigError
from headkit.metrics import HeadwiseMetrics, evaluate_head_wise

ARGS = dict(
    per_device_train_batch_size=8,
    per_device_eval_batch_size=16,
    learning_rate=1e-3,
    report_to=[],
    save_strategy="no",
    seed=0,
    use_cpu=True,
    disable_tqdm=True,
)


def sentence(rng: random.Random, extra: str | None = None) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
    if extra:
        words.insert(rng.randrange(len(words) + 1), extra)
    return " ".join(words)


def pairs(n: int, seed: int, margin: bool = False) -> Dataset:
    """Chosen texts carry the word "good", rejected ones do not."""
    rng = random.Random(seed)
    rows = [{"chosen": sentence(rng, "good"), "rejected": sentence(rng)} for _ in range(n)]
    if margin:
        for r in rows:
            r["margin"] = rng.choice([0.0, 0.5, 1.0])
    return Dataset.from_list(rows)


def tokenizer():
    tok = tiny_tokenizer()
    tok.eos_token = "[SEP]"  # TRL appends the eos to every text
    return tok


def twin_reward_models(center: float | None = None):
    """TRL's BertForSequenceClassification(num_labels=1) and a HeadedModel with the same
    weights: its backbone, and a head that is its pooler + classifier."""
    ref = build_tiny("bert", 2, task="sequence-classification", dropout=0.0, num_labels=1)
    head = HeadConfig(
        "reward",
        pred_for_sequence=True,
        loss_fct="bradley_terry",
        pooling="pooler",
        output_bias=True,
        center_rewards_coefficient=center,
    )
    ours = HeadedModel(copy.deepcopy(ref.bert), [head], freeze_base_model=False)
    with torch.no_grad():
        ours.heads["reward"].output_projection().weight.copy_(ref.classifier.weight)
        ours.heads["reward"].output_projection().bias.copy_(ref.classifier.bias)
    return ref, ours


def test_orm_matches_reward_trainer_step_by_step_and_on_held_out_pairs(tmp_path):
    # 60 held-out pairs in batches of 16: accelerate cuts the last batch to 12 examples
    train, test = pairs(96, 0, margin=True), pairs(60, 1)
    ref, ours = twin_reward_models(center=0.01)
    tok = tokenizer()
    args = dict(ARGS, output_dir=str(tmp_path), max_steps=24)
    theirs_t = RewardTrainer(
        ref,
        RewardConfig(**args, center_rewards_coefficient=0.01),
        train_dataset=train,
        eval_dataset=test,
        processing_class=tok,
    )
    ours_t = HeadedTrainer(
        ours,
        TrainingArguments(**args),
        train_dataset=train,
        eval_dataset=test,
        processing_class=tok,
        compute_metrics=HeadwiseMetrics(ours),
    )
    # the same batches, and TRL's loss formula on them (margin and centering included)
    ref.train(), ours.train()
    for a, b, _ in zip(ours_t.get_train_dataloader(), theirs_t.get_train_dataloader(), range(4)):
        assert torch.equal(a["input_ids"], b["input_ids"])
        torch.testing.assert_close(
            ours_t.compute_loss(ours, dict(a)),
            theirs_t.compute_loss(ref, dict(b)),
            atol=1e-6,
            rtol=0,
        )
    ours_t.train()
    theirs_t.train()
    acc = ours_t.evaluate()["eval_reward_pairwise_accuracy"]
    trl_acc = theirs_t.evaluate()["eval_accuracy"]
    assert abs(acc - trl_acc) <= 0.02
    assert acc > 0.75  # it learnt the planted preference
    # every held-out pair counted, whole: the same as evaluating them in one go
    whole = evaluate_head_wise(
        ours,
        tokenize_preferences(test, tok, ours.head_configs),
        PreferenceCollator(ours),
        batch_size=60,
        progress=False,
    )
    assert acc == pytest.approx(whole["reward"]["pairwise_accuracy"], abs=1e-12)


def test_texts_and_conversations_are_tokenised_as_reward_trainer_does(tmp_path):
    tok = tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} [SEP] {% endfor %}"
    rng = random.Random(3)
    texts = Dataset.from_list(
        [
            {"prompt": sentence(rng), "chosen": sentence(rng), "rejected": sentence(rng)}
            for _ in range(6)
        ]
    )
    chats = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": sentence(rng)}],
                "chosen": [{"role": "assistant", "content": sentence(rng)}],
                "rejected": [{"role": "assistant", "content": sentence(rng)}],
            }
            for _ in range(6)
        ]
    )
    ref, ours = twin_reward_models()
    for data in (texts, chats):
        trl_data = RewardTrainer(
            ref,
            RewardConfig(str(tmp_path), report_to=[], use_cpu=True),
            train_dataset=data,
            processing_class=tok,
        ).train_dataset
        mine = tokenize_preferences(data, tok, ours.head_configs)
        assert mine["chosen_ids"] == trl_data["chosen_ids"]
        assert mine["rejected_ids"] == trl_data["rejected_ids"]


def test_pretokenised_columns_of_every_trl_version_batch_alike():
    _, ours = twin_reward_models()
    collate = PreferenceCollator(ours)
    new = [{"chosen_ids": [2, 5, 6, 3], "rejected_ids": [2, 7, 3]}]
    legacy = [{"chosen_input_ids": [2, 5, 6, 3], "rejected_input_ids": [2, 7, 3]}]
    old = [
        {
            "input_ids_chosen": [2, 5, 6, 3],
            "attention_mask_chosen": [1, 1, 1, 1],
            "input_ids_rejected": [2, 7, 3, 0],  # padded by hand: the mask says so
            "attention_mask_rejected": [1, 1, 1, 0],
        }
    ]
    batches = [
        collate(tokenize_preferences(d, None, ours.head_configs)) for d in (new, legacy, old)
    ]
    for b in batches:
        assert b["input_ids"].tolist() == [[2, 5, 6, 3], [2, 7, 3, 0]]
        assert b["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
        assert b["labels"].tolist() == [1.0, 0.0]


def test_several_reward_heads_train_in_one_pass_each_on_its_own_columns(tmp_path):
    """helpful prefers "good", harmless prefers texts without "not"; a third head reads the
    helpful pairs' plain columns from a middle layer."""
    rng = random.Random(0)

    def rows(n):
        out = []
        for _ in range(n):
            out.append(
                {
                    "chosen": sentence(rng, "good"),
                    "rejected": sentence(rng),
                    "harmless_chosen": sentence(rng),
                    "harmless_rejected": sentence(rng, "not"),
                }
            )
        return Dataset.from_list(out)

    heads = [
        HeadConfig("helpful", pred_for_sequence=True, loss_fct="bradley_terry", pooling="mean"),
        HeadConfig("harmless", pred_for_sequence=True, loss_fct="bradley_terry", pooling="mean"),
        HeadConfig(
            "helpful_mid",
            target="helpful_plain",
            layer_hook=1,
            pred_for_sequence=True,
            loss_fct="bradley_terry",
            pooling="mean",
        ),
    ]
    model = HeadedModel(build_tiny("bert", 2), heads)  # frozen backbone, three heads
    tok = tokenizer()
    train = rows(96)
    trainer = HeadedTrainer(
        model,
        TrainingArguments(str(tmp_path), max_steps=60, **{**ARGS, "learning_rate": 3e-2}),
        train_dataset=train,
        eval_dataset=rows(48),
        processing_class=tok,
        compute_metrics=HeadwiseMetrics(model),
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(3)])
    # plain pairs (rows 0-5) read by helpful and helpful_mid, harmless' own (rows 6-11)
    assert batch["labels"]["helpful"].tolist() == [1, 1, 1, 0, 0, 0] + [-100] * 6
    assert batch["labels"]["helpful_plain"].tolist() == [1, 1, 1, 0, 0, 0] + [-100] * 6
    assert batch["labels"]["harmless"].tolist() == [-100] * 6 + [1, 1, 1, 0, 0, 0]
    out = model(**batch)
    assert set(out.loss_by_head) == {"helpful", "harmless", "helpful_mid"}
    trainer.train()
    metrics = trainer.evaluate()
    for head in ("helpful", "harmless", "helpful_mid"):
        assert metrics[f"eval_{head}_pairwise_accuracy"] > 0.8, metrics


def test_preference_data_errors():
    _, ours = twin_reward_models()
    with pytest.raises(ConfigError, match="processing_class=tokenizer"):
        HeadedTrainer(
            ours, TrainingArguments("/tmp/unused", report_to=[]), train_dataset=pairs(4, 0)
        )
    with pytest.raises(ConfigError, match="it is each head's option"):
        args = RewardConfig(
            "/tmp/unused", report_to=[], use_cpu=True, center_rewards_coefficient=0.01
        )
        HeadedTrainer(ours, args, train_dataset=pairs(4, 0), processing_class=tokenizer())
    with pytest.raises(BatchError, match="no chosen / rejected pair"):
        tokenize_preferences([{"chosen": "w1", "other": "w2"}], tokenizer(), ours.head_configs)
    collate = PreferenceCollator(ours)
    with pytest.raises(BatchError, match="1 of 2 examples have a margin"):
        collate(
            [
                {"chosen_ids": [2], "rejected_ids": [3], "margin": 1.0},
                {"chosen_ids": [2], "rejected_ids": [3]},
            ]
        )
    with pytest.raises(BatchError, match="there is no tokenizer"):
        collate([{"chosen": "w1", "rejected": "w2"}])
    with pytest.raises(ConfigError, match="no reward head"):
        PreferenceCollator(
            HeadedModel(build_tiny("bert", 1), [HeadConfig("x", pred_for_sequence=True)])
        )


# ---------------------------------------------------------------------- process rewards
def steps(n: int, seed: int) -> Dataset:
    """Chains of 2-4 steps; a step with "not" in it is wrong."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        k = rng.randint(2, 4)
        wrong = [rng.random() < 0.4 for _ in range(k)]
        rows.append(
            {
                "prompt": sentence(rng),
                "completions": [sentence(rng, "not" if w else None) for w in wrong],
                "labels": [not w for w in wrong],
            }
        )
    return Dataset.from_list(rows)


def twin_prms():
    from conftest import tiny_config
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(0)
    ref = AutoModelForTokenClassification.from_config(
        tiny_config("llama", 2, dropout=0.0, num_labels=2)
    ).eval()
    head = HeadConfig("prm", num_outputs=2, output_bias=True)
    ours = HeadedModel(copy.deepcopy(ref.model), [head], freeze_base_model=False)
    with torch.no_grad():
        ours.heads["prm"].output_projection().weight.copy_(ref.score.weight)
        ours.heads["prm"].output_projection().bias.copy_(ref.score.bias)
    return ref, ours


def test_stepwise_tokenisation_is_prm_trainers():
    tok = tokenizer()
    for example in steps(5, 0):
        for last_only in (False, True):
            ours = tokenize_steps(example, tok, "[SEP]", 12, 9, last_only)
            theirs = PRMTrainer.tokenize_row(example, tok, "[SEP]", 12, 9, last_only, False)
            assert ours == theirs


def test_prm_matches_prm_trainer(tmp_path):
    train, test = steps(96, 0), steps(48, 1)
    ref, ours = twin_prms()
    tok = tokenizer()
    args = dict(ARGS, output_dir=str(tmp_path), max_steps=30)
    theirs_t = PRMTrainer(
        ref,
        PRMConfig(**args, step_separator="[SEP]"),
        train_dataset=train,
        eval_dataset=test,
        processing_class=tok,
    )
    ours_t = HeadedTrainer(
        ours,
        PRMConfig(**args, step_separator="[SEP]"),
        train_dataset=train,
        eval_dataset=test,
        processing_class=tok,
        compute_metrics=HeadwiseMetrics(ours),
    )
    ref.train(), ours.train()
    for a, b, _ in zip(ours_t.get_train_dataloader(), theirs_t.get_train_dataloader(), range(3)):
        assert torch.equal(a["input_ids"], b["input_ids"])
        torch.testing.assert_close(
            ours_t.compute_loss(ours, dict(a)),
            theirs_t.compute_loss(ref, dict(b)),
            atol=1e-5,
            rtol=0,
        )
    ours_t.train()
    theirs_t.train()
    acc = ours_t.evaluate()["eval_prm_accuracy"]
    assert abs(acc - theirs_t.evaluate()["eval_accuracy"]) <= 0.02


def test_step_scores_read_the_head_at_each_steps_end():
    _, ours = twin_prms()
    tok = tokenizer()
    example = {"prompt": "w1 w2", "completions": ["w3 w4", "not w5"], "labels": [True, False]}
    scores = step_scores(
        ours, tok, example["prompt"], example["completions"], step_separator="[SEP]"
    )
    enc = tokenize_steps(example, tok, "[SEP]")
    ends = [i for i, y in enumerate(enc["labels"]) if y != -100]
    ids = torch.tensor([enc["input_ids"]])
    probs = ours(input_ids=ids).preds_by_head["prm"][0].softmax(-1)[:, 1]
    assert scores == pytest.approx(probs[ends].tolist(), abs=1e-6)


def test_generate_gives_the_prm_score_at_each_generated_separator():
    lm = build_tiny("llama", 2)
    heads = [
        HeadConfig("lm_head", is_causal_lm=True, num_outputs=100),
        HeadConfig("prm", num_outputs=2, output_bias=True),
    ]
    model = HeadedModel(lm, heads)
    prompt = torch.tensor([[5, 6, 7], [8, 9, 10]])
    out = model.generate(prompt, max_new_tokens=12, do_sample=True, top_k=0, eos_token_id=None)
    generated = out.sequences[:, 3:]
    sep = [int(generated[0, 4])]  # a token the first row surely generated
    found = step_end_scores(out, sep, "prm")
    # compare with a plain forward over the sequences: the same scores at the same places
    with torch.no_grad():
        full = model(input_ids=out.sequences, attention_mask=out.attention_mask)
    full = full.preds_by_head["prm"]
    probs = full.softmax(-1)[..., 1]
    for r in range(2):
        expected = [
            (t, float(probs[r, 3 + t])) for t in range(12) if int(generated[r, t]) == sep[0]
        ]
        assert [t for t, _ in found[r]] == [t for t, _ in expected]
        assert [s for _, s in found[r]] == pytest.approx([s for _, s in expected], abs=1e-5)
    assert found[0]


# ---------------------------------------------------------------------- export
def test_orm_exports_as_a_sequence_classifier_with_one_label_and_identical_scores(tmp_path):
    from transformers import AutoModelForSequenceClassification

    _, ours = twin_reward_models()
    with torch.no_grad():
        ours.heads["reward"].output_projection().weight.normal_()
    tok = tokenizer()
    done = headkit.export(ours, tmp_path / "rm", format="transformers", tokenizer=tok)
    assert done.model_class == "BertForSequenceClassification"
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert rm.config.num_labels == 1
    batch = tok(["w1 good w2", "w3 w4 w5 w6 w7"], padding=True, return_tensors="pt")
    with torch.no_grad():
        theirs = rm(**batch).logits
        mine = ours(**batch).preds_by_head["reward"]
    torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=0)


def test_decoder_orm_and_prm_export_where_they_map_and_are_refused_with_the_reason(tmp_path):
    from transformers import AutoModelForTokenClassification

    heads = [
        HeadConfig("orm", pred_for_sequence=True, loss_fct="bradley_terry", pooling="last"),
        HeadConfig("prm", num_outputs=2, output_bias=True),
        HeadConfig("early", layer_hook=1, pred_for_sequence=True, loss_fct="bradley_terry"),
    ]
    model = HeadedModel(build_tiny("llama", 2), heads)
    with pytest.raises(ConfigError, match="pad_token_id=2 is also the eos id"):
        headkit.export(model, tmp_path / "orm", format="transformers", head="orm")
    done = headkit.export(
        model, tmp_path / "orm", format="transformers", head="orm", pad_token_id=0
    )
    assert done.model_class == "LlamaForSequenceClassification" and done.max_abs_diff < 1e-5
    done = headkit.export(model, tmp_path / "prm", format="transformers", head="prm")
    prm = AutoModelForTokenClassification.from_pretrained(tmp_path / "prm").eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(
            prm(input_ids=ids).logits, model(input_ids=ids).preds_by_head["prm"], atol=1e-5, rtol=0
        )
    with pytest.raises(ConfigError, match="reads layer_hook=1"):
        headkit.export(
            model, tmp_path / "early", format="transformers", head="early", pad_token_id=0
        )


def test_stepwise_and_prm_errors():
    tok = tokenizer()
    with pytest.raises(BatchError, match="3 completions but 2 labels"):
        tokenize_steps({"prompt": "w1", "completions": ["w2", "w3", "w4"], "labels": [1, 0]}, tok)
    with pytest.raises(BatchError, match="has no 'completions'"):
        tokenize_steps({"prompt": "w1", "labels": [1]}, tok)
    two = HeadedModel(build_tiny("bert", 1), [HeadConfig("a", num_outputs=2), HeadConfig("b")])
    with pytest.raises(ConfigError, match="the model has 2"):
        step_scores(two, tok, "w1", ["w2"])
    with pytest.raises(ConfigError, match="separator_ids is empty"):
        step_end_scores(object(), [], "prm")


def test_pairwise_heads_do_not_train_on_cached_features():
    from headkit import cache_features, train_heads_on_features

    model = HeadedModel(
        build_tiny("bert", 1), [HeadConfig("r", pred_for_sequence=True, loss_fct="bradley_terry")]
    )
    rows = [{"input_ids": [2, 5, 6, 3], "r": 1.0}, {"input_ids": [2, 7, 3], "r": 0.0}]
    feats = cache_features(model, rows, batch_size=2, progress=False)
    with pytest.raises(ConfigError, match="shuffles rows"):
        train_heads_on_features(model, feats)


def test_pretokenised_pairs_train_without_a_tokenizer_and_per_head_legacy_names(tmp_path):
    _, ours = twin_reward_models()
    rows = [{"reward_chosen_input_ids": [2, 5, 6, 3], "reward_rejected_input_ids": [2, 7, 3]}] * 8
    trainer = HeadedTrainer(
        ours,
        TrainingArguments(str(tmp_path), max_steps=2, **ARGS),
        train_dataset=Dataset.from_list(rows),
    )
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert batch["input_ids"].tolist() == [[2, 5, 6, 3], [2, 7, 3, 0]]
    trainer.train()


def test_streamed_preference_and_stepwise_data_train_as_the_same_rows_do(tmp_path):
    from datasets import IterableDataset

    from headkit.data.stepwise import tokenize_stepwise

    tok = tokenizer()
    train, test = pairs(32, 0), pairs(24, 1)
    rows = list(train)
    # features unknown until read (load_dataset(..., streaming=True) from JSON lines)
    streamed = IterableDataset.from_generator(lambda: iter(rows))
    assert streamed.column_names is None
    _, ours = twin_reward_models()
    args = TrainingArguments(**dict(ARGS, output_dir=str(tmp_path), max_steps=3))
    trainer = HeadedTrainer(
        ours,
        args,
        train_dataset=streamed,
        eval_dataset=test.to_iterable_dataset(),
        processing_class=tok,
        compute_metrics=HeadwiseMetrics(ours),
    )
    # a streamed dataset is not shuffled: the first batch is the first 8 pairs, tokenised lazily
    first = next(iter(trainer.get_train_dataloader()))
    expected = PreferenceCollator(ours)(tokenize_preferences(rows[:8], tok, ours.head_configs))
    assert torch.equal(first["input_ids"], expected["input_ids"])
    assert torch.equal(first["labels"], expected["labels"])  # one head: its label tensor
    trainer.train()
    streamed_eval = trainer.evaluate()
    whole = evaluate_head_wise(
        ours,
        tokenize_preferences(test, tok, ours.head_configs),
        PreferenceCollator(ours),
        batch_size=24,
        progress=False,
    )
    accuracy = streamed_eval["eval_reward_pairwise_accuracy"]
    assert accuracy == pytest.approx(whole["reward"]["pairwise_accuracy"], abs=1e-12)
    # stepwise supervision streams the same way
    chains = list(steps(4, 0))
    lazily = tokenize_stepwise(IterableDataset.from_generator(lambda: iter(chains)), tok, "prm")
    assert list(lazily) == tokenize_stepwise(chains, tok, "prm")
    with pytest.raises(BatchError, match="the dataset is empty"):
        tokenize_preferences(
            IterableDataset.from_generator(lambda: iter([])), tok, ours.head_configs
        )
