"""Pairwise (reward) probes: which layer carries the reward? Preference pairs as TRL writes
them, a linear Bradley–Terry reward per layer scored by held-out pairwise accuracy, the
probe as a reward head that scores pairs as the probe did, ``headkit probe`` on a pairs
file, and the refusals."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tiny_text import WORDS, save_tiny_text_model

from headkit import ConfigError, probe_layers
from headkit.backbone.sources import source_tokenizer
from headkit.cli.datafiles import write_rows
from headkit.cli.main import main
from headkit.data.preferences import PreferenceCollator
from headkit.packaged import minilm_path, rotten_tomatoes
from headkit.probe.fit import _fit_softmax, standardise

pytestmark = pytest.mark.usefixtures("single_thread")


def review_pairs(n: int) -> list[dict]:
    """A fresh rotten-tomatoes snippet preferred to a rotten one, ``n`` pairs."""
    rows = rotten_tomatoes(limit=4 * n, seed=1)
    fresh = [t for t, y in rows if y == 1]
    rotten = [t for t, y in rows if y == 0]
    assert min(len(fresh), len(rotten)) >= n
    return [{"chosen": c, "rejected": r} for c, r in zip(fresh[:n], rotten[:n])]


def cue_pairs(n: int, seed: int = 0) -> list[dict]:
    """Tiny-vocabulary pairs whose chosen side holds the cue word "good"."""
    rng = random.Random(seed)

    def sentence(extra: str | None = None) -> str:
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 6))]
        if extra:
            words.insert(rng.randrange(len(words) + 1), extra)
        return " ".join(words)

    return [{"chosen": sentence("good"), "rejected": sentence()} for _ in range(n)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_text_model(tmp_path_factory.mktemp("tiny_bert"), num_layers=2)


@pytest.fixture(scope="module")
def minilm_pairs():
    pairs = review_pairs(200)
    return pairs, probe_layers(minilm_path(), pairs, layers="2,3", progress=False)


def reward_margins(model, tokenizer, pairs: list[dict]) -> torch.Tensor:
    """r(chosen) - r(rejected) of a reward head, batched as headkit's reward training does."""
    batch = PreferenceCollator(model, tokenizer)(pairs)
    batch.pop("labels", None)
    with torch.no_grad():
        scores = model(**{k: v for k, v in batch.items() if k != "probe"}).preds_by_head
    r = scores["probe"][:, 0].double()
    return r[: len(pairs)] - r[len(pairs) :]


def test_minilm_reward_probe_beats_chance(minilm_pairs) -> None:
    pairs, res = minilm_pairs
    assert (res.task, res.metric, res.baseline) == ("pairwise", "pairwise_accuracy", 0.5)
    assert res.n_train + res.n_test == len(pairs) and res.n_test == 40  # split by pair
    assert len(set(res.test_index)) == res.n_test
    best = res.best()
    assert best.score > 0.65 and best.ci95[0] > 0.5, res.table()
    assert best.metrics["mean_margin"] > 0
    margins = torch.tensor(best.predictions)
    assert best.score == pytest.approx(float((margins > 0).double().mean()))
    data = json.loads(res.to_json())
    row = data["rows"][0]
    assert {"pairwise_accuracy", "val_pairwise_accuracy", "mean_margin"} <= set(row)
    table = res.table()
    assert "pairwise_accuracy" in table and "mean margin" in table and "(chance)" in table


def test_to_headed_reward_head_scores_pairs_as_the_probe(minilm_pairs) -> None:
    pairs, res = minilm_pairs
    tokenizer = source_tokenizer(minilm_path())
    held = [pairs[i] for i in res.test_index]
    for layer in (None, 2):
        row = res.best() if layer is None else res.row(layer)
        model = res.to_headed(layer=layer)
        cfg = model.head_configs["probe"]
        assert (cfg.loss_fct, cfg.num_outputs, cfg.layer_hook) == ("bradley_terry", 1, row.layer)
        got = reward_margins(model, tokenizer, held)
        expected = torch.tensor(row.predictions, dtype=torch.float64)
        assert ((got > 0) == (expected > 0)).all()  # identical pairwise decisions
        assert torch.allclose(got, expected, atol=1e-4)


def test_mirrored_pairs_fit_no_bias() -> None:
    """Logistic regression on differences and their negations: the bias stays at 0, so the
    probe's decision is the reward difference's sign."""
    g = torch.Generator().manual_seed(0)
    diff = torch.randn(1, 60, 5, generator=g) + torch.tensor([0.8, 0, 0, 0, -0.3])
    x = torch.cat([diff, -diff], 1)
    (x,) = standardise(x)
    y = torch.cat([torch.ones(60), torch.zeros(60)]).long()[None]
    fit = torch.ones(1, 120)
    w, b = _fit_softmax(x, y, fit / 120, torch.tensor([1e-3, 1.0]), 2, 200, 1e-6, None)
    assert b.abs().max() < 1e-5
    assert (w[..., 1] - w[..., 0])[0, 0, 0, 0, 0] > 0  # feature 0 favours the chosen side


def test_prompt_is_prepended_and_pairs_too_long_are_dropped(tiny_dir) -> None:
    pairs = [{"prompt": "w1 w2 ", **p} for p in cue_pairs(60)]
    pairs[3]["chosen"] = " ".join(["w5"] * 40) + " good"  # too long: dropped as TRL does
    res = probe_layers(tiny_dir, pairs, layers="-1", max_length=20, progress=False)
    assert res.settings["pairs_dropped"] == 1
    assert 3 not in res.test_index and res.n_train + res.n_test == 59
    assert res.best().score > 0.7


def test_conversational_pairs_go_through_the_chat_template(tiny_dir) -> None:
    tokenizer = source_tokenizer(str(tiny_dir))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"

    def chat(text: str) -> list[dict]:
        return [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": text}]

    pairs = [{"chosen": chat(p["chosen"]), "rejected": chat(p["rejected"])} for p in cue_pairs(60)]
    res = probe_layers(tiny_dir, pairs, tokenizer=tokenizer, layers="-1", progress=False)
    assert res.task == "pairwise" and res.best().score > 0.7
    with pytest.raises(ConfigError, match="has no 'chosen' column"):
        probe_layers(tiny_dir, [{"rejected": chat("w1")}] * 10, task="pairwise", progress=False)


def test_refusals_name_the_value_and_what_is_allowed(tiny_dir) -> None:
    pairs = cue_pairs(20)
    with pytest.raises(ConfigError, match="has no 'rejected' column") as e:
        probe_layers(tiny_dir, [{"chosen": "w1"}] + pairs, progress=False)
    assert e.value.field == "rejected"
    with pytest.raises(ConfigError, match="row 2: chosen='  ' is empty"):
        probe_layers(tiny_dir, pairs[:2] + [{"chosen": "  ", "rejected": "w1"}], progress=False)
    with pytest.raises(ConfigError, match="got 5 preference pairs; .* at least 8"):
        probe_layers(tiny_dir, pairs[:5], progress=False)
    with pytest.raises(ConfigError, match="labels does not apply to preference pairs"):
        probe_layers(tiny_dir, pairs, [1] * 20, task="pairwise", progress=False)
    with pytest.raises(ConfigError, match="control does not apply .* no class to draw"):
        probe_layers(tiny_dir, pairs, control=True, progress=False)
    with pytest.raises(ConfigError, match="test_inputs does not apply .* holds out test_fr"):
        probe_layers(tiny_dir, pairs, test_inputs=pairs, progress=False)
    with pytest.raises(ConfigError, match="preference row 0 is a str"):
        probe_layers(tiny_dir, ["w1 w2"] * 10, task="pairwise", progress=False)
    with pytest.raises(ConfigError, match="0 of 20 preference pairs fit in max_length=5"):
        probe_layers(tiny_dir, pairs, max_length=5, progress=False)


def test_cli_probes_a_pairs_file_and_saves_a_reward_head(tiny_dir, tmp_path, capsys) -> None:
    pairs = cue_pairs(120, seed=2)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    head = tmp_path / "head"
    args = ["probe", "--model", str(tiny_dir), "--data", str(data), "--quiet"]
    assert main([*args, "--output", str(tmp_path / "p"), "--save", str(head)]) == 0
    assert "pairwise_accuracy" in capsys.readouterr().out
    results = json.loads((tmp_path / "p" / "probe_results.json").read_text())
    assert results["task"] == "pairwise" and results["metric"] == "pairwise_accuracy"
    shown = results["test_predictions"]
    best = [r for r in results["rows"] if r["layer"] == shown["layer"]][0]
    assert best["pairwise_accuracy"] > 0.7
    # the saved head on the held-out pairs: headkit eval's pairwise_accuracy is the probe's
    held = write_rows(tmp_path / "held.csv", [pairs[i] for i in shown["index"]])
    assert main(["eval", str(head), "--data", str(held), "--quiet"]) == 0
    assert f"{best['pairwise_accuracy']:.4f}" in capsys.readouterr().out


def test_cli_refuses_bad_pairs_files(tiny_dir, tmp_path, capsys) -> None:
    rows = cue_pairs(20)
    cases = {
        "no_rejected.csv": ([{"chosen": r["chosen"]} for r in rows], "has no 'rejected' column"),
        "empty.csv": (rows[:4] + [{"chosen": "w1", "rejected": ""}] + rows[4:], "rejected="),
    }
    for name, (content, message) in cases.items():
        data = write_rows(tmp_path / name, content)
        args = ["probe", "--model", str(tiny_dir), "--data", str(data), "--quiet"]
        assert main([*args, "--output", str(tmp_path / name / "out")]) == 2
        err = capsys.readouterr().err
        assert message in err and "chosen and rejected" in err, err
    data = write_rows(tmp_path / "pairs.csv", rows)
    args = ["probe", "--model", str(tiny_dir), "--data", str(data), "--control", "--quiet"]
    assert main([*args, "--output", str(tmp_path / "c")]) == 2
    assert "--control does not apply to preference pairs" in capsys.readouterr().err


def test_splits_keep_a_pair_and_its_mirror_together() -> None:
    from headkit.probe.data import split_rows
    from headkit.probe.pairs import mirrored

    n = 50
    features = {("mean", 1): torch.randn(2 * n, 4)}
    diffs, rows = mirrored(features, n)
    assert torch.equal(diffs[("mean", 1)][:n], -diffs[("mean", 1)][n:])
    split = split_rows(rows, 0.2, 0.2, 5, seed=3, folds=5)
    assert torch.equal(split["test"][:n], split["test"][n:]) and int(split["test"].sum()) == 20
    fit = split["fit"]  # (folds, training rows): a pair's two rows are fitted together
    train_pairs = int(split["train"][:n].sum())
    assert torch.equal(fit[:, :train_pairs], fit[:, train_pairs:])
