"""``headkit train``'s config: a schema (types, ranges, booleans only as booleans, dtypes by
name, unknown keys listed), a YAML loader with an alias budget, and ``--output`` in place of
``output:``. Every error is one line and exit status 2."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli_helpers import one_error_line, review_files, tiny_model, write_config

from headkit import ConfigError
from headkit.cli.main import main
from headkit.cli.train import DEFAULTS, load_train_config
from headkit.cli.train_config import ALIAS_BUDGET, load_yaml

pytestmark = pytest.mark.usefixtures("single_thread")

BASE = "model: m\nheads: [{name: h}]\ndata: {train: x.csv, label_columns: {h: label}}\noutput: o\n"


def _error(tmp_path: Path, text: str, capsys) -> str:
    config = tmp_path / "c.yaml"
    config.write_text(text)
    return one_error_line(main(["train", str(config), "--quiet"]), capsys.readouterr().err)


@pytest.mark.parametrize(
    "section, message",
    [
        ("training: {epochs: ten}", "training.epochs='ten' is invalid; allowed: an integer >= 1"),
        ("training: {epochs: 0}", "training.epochs=0 is invalid; allowed: an integer >= 1"),
        ("training: {epochs: 2.5}", "training.epochs=2.5 is invalid"),
        ("training: {epochs: true}", "training.epochs=True is invalid"),
        ("training: {lr: abc}", "training.lr='abc' is invalid; allowed: a finite number > 0"),
        ("training: {lr: 0}", "training.lr=0 is invalid; allowed: a finite number > 0"),
        ("training: {lr: .nan}", "training.lr=nan is invalid"),
        ("training: {seed: x}", "training.seed='x' is invalid; allowed: an integer 0.."),
        ("training: {max_length: 0}", "training.max_length=0 is invalid; allowed: an integer >= 1"),
        ("training: {batch_size: -3}", "training.batch_size=-3 is invalid"),
        (
            "training: {freeze_backbone: 'false'}",
            "training.freeze_backbone='false' is invalid; allowed: true or false (YAML booleans",
        ),
        ("training: {use_cached_features: maybe}", "training.use_cached_features='maybe'"),
        ("training: {validation_fraction: 1.5}", "training.validation_fraction=1.5 is invalid"),
        (
            "model_kwargs: {torch_dtype: bogus}",
            "model_kwargs.torch_dtype='bogus' is invalid; allowed: auto, bfloat16, float16, "
            "float32",
        ),
        (
            "training: {epoch: 3, lrate: 1}",
            "training: unknown key(s) ['epoch', 'lrate']; allowed: batch_size, bf16, "
            "calibrate, epochs, fp16, freeze_backbone, gradient_accumulation_steps, "
            "greater_is_better, lr,",
        ),
        (
            "training: {lr_schedule: step}",
            "training.lr_schedule='step' is invalid; allowed: constant, linear, cosine",
        ),
        (
            "training: {warmup_ratio: 1.0}",
            "training.warmup_ratio=1.0 is invalid; allowed: a number in [0, 1)",
        ),
        ("training: {warmup_steps: -1}", "training.warmup_steps=-1 is invalid"),
        (
            "training: {weight_decay: -0.1}",
            "training.weight_decay=-0.1 is invalid; allowed: a finite number >= 0",
        ),
        (
            "training: {max_grad_norm: 0}",
            "training.max_grad_norm=0 is invalid; allowed: a finite number > 0",
        ),
        (
            "training: {gradient_accumulation_steps: 0}",
            "training.gradient_accumulation_steps=0 is invalid; allowed: an integer >= 1",
        ),
        ("training: {bf16: 'yes'}", "training.bf16='yes' is invalid; allowed: true or false"),
        (
            "training: {report_to: [wandb]}",
            "training.report_to='wandb' is invalid; allowed: none, or a list of csv, tensorboard",
        ),
        (
            "training: {threshold: youden}",
            "training.threshold='youden' is invalid; allowed: none, f1 or accuracy",
        ),
        (
            "training: {bf16: true, fp16: true}",
            "training.bf16=true and training.fp16=true; allowed: one of them, or neither",
        ),
        (
            "training: {warmup_ratio: 0.1, warmup_steps: 5}",
            "training.warmup_ratio=0.1 and training.warmup_steps=5; allowed: one of them",
        ),
        (
            "training: {metric_for_best_model: f2}",
            "training.metric_for_best_model='f2' is invalid; allowed: accuracy, h_accuracy, "
            "h_loss, h_macro_f1, loss, macro_f1",
        ),
        ("heads: []", "heads=[] is invalid; allowed: a non-empty list of HeadConfig"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key_the_value_and_what_is_allowed(
    tmp_path, capsys, section, message
) -> None:
    text = BASE + section + "\n"
    if section.startswith("heads:"):
        text = BASE.replace("heads: [{name: h}]", section)
    assert message in _error(tmp_path, text, capsys)


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_data_limit_below_one_is_refused(tmp_path, capsys, limit) -> None:
    text = BASE.replace("label_columns: {h: label}", f"label_columns: {{h: label}}, limit: {limit}")
    line = _error(tmp_path, text, capsys)
    assert f"data.limit={limit} is invalid; allowed: an integer >= 1" in line


def test_every_problem_is_named_on_the_one_line(tmp_path, capsys) -> None:
    line = _error(tmp_path, BASE + "epochs: 3\ntraining: {lr: abc, seed: x}\n", capsys)
    assert "unknown key(s) ['epochs']; allowed: data, heads, model, model_kwargs, output" in line
    assert "training.lr='abc'" in line and "training.seed='x'" in line


def _bomb(levels: int = 8) -> str:
    """A head's ``extra`` of nested aliases: ``levels`` lists of 10 aliases to the level
    below, 10**levels leaves in all, in a few hundred bytes."""
    lines = ["a0: &a0 [l,l,l,l,l,l,l,l,l,l]"]
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]")
    return "extra: {" + ", ".join(lines) + "}"


@pytest.mark.timeout(60)  # without the budget this runs for minutes
def test_an_alias_bomb_is_refused_before_it_expands(tmp_path, capsys) -> None:
    text = BASE.replace("heads: [{name: h}]", "heads: [{name: h, " + _bomb() + "}]")
    assert len(text.encode()) < 600
    line = _error(tmp_path, text, capsys)
    assert re.search(r"its aliases \(\*name\) expand to 1\d\d,\d{3},\d{3} nodes", line)
    assert f"at most {ALIAS_BUDGET} more nodes than written" in line


def test_a_recursive_alias_is_refused_and_a_few_aliases_are_fine(tmp_path, capsys) -> None:
    line = _error(tmp_path, BASE + "model_kwargs: &k {loop: [*k]}\n", capsys)
    assert "a recursive alias" in line
    shared = tmp_path / "shared.yaml"
    shared.write_text("base: &b {pooling: mean, output_bias: true}\nheads: [*b, *b]\n")
    assert load_yaml(shared)["heads"] == [{"pooling": "mean", "output_bias": True}] * 2


def test_output_comes_from_the_option_when_the_config_has_none(tmp_path, capsys) -> None:
    model, data = tiny_model(tmp_path), review_files(tmp_path)
    config = write_config(tmp_path / "c.yaml", model, data["train"], "{epochs: 2}")
    line = one_error_line(main(["train", str(config), "--quiet"]), capsys.readouterr().err)
    assert "no output folder; set output: in the config or pass --output" in line
    assert main(["train", str(config), "--output", str(tmp_path / "out"), "--quiet"]) == 0
    assert (tmp_path / "out" / "head_configs.json").is_file()


def test_accepted_values(tmp_path) -> None:
    """``1e-3`` (text to PyYAML: no dot) is the number; ``auto`` and a missing key give the
    defaults by freeze_backbone; booleans and dtypes by name pass through."""
    config = tmp_path / "c.yaml"
    config.write_text(
        BASE + "model_kwargs: {torch_dtype: bfloat16, gguf_file: m.gguf}\n"
        "training: {lr: 1e-3, epochs: auto, freeze_backbone: false}\n"
    )
    loaded = load_train_config(config)
    assert loaded["training"]["lr"] == 1e-3
    assert loaded["training"]["epochs"] == DEFAULTS[False]["epochs"]
    assert loaded["model_kwargs"] == {"torch_dtype": "bfloat16", "gguf_file": "m.gguf"}
    config.write_text(BASE)
    loaded = load_train_config(config, output="elsewhere")
    assert loaded["training"]["lr"] == DEFAULTS[True]["lr"] and loaded["output"] == "elsewhere"
    with pytest.raises(ConfigError, match="does not exist"):
        load_train_config(tmp_path / "missing.yaml")
