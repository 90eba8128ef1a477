"""Learning rates for fresh heads: the README's Trainer block learns, ``param_groups`` for a
plain Trainer, the warning when heads barely move, and Trainer checkpoints explained."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import safetensors.torch
import torch
from conftest import build_tiny
from transformers import Trainer, TrainingArguments

import headkit
from headkit import (
    CheckpointError,
    ConfigError,
    HeadConfig,
    HeadedCollator,
    HeadedModel,
    HeadedTrainer,
    SlowHeadsWarning,
    param_groups,
)
from headkit.model.rates import HEAD_LR, WATCHED_STEPS

pytestmark = pytest.mark.usefixtures("single_thread")
ROOT = Path(__file__).resolve().parents[2]


def _model(freeze: bool = True) -> HeadedModel:
    heads = [HeadConfig("sent", num_outputs=2, pred_for_sequence=True, output_bias=True)]
    return HeadedModel(build_tiny("bert", num_layers=2), heads, freeze_base_model=freeze)


def _data(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [
        {"input_ids": torch.randint(3, 100, (5,), generator=g).tolist(), "label": i % 2}
        for i in range(n)
    ]


def _args(out: Path, **kwargs) -> TrainingArguments:
    base = dict(
        output_dir=str(out),
        per_device_train_batch_size=1,
        num_train_epochs=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    return TrainingArguments(**{**base, **kwargs})


def test_readme_trainer_block_beats_the_majority_by_the_probes_margin(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    (block,) = [b for b in blocks if "HeadedTrainer(model=model" in b]
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    # one thread: with two, MKL drops to one under load (MKL_DYNAMIC) and 150 steps on 400
    # reviews then land anywhere in 0.645-0.68; one thread gives the same numbers every run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        exec(compile(block, "README.md", "exec"), scope)  # verbatim
    finally:
        torch.set_num_threads(threads)
    test_labels = np.array(scope["test"]["label"])
    majority = max(test_labels.mean(), 1 - test_labels.mean())  # 0.58
    accuracy = scope["trainer"].evaluate()["eval_accuracy"]
    # a logistic-regression probe of the same features scores 0.655-0.675 (C = 1, 0.1)
    assert accuracy >= majority + 0.075, (accuracy, majority)


def test_param_groups_give_heads_and_backbone_their_own_rates() -> None:
    model = _model(freeze=False)
    groups = param_groups(model, head_lr=1e-2, backbone_lr=2e-5, weight_decay=0.1)
    by_name = {g["name"]: g for g in groups}
    assert set(by_name) == {"heads", "heads_no_decay", "backbone", "backbone_no_decay"}
    head_ids = {id(p) for p in model.heads.parameters()}
    for name, g in by_name.items():
        assert g["lr"] == (1e-2 if name.startswith("heads") else 2e-5)
        assert g["weight_decay"] == (0.0 if name.endswith("no_decay") else 0.1)
        assert all((id(p) in head_ids) == name.startswith("heads") for p in g["params"])
    total = sum(len(g["params"]) for g in groups)
    assert total == len([p for p in model.parameters() if p.requires_grad])
    frozen = param_groups(_model())  # a frozen backbone: heads only
    assert {g["name"] for g in frozen} == {"heads", "heads_no_decay"}
    assert all(g["lr"] == HEAD_LR for g in frozen)
    torch.optim.AdamW(frozen)  # what Trainer(optimizers=...) is given


@pytest.mark.parametrize(
    "kwargs",
    [{"head_lr": 0}, {"backbone_lr": -1.0}, {"head_lr": float("nan")}, {"weight_decay": "x"}],
)
def test_param_groups_refuse_bad_rates(kwargs) -> None:
    name = next(iter(kwargs))
    with pytest.raises(ConfigError, match=name):
        param_groups(_model(), **kwargs)
    with pytest.raises(ConfigError, match="HeadedModel"):
        param_groups(torch.nn.Linear(2, 2))


def test_headed_trainer_builds_its_optimizer_with_a_head_rate(tmp_path) -> None:
    model = _model(freeze=False)
    trainer = HeadedTrainer(model=model, args=_args(tmp_path), train_dataset=_data(4))
    rates = {g["lr"] for g in trainer.create_optimizer().param_groups}
    assert rates == {HEAD_LR, 5e-5}  # heads 3e-3, the backbone TrainingArguments' default
    own = HeadedTrainer(model=_model(), args=_args(tmp_path), head_learning_rate=1e-2)
    assert {g["lr"] for g in own.create_optimizer().param_groups} == {1e-2}
    high = HeadedTrainer(model=_model(), args=_args(tmp_path, learning_rate=5e-2))
    assert {g["lr"] for g in high.create_optimizer().param_groups} == {5e-2}
    with pytest.raises(ConfigError, match="head_lr=-1"):
        HeadedTrainer(model=_model(), args=_args(tmp_path), head_learning_rate=-1)


def test_a_plain_trainer_at_its_default_rate_warns_once_that_heads_barely_move(tmp_path):
    model = _model()
    collate = HeadedCollator(model)
    trainer = Trainer(
        model=model,
        args=_args(tmp_path),  # learning_rate 5e-5
        train_dataset=_data(WATCHED_STEPS + 5),
        data_collator=collate,
    )
    with pytest.warns(SlowHeadsWarning, match="param_groups") as record:
        trainer.train()
        trainer.train()  # watched once per model: no second warning
    assert len([w for w in record if w.category is SlowHeadsWarning]) == 1


def test_param_groups_in_a_plain_trainer_learn_and_do_not_warn(tmp_path):
    model = _model()
    before = {k: v.clone() for k, v in model.head_state_dict().items()}
    optimizer = torch.optim.AdamW(headkit.param_groups(model))
    trainer = Trainer(
        model=model,
        args=_args(tmp_path),
        train_dataset=_data(WATCHED_STEPS + 5),
        data_collator=HeadedCollator(model),
        optimizers=(optimizer, None),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", SlowHeadsWarning)
        trainer.train()
    after = model.head_state_dict()
    moved = max(float((after[k] - v).abs().max()) for k, v in before.items())
    assert moved > 10 * 5e-5 * WATCHED_STEPS  # far more than the default rate allows


def test_a_plain_trainers_checkpoint_is_refused_saying_how_to_recover(tmp_path):
    model = _model()
    trainer = Trainer(
        model=model,
        args=_args(tmp_path, max_steps=2),
        train_dataset=_data(4),
        data_collator=HeadedCollator(model),
        optimizers=(torch.optim.AdamW(param_groups(model)), None),
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    folder = tmp_path / "final"
    with pytest.raises(CheckpointError, match=r"HeadedTrainer.*load_state_dict") as e:
        HeadedModel.from_pretrained(folder)
    assert "transformers.Trainer" in str(e.value) and "heads ['sent']" in str(e.value)
    assert "\n" not in str(e.value)
    # the recovery it names gives the trained model back
    again = _model()
    again.load_state_dict(safetensors.torch.load_file(str(folder / "model.safetensors")))
    batch = HeadedCollator(model)(_data(3))
    model.eval(), again.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, again(**batch).logits)


def test_a_plain_trainers_checkpoint_loads_onto_the_model_it_trained(tmp_path):
    build_tiny("bert", num_layers=2).save_pretrained(tmp_path / "bb")
    bb = str(tmp_path / "bb")
    heads = [HeadConfig("sent", num_outputs=2, pred_for_sequence=True, output_bias=True)]
    model = headkit.load_headed(bb, head_configs=heads, freeze_base_model=False)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    args = _args(tmp_path / "run", max_steps=3, save_strategy="steps", save_steps=3)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=_data(6),
        data_collator=HeadedCollator(model),
        optimizers=(torch.optim.AdamW(param_groups(model)), None),
    )
    trainer.train()
    folder = tmp_path / "run" / "checkpoint-3"  # Trainer's own folder: the state dict only
    assert (folder / "model.safetensors").is_file() and not (folder / "head_configs.json").exists()
    with pytest.raises(CheckpointError, match=r"load_headed\(.*head_folder_path="):
        HeadedModel.from_pretrained(folder)

    again = headkit.load_headed(bb, head_configs=heads, head_folder_path=folder)
    trained, loaded = model.state_dict(), again.state_dict()
    assert trained.keys() == loaded.keys()
    assert all(torch.equal(trained[k], loaded[k]) for k in trained)  # backbone and head
    head_keys = [k for k in start if k.startswith("heads.sent.")]
    assert head_keys and all(not torch.equal(start[k], loaded[k]) for k in head_keys)
    assert any(not torch.equal(start[k], loaded[k]) for k in start if k.startswith("backbone."))
    batch = HeadedCollator(model)(_data(3))
    model.eval(), again.eval()
    with torch.no_grad():
        expected = model(**batch).logits
        assert torch.equal(again(**batch).logits, expected)
    again.save_pretrained(tmp_path / "alone")  # headkit's own checkpoint: loads alone
    alone = HeadedModel.from_pretrained(tmp_path / "alone").eval()
    with torch.no_grad():
        assert torch.equal(alone(**batch).logits, expected)

    other = [HeadConfig("other", num_outputs=2, pred_for_sequence=True, output_bias=True)]
    with pytest.raises(CheckpointError, match=r"2 missing \(heads\.other.*unexpected \(heads\.s"):
        headkit.load_headed(bb, head_configs=other, head_folder_path=folder)
    wider = [HeadConfig("sent", num_outputs=3, pred_for_sequence=True, output_bias=True)]
    with pytest.raises(CheckpointError, match=r"differ in shape.*\(2, \d+\) against \(3, "):
        headkit.load_headed(bb, head_configs=wider, head_folder_path=folder)
