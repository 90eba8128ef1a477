"""Numbers a probe is given are checked: L2 penalties finite and positive, regression targets
finite and varying; R^2 stays finite for large (finite) targets."""

from __future__ import annotations

import math

import pytest
from tiny_text import planted_texts, save_tiny_text_model

from headkit import ConfigError, probe_layers
from headkit.cli.main import main


@pytest.fixture(autouse=True)
def _one_thread(single_thread):
    """Tiny models gain nothing from more threads on a shared machine."""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_text_model(tmp_path_factory.mktemp("tiny_bert"), num_layers=2)


@pytest.mark.parametrize(
    "l2", [[math.nan], [math.inf], [0.0], [-1.0], [1e-2, math.nan], [], [True], 0.1]
)
def test_a_penalty_that_is_not_finite_and_positive_is_refused_before_loading(l2) -> None:
    """The model path does not exist: the check comes first, so the error is about l2."""
    with pytest.raises(ConfigError, match=r"l2=.* is invalid; allowed: one or more finite"):
        probe_layers("/nonexistent/model", ["a b", "c d"], [0, 1], l2=l2, progress=False)


@pytest.mark.parametrize("value", ["nan", "1e400", "inf", "0", "-1", "1e-3,nan", "x"])
def test_the_l2_option_refuses_them_too(value, capsys) -> None:
    args = ["probe", "--model", "m", "--data", "d.csv", "--output", "o", "--l2", value]
    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"argument --l2: invalid value {value!r}; allowed: comma-separated finite" in err


def test_constant_regression_targets_are_refused(tiny_dir) -> None:
    texts, _, _ = planted_texts(60)
    with pytest.raises(ConfigError, match="every regression label is 3.0; R\\^2 needs targets"):
        probe_layers(tiny_dir, texts, [3.0] * 60, task="regression", progress=False)
    with pytest.raises(ConfigError, match="must be finite numbers; 1 are not"):
        probe_layers(tiny_dir, texts, [1.0] * 59 + [math.inf], task="regression", progress=False)


def test_a_constant_test_split_is_refused(tiny_dir) -> None:
    texts, _, scores = planted_texts(80)
    test_texts, _, _ = planted_texts(20, seed=3)
    with pytest.raises(ConfigError, match="the 20 held-out regression labels are all equal"):
        probe_layers(
            tiny_dir,
            texts,
            scores,
            test_inputs=test_texts,
            test_labels=[2.0] * 20,
            task="regression",
            progress=False,
        )


@pytest.mark.parametrize("scale", [1e30, 1e300])
def test_r2_of_large_targets_is_that_of_the_same_targets_scaled_down(tiny_dir, scale) -> None:
    """R^2 does not change when the targets are multiplied by a constant: huge (finite)
    targets give the scores of small ones, not NaN."""
    texts, _, scores = planted_texts(120)
    small = probe_layers(tiny_dir, texts, scores, task="regression", progress=False)
    large = probe_layers(
        tiny_dir, texts, [s * scale for s in scores], task="regression", progress=False
    )
    assert math.isfinite(large.baseline)
    for a, b in zip(small.rows, large.rows):
        assert math.isfinite(b.score) and b.score == pytest.approx(a.score, abs=1e-4)
        assert b.ci95 == pytest.approx(a.ci95, abs=1e-4)
