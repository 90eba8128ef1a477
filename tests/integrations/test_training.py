"""Training with HF Trainer: vanilla Trainer, HeadedTrainer, checkpoints, resume, seeds,
non-finite losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_tiny
from transformers import Trainer, TrainingArguments

from headkit import (
    ConfigError,
    HeadConfig,
    HeadedCollator,
    HeadedModel,
    HeadedTrainer,
    HeadwiseMetrics,
    NonFiniteLossError,
)
from headkit.metrics import compute_head_metrics

# tiny models gain nothing from more threads, and the machine is shared
pytestmark = pytest.mark.usefixtures("single_thread")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def _model(*, freeze: bool = True, dropout: float = 0.0, **kwargs) -> HeadedModel:
    heads = [
        HeadConfig("sent", num_outputs=3, pred_for_sequence=True, dropout=dropout),
        HeadConfig("ner", num_outputs=4, dropout=dropout),
    ]
    return HeadedModel(build_tiny("gpt2", num_layers=2), heads, freeze_base_model=freeze, **kwargs)


def _data(n: int = 16, ner_upto: int | None = None) -> list[dict]:
    """Examples of 3..7 tokens; "ner" labels only for the first ``ner_upto`` examples."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        length = 3 + i % 5
        ids = torch.randint(3, 100, (length,), generator=g).tolist()
        ex = {"input_ids": ids, "sent": (ids[-1] + i) % 3}
        if ner_upto is None or i < ner_upto:
            ex["ner"] = [t % 4 for t in ids]
        out.append(ex)
    return out


def _args(out: Path, **kwargs) -> TrainingArguments:
    base = {
        "output_dir": str(out),
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 4,
        "learning_rate": 5e-2,
        "max_steps": 3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "seed": 0,
    }
    return TrainingArguments(**{**base, **kwargs})


def _heads(model: HeadedModel) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.head_state_dict().items()}


def _direct(model: HeadedModel, features: list[dict]):
    """The model run on one collated batch, in eval mode (the reference)."""
    batch = HeadedCollator(model)(features)
    model.eval()
    with torch.no_grad():
        return model(**batch), batch


# ---------------------------------------------------------------------- vanilla Trainer
def test_vanilla_trainer_trains_evaluates_and_predicts(tmp_path: Path) -> None:
    model = _model()
    data = _data(12)
    before = _heads(model)
    trainer = Trainer(
        model=model,
        # several heads: a vanilla Trainer would drop the target columns "sent" and "ner"
        # (forward's signature lists `labels`, not the targets); HeadedTrainer keeps them
        args=_args(tmp_path, per_device_eval_batch_size=8, remove_unused_columns=False),
        train_dataset=data,
        eval_dataset=data[:8],
        data_collator=HeadedCollator(model),
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    after = _heads(model)
    assert all(not torch.equal(before[k], after[k]) for k in before)  # every head trained

    metrics = trainer.evaluate()
    out, batch = _direct(model, data[:8])  # one evaluation batch of 8
    assert metrics["eval_loss"] == pytest.approx(float(out.loss), rel=1e-5)

    pred = trainer.predict(data[:8])
    preds = pred.predictions  # vanilla Trainer, several trained heads: {head: predictions}
    for name in ("sent", "ner"):
        torch.testing.assert_close(torch.as_tensor(preds[name]), out.preds_by_head[name])
        assert (pred.label_ids[name] == batch["labels"][name].numpy()).all()


def test_vanilla_trainer_with_one_head_and_a_label_column_keeps_its_defaults(
    tmp_path: Path,
) -> None:
    model = HeadedModel(
        build_tiny("gpt2", num_layers=2),
        [HeadConfig("sent", num_outputs=3, pred_for_sequence=True)],
    )
    data = [{"input_ids": x["input_ids"], "label": x["sent"], "text": "-"} for x in _data(12)]
    before = _heads(model)
    trainer = Trainer(
        model=model,
        args=_args(tmp_path, per_device_eval_batch_size=8),
        train_dataset=data,
        eval_dataset=data[:8],
        data_collator=HeadedCollator(model),
    )
    assert trainer.args.remove_unused_columns  # the default: "label" survives it, "text" not
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    after = _heads(model)
    assert all(not torch.equal(before[k], after[k]) for k in before)

    metrics = trainer.evaluate()
    features = [{k: v for k, v in ex.items() if k != "text"} for ex in data[:8]]
    out, batch = _direct(model, features)
    assert metrics["eval_loss"] == pytest.approx(float(out.loss), rel=1e-5)

    pred = trainer.predict(data[:8])  # one trained head: its arrays, as a classifier's
    torch.testing.assert_close(torch.as_tensor(pred.predictions), out.preds_by_head["sent"])
    assert (pred.label_ids == batch["labels"].numpy()).all()


def test_a_vanilla_trainer_that_drops_the_target_columns_says_why(tmp_path, caplog) -> None:
    model = _model()
    trainer = Trainer(
        model=model,
        args=_args(tmp_path),  # remove_unused_columns=True drops "sent" and "ner"
        train_dataset=_data(8),
        data_collator=HeadedCollator(model),
    )
    with caplog.at_level("WARNING", logger="headkit"), pytest.raises(ValueError):
        trainer.train()  # Trainer: "The model did not return a loss from the inputs"
    told = [r.getMessage() for r in caplog.records if r.name == "headkit"]
    assert len(told) == 1 and "targets ['ner', 'sent']" in told[0]
    assert "HeadedTrainer" in told[0] and "remove_unused_columns=False" in told[0]


# ---------------------------------------------------------------------- HeadedTrainer
def test_headed_trainer_reports_per_head_losses_metrics_and_predictions(tmp_path: Path) -> None:
    model = _model()
    data = _data(8, ner_upto=4)  # the second evaluation batch has no "ner" labels
    trainer = HeadedTrainer(
        model=model,
        args=_args(tmp_path),
        eval_dataset=data,
        compute_metrics=HeadwiseMetrics(model),
    )
    metrics = trainer.evaluate()
    first, _ = _direct(model, data[:4])
    second, _ = _direct(model, data[4:])
    sent_loss = (float(first.loss_by_head["sent"]) + float(second.loss_by_head["sent"])) / 2
    assert metrics["eval_sent_loss"] == pytest.approx(sent_loss, rel=1e-5)
    assert metrics["eval_ner_loss"] == pytest.approx(float(first.loss_by_head["ner"]), rel=1e-5)
    assert metrics["eval_loss"] == pytest.approx((float(first.loss) + float(second.loss)) / 2)
    sent_preds = torch.cat([first.preds_by_head["sent"], second.preds_by_head["sent"]])
    sent_ref = compute_head_metrics(
        model.head_configs["sent"], sent_preds, torch.tensor([ex["sent"] for ex in data])
    )
    assert metrics["eval_sent_accuracy"] == pytest.approx(sent_ref["accuracy"])
    assert metrics["eval_sent_macro_f1"] == pytest.approx(sent_ref["macro_f1"])
    assert "eval_ner_accuracy" in metrics

    pred = trainer.predict(data)
    assert set(pred.predictions) == {"sent", "ner"} and set(pred.label_ids) == {"sent", "ner"}
    torch.testing.assert_close(torch.as_tensor(pred.predictions["sent"]), sent_preds)
    ner = torch.as_tensor(pred.predictions["ner"])  # (8, longest, 4); shorter batches padded
    width = first.preds_by_head["ner"].shape[1]
    torch.testing.assert_close(ner[:4, :width], first.preds_by_head["ner"])
    assert (pred.label_ids["ner"][4:] == -100).all()  # no labels in the second batch


def test_save_model_writes_a_headkit_checkpoint(tmp_path: Path) -> None:
    model = _model()
    trainer = HeadedTrainer(
        model=model,
        args=_args(
            tmp_path / "run",
            max_steps=2,
            save_strategy="steps",
            save_steps=2,
            eval_strategy="steps",
            eval_steps=2,
        ),
        train_dataset=_data(8),
        eval_dataset=_data(4),
    )
    trainer.train()
    # the checkpoint's model card says what trainer_state.json says: the evaluation's losses
    card = (tmp_path / "run" / "checkpoint-2" / "README.md").read_text()
    assert "library_name: headkit" in card and "sent" in card
    logged = next(e for e in trainer.state.log_history if "eval_sent_loss" in e)
    assert f"| sent | loss | {logged['eval_sent_loss']:.4f} |" in card
    final = tmp_path / "final"
    trainer.save_model(str(final))
    # the final model's card too: the last evaluation, the training settings, model-index
    card = (final / "README.md").read_text()
    assert f"| sent | loss | {logged['eval_sent_loss']:.4f} |" in card
    assert "| learning_rate | 0.05 |" in card and "model-index:" in card
    for folder in (final, tmp_path / "run" / "checkpoint-2"):
        manifest = json.loads((folder / "head_configs.json").read_text())
        assert manifest["format"] == "headkit"
        names = [p.name for p in folder.iterdir()]
        assert any(n.startswith("heads-") and n.endswith(".safetensors") for n in names)
        assert "training_args.json" in names
    assert not [p for p in final.rglob("*") if p.suffix in PICKLE_SUFFIXES]
    loaded = HeadedModel.from_pretrained(final)
    out, _ = _direct(model, _data(4))
    again, _ = _direct(loaded, _data(4))
    for name in out.preds_by_head:
        torch.testing.assert_close(again.preds_by_head[name], out.preds_by_head[name])


# ---------------------------------------------------------------------- resume and seeds
def _run(out: Path, *, seed: int = 0, resume: Path | None = None) -> dict[str, torch.Tensor]:
    """4 steps with a trained backbone, dropout and learned loss weights; checkpoint at 2."""
    model = _model(freeze=False, dropout=0.2, loss_weighting="uncertainty")
    args = _args(out, max_steps=4, save_strategy="steps", save_steps=2, seed=seed)
    trainer = HeadedTrainer(model=model, args=args, train_dataset=_data(16))
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("straight")
    before = torch.get_num_threads()
    # one thread, as in the tests (single_thread): float sums differ with the thread count
    torch.set_num_threads(1)
    try:
        return out, _run(out)
    finally:
        torch.set_num_threads(before)


def test_resume_from_checkpoint_gives_the_same_weights(straight_run, tmp_path: Path) -> None:
    out, straight = straight_run
    resumed = _run(tmp_path, resume=out / "checkpoint-2")
    assert set(resumed) == set(straight)
    differ = [k for k in straight if not torch.equal(straight[k], resumed[k])]
    assert not differ, differ[:5]
    assert any(k.startswith("backbone.") for k in straight)  # the backbone was trained too


def test_a_fixed_seed_makes_runs_reproducible(straight_run, tmp_path: Path) -> None:
    _, straight = straight_run
    again = _run(tmp_path / "same")
    assert all(torch.equal(straight[k], again[k]) for k in straight)
    other = _run(tmp_path / "other", seed=1)
    assert not torch.equal(straight["heads.sent.mlp.1.weight"], other["heads.sent.mlp.1.weight"])


# ---------------------------------------------------------------------- non-finite losses
def _nonfinite_setup(tmp_path: Path, policy: str):
    heads = [
        HeadConfig("sent", num_outputs=3, pred_for_sequence=True),
        HeadConfig("score", pred_for_sequence=True, is_regression=True, loss_fct="mse"),
    ]
    model = HeadedModel(build_tiny("gpt2", num_layers=2), heads, nonfinite_loss=policy)
    data = _data(8)
    for i, ex in enumerate(data):
        del ex["ner"]
        ex["score"] = 1e30 if i == 5 else i / 8  # (pred - 1e30)² overflows float32: inf
    trainer = HeadedTrainer(model=model, args=_args(tmp_path, max_steps=2), train_dataset=data)
    return model, trainer


def test_nonfinite_loss_raises_naming_the_head(tmp_path: Path) -> None:
    _, trainer = _nonfinite_setup(tmp_path, "raise")
    with pytest.raises(NonFiniteLossError, match=r"head 'score' produced a non-finite loss"):
        trainer.train()


def test_nonfinite_loss_skip_leaves_the_head_out_and_training_goes_on(tmp_path: Path) -> None:
    model, trainer = _nonfinite_setup(tmp_path, "skip")
    before = _heads(model)
    with pytest.warns(UserWarning, match=r"head 'score': non-finite loss skipped"):
        trainer.train()
    assert trainer.state.global_step == 2
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert all(torch.isfinite(torch.tensor(losses)))
    after = _heads(model)
    assert all(torch.isfinite(v).all() for v in after.values())
    assert not torch.equal(before["heads.sent.mlp.0.weight"], after["heads.sent.mlp.0.weight"])


def test_headed_trainer_rejects_what_it_cannot_train(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model=GPT2LMHeadModel is invalid"):
        HeadedTrainer(model=build_tiny("gpt2", num_layers=1), args=_args(tmp_path))
    with pytest.raises(ConfigError, match=r"label_smoothing_factor=0.1"):
        HeadedTrainer(model=_model(), args=_args(tmp_path, label_smoothing_factor=0.1))
