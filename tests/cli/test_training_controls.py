"""``headkit train``'s training controls: an lr schedule with warm-up, weight decay, clipping,
accumulation, bf16 (fp16 refused on CPU), early stopping on a named metric, resuming an
interrupted run, CSV and TensorBoard logs, balanced class weights and calibration on the
validation split, which ``headkit predict`` then uses."""

from __future__ import annotations

import csv
import math

import pytest
import torch
from cli_helpers import one_error_line, review_files, tiny_model

from headkit import HeadedModel
from headkit.cli.fitting import STATE_FOLDER, TrainingState, make_scheduler
from headkit.cli.main import main
from headkit.cli.train import load_train_config, run_train
from headkit.features.train import OptimizerSteps

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("controls")
    return {"model": tiny_model(root), **review_files(root)}


def _config(path, files, training: str, head: str = "") -> str:
    path.write_text(
        f"model: {files['model']}\n"
        "heads: [{name: sentiment, layer_hook: 0, pred_for_sequence: true, pooling: mean,"
        f" output_bias: true{head}}}]\n"
        f"data: {{train: {files['train']}, label_columns: {{sentiment: label}}}}\n"
        f"training: {training}\n"
    )
    return str(path)


def test_every_control_from_yaml_trains_logs_and_calibrates(files, tmp_path, capsys) -> None:
    training = (
        "{epochs: 6, lr: 5.0e-2, batch_size: 16, lr_schedule: cosine, warmup_ratio: 0.2, "
        "weight_decay: 0.1, max_grad_norm: 1.0, gradient_accumulation_steps: 2, "
        "metric_for_best_model: accuracy, patience: 100, report_to: [csv, tensorboard], "
        "threshold: f1, validation_fraction: 0.25}"
    )
    config = _config(tmp_path / "c.yaml", files, training, ", class_weights: balanced")
    out = tmp_path / "ckpt"
    assert main(["train", config, "--output", str(out), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "calibrated sentiment on validation: temperature" in printed and "threshold" in printed
    with open(out / "logs" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["epoch"] for r in rows] == ["1", "2", "3", "4", "5", "6"]
    assert {"train/loss", "train/lr", "eval/loss", "eval/sentiment_accuracy"} <= set(rows[0])
    lrs = [float(r["train/lr"]) for r in rows]
    assert lrs[-1] < lrs[1]  # cosine decay after the warm-up
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "logs").iterdir())
    assert not (out / STATE_FOLDER).exists()  # the checkpoint supersedes the state
    cfg = HeadedModel.from_pretrained(out).head_configs["sentiment"]
    with open(files["train"], newline="") as f:
        labels = list(csv.DictReader(f))
    n_pos = sum(r["label"] == "pos" for r in labels)
    expected = [len(labels) / (2 * (len(labels) - n_pos)), len(labels) / (2 * n_pos)]
    assert cfg.class_weights == pytest.approx(expected)  # classes sorted: neg, pos
    assert cfg.temperature != 1.0 and cfg.threshold is not None
    # predict decides with the stored threshold on the calibrated probability
    pred = tmp_path / "pred.csv"
    assert main(["predict", str(out), "--data", str(files["test"]), "--output", str(pred)]) == 0
    with open(pred, newline="") as f:
        for row in csv.DictReader(f):
            positive = float(row["sentiment_prob_pos"]) >= cfg.threshold
            assert row["sentiment"] == ("pos" if positive else "neg")


def test_early_stopping_keeps_the_best_epoch_by_the_named_metric(files, tmp_path) -> None:
    training = (
        "{epochs: 8, lr: 1.0e-1, batch_size: 16, metric_for_best_model: sentiment_accuracy, "
        "patience: 8, validation_fraction: 0.3}"
    )
    config = load_train_config(_config(tmp_path / "c.yaml", files, training), tmp_path / "o")
    result = run_train(config, progress=False)
    accuracies = [m["sentiment_accuracy"] for m in result["val_metrics"]]
    assert len(accuracies) == 8
    assert accuracies[result["best_epoch"] - 1] == max(accuracies)  # the first best epoch
    assert result["best_epoch"] == accuracies.index(max(accuracies)) + 1


def test_an_interrupted_run_resumes_where_it_stopped(files, tmp_path, monkeypatch, capsys):
    training = (
        "{epochs: 4, lr: 5.0e-2, batch_size: 16, lr_schedule: linear, warmup_steps: 3, "
        "patience: 100, report_to: [csv]}"
    )
    config = _config(tmp_path / "c.yaml", files, training)
    assert main(["train", config, "--output", str(tmp_path / "whole"), "--quiet"]) == 0
    saved = TrainingState.save

    def save_then_stop(self, fit, kept):
        saved(self, fit, kept)
        if len(fit.losses) == 2:
            raise KeyboardInterrupt  # killed after epoch 2's state was written

    monkeypatch.setattr(TrainingState, "save", save_then_stop)
    cut = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        main(["train", config, "--output", str(cut), "--quiet"])
    monkeypatch.setattr(TrainingState, "save", saved)
    assert (cut / STATE_FOLDER / "state.json").is_file()
    capsys.readouterr()
    # without --resume the unfinished run's folder is refused unless overwritten
    line = one_error_line(main(["train", config, "--output", str(cut)]), capsys.readouterr().err)
    assert "--overwrite" in line
    assert main(["train", config, "--output", str(cut), "--resume", "--quiet"]) == 0
    assert "resumed after epoch 2" in capsys.readouterr().out
    whole = HeadedModel.from_pretrained(tmp_path / "whole").heads["sentiment"].state_dict()
    resumed = HeadedModel.from_pretrained(cut).heads["sentiment"].state_dict()
    for name in whole:
        assert torch.allclose(whole[name], resumed[name], atol=1e-6), name
    with open(cut / "logs" / "metrics.csv", newline="") as f:
        assert [r["epoch"] for r in csv.DictReader(f)] == ["1", "2", "3", "4"]
    line = one_error_line(
        main(["train", config, "--output", str(tmp_path / "new"), "--resume"]),
        capsys.readouterr().err,
    )
    assert "holds no training state" in line


def test_fp16_is_refused_on_cpu_and_bf16_trains(files, tmp_path, capsys) -> None:
    config = _config(tmp_path / "f.yaml", files, "{epochs: 1, fp16: true}")
    line = one_error_line(
        main(["train", config, "--output", str(tmp_path / "f")]), capsys.readouterr().err
    )
    assert "training.fp16=true needs a CUDA GPU (the model is on cpu)" in line
    training = "{epochs: 2, bf16: true, freeze_backbone: false, lr: 1.0e-3, batch_size: 32}"
    config = _config(tmp_path / "b.yaml", files, training)
    assert main(["train", config, "--output", str(tmp_path / "b"), "--quiet"]) == 0


def test_schedule_warms_up_then_decays() -> None:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    sched = make_scheduler(opt, {"lr_schedule": "cosine", "warmup_steps": 4}, total=20)
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])  # linear warm-up
    assert lrs[4] == pytest.approx(1.0)
    for step in range(4, 20):
        assert lrs[step] == pytest.approx(0.5 * (1 + math.cos(math.pi * (step - 4) / 16)))


def test_accumulation_averages_batches_and_clipping_bounds_the_norm() -> None:
    torch.manual_seed(0)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    whole = torch.nn.Linear(3, 1)
    parts = torch.nn.Linear(3, 1)
    parts.load_state_dict(whole.state_dict())
    torch.nn.functional.mse_loss(whole(x), y).backward()
    steps = OptimizerSteps(torch.optim.SGD(parts.parameters(), lr=0.0), accumulation_steps=2)
    grads = []
    steps.optimizer.step = lambda: grads.append([p.grad.clone() for p in parts.parameters()])
    for i, rows in enumerate((slice(0, 4), slice(4, 8))):
        steps.backward(torch.nn.functional.mse_loss(parts(x[rows]), y[rows]), last=i == 1)
    assert steps.steps == 1 and len(grads) == 1  # two batches, one optimizer step
    for g, p in zip(grads[0], whole.parameters()):
        assert torch.allclose(g, p.grad, atol=1e-6)  # the mean of the two batches' gradients
    clipped = OptimizerSteps(torch.optim.SGD(parts.parameters(), lr=0.0), max_grad_norm=1e-3)
    norms = []
    clipped.optimizer.step = lambda: norms.append(
        torch.norm(torch.stack([p.grad.norm() for p in parts.parameters()]))
    )
    clipped.backward(torch.nn.functional.mse_loss(parts(x), y) * 100, last=True)
    assert float(norms[0]) == pytest.approx(1e-3, rel=1e-3)


def test_a_corrupt_training_state_is_refused(files, tmp_path, capsys) -> None:
    config = _config(tmp_path / "c.yaml", files, "{epochs: 2}")
    state = tmp_path / "cut" / STATE_FOLDER
    state.mkdir(parents=True)
    (state / "state.json").write_text("not json")
    (state / "state.safetensors").write_bytes(b"garbage")
    line = one_error_line(
        main(["train", config, "--output", str(tmp_path / "cut"), "--resume"]),
        capsys.readouterr().err,
    )
    assert "--resume: training state" in line and "cannot be read" in line
    assert "train afresh" in line
