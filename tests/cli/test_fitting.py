"""``headkit train``'s epochs: a validation split held out of the training rows, early stopping
on its loss with the best epoch's weights restored, and a warning when every epoch ran and the
training loss was still falling."""

from __future__ import annotations

import re

import pytest
import torch
from cli_helpers import review_files, tiny_model, write_config

from headkit.cli.fitting import early_stopping, validation_split
from headkit.cli.main import main
from headkit.cli.train import LossStillFallingWarning, load_train_config, run_train

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fitting")
    return {"model": tiny_model(root), **review_files(root)}


def test_the_validation_split_is_drawn_from_the_training_rows() -> None:
    train, val = validation_split(200, 0.1, seed=3)
    assert len(val) == 20 and len(train) == 180 and sorted(train + val) == list(range(200))
    assert validation_split(200, 0.1, seed=3) == (train, val)  # the seed decides
    assert validation_split(200, 0.1, seed=4)[1] != val
    assert validation_split(5, 0.0, seed=0) == ([0, 1, 2, 3, 4], [])
    assert validation_split(2, 0.9, seed=0)[0] != []  # one row is left to train on


def test_early_stopping_restores_the_weights_of_the_best_epoch() -> None:
    """Epoch e sets the weights to e; validation losses fall to their lowest at epoch 3,
    then rise: training stops after ``patience`` worse epochs and keeps epoch 3's weights."""
    module = torch.nn.Linear(2, 1)
    frozen = torch.nn.Linear(2, 1).requires_grad_(False)
    module.add_module("frozen", frozen)
    before_frozen = frozen.weight.detach().clone()
    scripted = iter([5.0, 4.0, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0])

    def epoch(e: int) -> float:
        with torch.no_grad():
            module.weight.fill_(float(e + 1))
            module.bias.fill_(float(e + 1))
        return 1.0 / (e + 1)

    fit = early_stopping(module, epoch, lambda: next(scripted), epochs=8, patience=3)
    assert fit.best_epoch == 3 and fit.stopped_early and len(fit.losses) == 6
    assert fit.val_losses == [5.0, 4.0, 3.0, 3.5, 4.0, 4.5]
    assert torch.all(module.weight == 3.0) and torch.all(module.bias == 3.0)
    assert torch.equal(frozen.weight, before_frozen)  # only trainable weights are kept


def test_train_stops_early_and_says_which_epoch_it_kept(files, tmp_path, capsys) -> None:
    training = "{epochs: 300, lr: 2.0e-1, patience: 3, batch_size: 16}"
    config = write_config(tmp_path / "c.yaml", files["model"], files["train"], training)
    assert main(["train", str(config), "--output", str(tmp_path / "ckpt"), "--quiet"]) == 0
    printed = capsys.readouterr()
    ran = re.search(r"training loss: epoch 1 \S+ -> epoch (\d+) ", printed.out)
    kept = re.search(
        r"validation loss: best \S+ at epoch (\d+) \(stopped early; its weights", printed.out
    )
    assert ran and kept, printed.out
    assert int(ran[1]) < 300 and int(ran[1]) - int(kept[1]) == 3  # patience epochs after it
    assert "warning" not in printed.err


def test_a_warning_when_the_loss_is_still_falling_at_the_last_epoch(files, tmp_path, capsys):
    training = "{epochs: 2, lr: 1.0e-4, validation_fraction: 0}"
    config = write_config(tmp_path / "c.yaml", files["model"], files["train"], training)
    assert main(["train", str(config), "--output", str(tmp_path / "a"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "headkit train: warning: the training loss was still falling at the last epoch" in err
    assert "epoch 2 of training.epochs=2" in err
    with pytest.warns(LossStillFallingWarning, match="more epochs"):
        result = run_train(load_train_config(config, output=str(tmp_path / "b")), progress=False)
    assert result["best_epoch"] is None and result["val_losses"] == []


@pytest.mark.filterwarnings("ignore::headkit.cli.train.LossStillFallingWarning")
@pytest.mark.filterwarnings("ignore:HeadedModel. the deepest head reads")
def test_the_backbone_trained_too_is_validated_the_same_way(files, tmp_path) -> None:
    training = "{freeze_backbone: false, epochs: 2, lr: 1.0e-3}"
    config = write_config(tmp_path / "c.yaml", files["model"], files["train"], training)
    config.write_text(config.read_text().replace("label_columns:", "limit: 40, label_columns:"))
    loaded = load_train_config(config, output=str(tmp_path / "ft"))
    result = run_train(loaded, progress=False)
    assert len(result["val_losses"]) == len(result["losses"]) == 2
    assert result["best_epoch"] in (1, 2)
