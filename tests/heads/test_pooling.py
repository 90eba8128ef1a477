"""Every pooling strategy against an explicit per-row reference, on every padding layout.

The reference loops over rows in Python, keeps only the real tokens of each row (read from
the mask) and pools them with the textbook formula, so a mistake in headkit's vectorised
masking cannot hide behind the same mistake in the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import build_tiny, tiny_config
from transformers import PreTrainedModel
from transformers.models.bert.modeling_bert import BertPooler

from headkit import POOLINGS, ConfigError, HeadConfig, HeadedModel, SequencePooling
from headkit.errors import BatchError
from headkit.heads.pooling import parse_pooling

HIDDEN = 16
STRATEGIES = POOLINGS.names()  # every registered strategy, including "pooler"
LENGTHS = [5, 1, 3, 6]  # real tokens per row; seq = 6


# ---------------------------------------------------------------------- helpers
def _mask(lengths: list[int], seq: int, side: str) -> torch.Tensor:
    mask = torch.zeros(len(lengths), seq, dtype=torch.long)
    for b, n in enumerate(lengths):
        if side == "right":
            mask[b, :n] = 1
        else:
            mask[b, seq - n :] = 1
    return mask


def _hidden(mask: torch.Tensor, pad_value: float = 1e6, seed: int = 0) -> torch.Tensor:
    """Random states with ``pad_value`` at padded positions (huge: must never win a max)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(*mask.shape, HIDDEN, generator=g)
    return torch.where(mask.bool().unsqueeze(-1), h, torch.full_like(h, pad_value))


def _bert_pooler() -> BertPooler:
    torch.manual_seed(0)
    return BertPooler(tiny_config("bert", hidden_size=HIDDEN)).eval()


def _reference(name: str, real: torch.Tensor, pool: SequencePooling, pooler) -> torch.Tensor:
    """Pool one row's real tokens ``real`` (n, hidden) by the textbook formula, in float64."""
    x = real.double()
    n = x.shape[0]
    if name == "last":
        return x[-1]
    if name == "first":
        return x[0]
    if name in ("mean", "patch_mean"):  # patch_mean: special_tokens=0, nothing skipped
        return x.sum(0) / n
    if name == "mean_sqrt_len":
        return x.sum(0) / math.sqrt(n)
    if name == "max":
        return torch.tensor([max(x[:, j].tolist()) for j in range(x.shape[1])], dtype=x.dtype)
    if name == "weighted_mean":
        w = [float(i + 1) for i in range(n)]
        return sum(wi * xi for wi, xi in zip(w, x)) / sum(w)
    if name == "attention":
        lin = pool.strategies["attention"].score
        s = [float(xi @ lin.weight[0].double() + lin.bias.double()) for xi in x]
        e = [math.exp(si - max(s)) for si in s]
        return sum(ei / sum(e) * xi for ei, xi in zip(e, x))
    if name == "pooler":
        dense = pooler.dense
        return torch.tanh(x[0] @ dense.weight.double().T + dense.bias.double())
    raise AssertionError(f"no reference for {name!r}")


def _real_rows(hidden: torch.Tensor, mask: torch.Tensor | None) -> list[torch.Tensor]:
    if mask is None:
        return list(hidden)
    return [hidden[b][mask[b].bool()] for b in range(hidden.shape[0])]


LAYOUTS = {
    "right_padding": (LENGTHS, "right"),
    "left_padding": (LENGTHS, "left"),
    "one_token_rows": ([1, 1, 1], "right"),
    "one_token_left": ([1, 3, 1], "left"),
    "no_mask": (None, None),
}


# ---------------------------------------------------------------------- values
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_matches_per_row_reference(name: str, layout: str) -> None:
    lengths, side = LAYOUTS[layout]
    torch.manual_seed(1)
    pooler = _bert_pooler()
    pool = SequencePooling([name], HIDDEN, HIDDEN, pooler, special_tokens=0)
    if lengths is None:
        mask = None
        hidden = torch.randn(3, 4, HIDDEN)
    else:
        mask = _mask(lengths, max(max(lengths), 2), side)
        hidden = _hidden(mask)
    with torch.no_grad():
        got = pool(hidden, mask)
        expected = torch.stack(
            [_reference(name, r, pool, pooler) for r in _real_rows(hidden, mask)]
        )
    assert got.shape == (hidden.shape[0], HIDDEN)
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_max_never_picks_padding_even_when_padding_is_larger() -> None:
    mask = _mask(LENGTHS, 6, "right")
    hidden = _hidden(mask, pad_value=1e30)
    got = SequencePooling(["max"], HIDDEN)(hidden, mask)
    assert bool((got < 1e3).all()), "a padded position (1e30) won the max"
    # Every value of the result is one of that row's real values.
    for b, real in enumerate(_real_rows(hidden, mask)):
        assert bool((real == got[b]).any(0).all())


@pytest.mark.parametrize("name", STRATEGIES)
def test_nan_and_inf_at_padded_positions_do_not_leak(name: str) -> None:
    mask = _mask(LENGTHS, 6, "left")
    clean = _hidden(mask, pad_value=0.0)
    dirty = clean.clone()
    dirty[~mask.bool()] = float("nan")
    dirty[0, 0] = float("inf")  # row 0 has one padded position on the left
    pool = SequencePooling([name], HIDDEN, HIDDEN, _bert_pooler(), special_tokens=0)
    with torch.no_grad():
        got = pool(dirty, mask)
        want = pool(clean, mask)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("name", STRATEGIES)
def test_batch_result_equals_each_row_pooled_alone(name: str) -> None:
    """Vectorised: pooling a padded batch equals pooling each unpadded row on its own."""
    mask = _mask(LENGTHS, 6, "right")
    hidden = _hidden(mask)
    pool = SequencePooling([name], HIDDEN, HIDDEN, _bert_pooler(), special_tokens=0)
    with torch.no_grad():
        batch = pool(hidden, mask)
        rows = [pool(r.unsqueeze(0), None)[0] for r in _real_rows(hidden, mask)]
    torch.testing.assert_close(batch, torch.stack(rows), atol=1e-6, rtol=1e-6)


def test_all_padding_row_gives_zeros_for_reductions() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    hidden = _hidden(mask)
    for name in ("mean", "mean_sqrt_len", "max", "weighted_mean", "attention"):
        out = SequencePooling([name], HIDDEN)(hidden, mask)
        assert torch.equal(out[1], torch.zeros(HIDDEN)), name


# ---------------------------------------------------------------------- no writes
@pytest.mark.parametrize("name", STRATEGIES)
def test_pooling_never_writes_into_hidden_states(name: str) -> None:
    mask = _mask(LENGTHS, 6, "right")
    leaf = _hidden(mask).requires_grad_(True)
    hidden = leaf * 1.0  # a non-leaf: an in-place write would bump its version counter
    before, version = hidden.detach().clone(), hidden._version
    mask_before = mask.clone()
    pool = SequencePooling([name], HIDDEN, HIDDEN, _bert_pooler(), special_tokens=0)
    out = pool(hidden, mask)
    assert hidden._version == version, "pooling modified the hidden states in place"
    assert torch.equal(hidden.detach(), before)
    assert torch.equal(mask, mask_before)
    out.sum().backward()  # autograd would raise if a saved tensor had been modified
    assert torch.equal(leaf.grad[~mask.bool()], torch.zeros_like(leaf.grad[~mask.bool()])), (
        "padded positions received gradient"
    )
    assert bool(leaf.grad[mask.bool()].abs().sum() > 0)


def test_half_precision_input_is_pooled_in_float32_and_accurately() -> None:
    """Averages of half-precision states come back in float32 (a mean_sqrt_len of 4,096
    tokens of 2,000 is 128,000, beyond float16's range); selections keep their dtype."""
    mask = _mask(LENGTHS, 6, "left")
    hidden = _hidden(mask, pad_value=0.0) * 100
    pool = SequencePooling(["mean", "weighted_mean", "max"], HIDDEN)
    got = pool(hidden.half(), mask)
    assert got.dtype == torch.float32
    assert SequencePooling(["max"], HIDDEN)(hidden.half(), mask).dtype == torch.float16
    torch.testing.assert_close(got.float(), pool(hidden, mask), atol=0.1, rtol=2e-3)


# ---------------------------------------------------------------------- names and errors
def test_names_aliases_and_errors() -> None:
    assert parse_pooling("CLS + Mean") == ["first", "mean"]
    with pytest.raises(ConfigError, match=r"'avg' is not a known pooling strategy.*mean"):
        parse_pooling("mean+avg")
    with pytest.raises(ConfigError, match="repeats"):
        parse_pooling("mean+mean")
    with pytest.raises(ConfigError, match="pred_for_sequence"):
        HeadConfig(name="tok", pooling="mean")
    pool = SequencePooling(["mean"], HIDDEN)
    with pytest.raises(BatchError, match=r"attention_mask of shape \(2, 5\)"):
        pool(torch.zeros(2, 6, HIDDEN), torch.ones(2, 5))
    with pytest.raises(ConfigError, match="pooler"):
        SequencePooling(["pooler"], HIDDEN)(torch.zeros(1, 2, HIDDEN), None)


# ---------------------------------------------------------------------- in HeadedModel
def _gpt2() -> PreTrainedModel:
    return build_tiny("gpt2", num_layers=2, task="base")


def _llama() -> PreTrainedModel:
    return build_tiny("llama", num_layers=2, task="base")


def _bert(pooling_layer: bool = True) -> PreTrainedModel:
    return build_tiny("bert", num_layers=2, model_kwargs={"add_pooling_layer": pooling_layer})


def _seq_head(name: str, **kw) -> HeadConfig:
    kw.setdefault("num_outputs", 3)
    return HeadConfig(name=name, pred_for_sequence=True, **kw)


def test_defaults_last_for_decoders_first_for_encoders() -> None:
    for backbone, want in ((_gpt2(), "last"), (_llama(), "last"), (_bert(), "first")):
        model = HeadedModel(backbone, [_seq_head("s")])
        assert model.head_configs["s"].pooling == want, type(backbone).__name__
        assert model.heads["s"].pooling.names == [want]


def test_pooler_without_a_backbone_pooler_is_a_config_error() -> None:
    for backbone in (_gpt2(), _bert(pooling_layer=False)):
        with pytest.raises(ConfigError, match=r"pooling='pooler' needs the backbone's pooler"):
            HeadedModel(backbone, [_seq_head("s", pooling="pooler")])
    model = HeadedModel(_bert(), [_seq_head("s", pooling="pooler")])
    assert model.heads["s"].pooling.out_size == 32


def test_concatenation_doubles_width_and_keeps_in_size() -> None:
    backbone = _gpt2()
    model = HeadedModel(backbone, [_seq_head("s", pooling="mean+max", layer_hook=1)])
    head = model.heads["s"]
    width = backbone.config.n_embd
    assert model.head_configs["s"].in_size == width  # the hooked layer's width
    assert head.pooling.out_size == 2 * width
    assert head.linears[0].in_features == 2 * width
    ids = torch.randint(1, 100, (3, 5))
    mask = _mask([5, 2, 4], 5, "right")
    with torch.no_grad():
        preds = model(input_ids=ids, attention_mask=mask).preds_by_head["s"]
        states = backbone(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        h = states.hidden_states[1]
        rows = _real_rows(h, mask)
        feats = torch.stack([torch.cat([r.mean(0), r.max(0).values]) for r in rows])
        lin = head.linears[0]
    assert preds.shape == (3, 3)
    torch.testing.assert_close(preds, feats @ lin.weight.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_decoder_heads_agree_across_padding_sides(make) -> None:
    """Left padding, right padding and unpadded rows give the same prediction per strategy."""
    names = [n for n in STRATEGIES if n not in ("pooler", "patch_mean")]  # text decoders
    model = HeadedModel(make(), [_seq_head(n, pooling=n) for n in names]).eval()
    torch.manual_seed(3)
    lengths = [4, 1, 6]
    seqs = [torch.randint(1, 100, (n,)) for n in lengths]

    def batch(side: str) -> dict:
        mask = _mask(lengths, 6, side)
        ids = torch.zeros(len(lengths), 6, dtype=torch.long)
        ids[mask.bool()] = torch.cat(seqs)
        return {"input_ids": ids, "attention_mask": mask}

    with torch.no_grad():
        right = model(**batch("right")).preds_by_head
        left = model(**batch("left")).preds_by_head
        alone = [model(input_ids=s.unsqueeze(0)).preds_by_head for s in seqs]
    for n in names:
        per_row = torch.cat([a[n] for a in alone])
        torch.testing.assert_close(right[n], per_row, atol=1e-5, rtol=1e-5, msg=n)
        torch.testing.assert_close(left[n], per_row, atol=1e-5, rtol=1e-5, msg=n)


def test_attention_pooling_is_trained_and_saved_with_the_head(tmp_path) -> None:
    model = HeadedModel(_bert(), [_seq_head("s", pooling="attention+mean", num_outputs=2)])
    score = model.heads["s"].pooling.strategies["attention"].score
    assert {"heads.s.pooling.strategies.attention.score.weight"} <= set(model.head_state_dict())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "heads.s.pooling.strategies.attention.score.weight" in trainable
    assert not any(n.startswith("backbone.") for n in trainable)

    torch.manual_seed(0)
    ids = torch.randint(1, 100, (4, 6))
    mask = _mask([6, 3, 2, 5], 6, "right")
    labels = torch.tensor([0, 1, 1, 0])
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.05)
    w0 = score.weight.detach().clone()
    model.train()
    for _ in range(3):
        opt.zero_grad()
        out = model(input_ids=ids, attention_mask=mask, s=labels)
        out.loss.backward()
        assert score.weight.grad is not None and bool(score.weight.grad.abs().sum() > 0)
        opt.step()
    assert not torch.equal(score.weight.detach(), w0)

    model.eval()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).preds_by_head["s"]
    model.save_pretrained(tmp_path / "ckpt")
    loaded = HeadedModel.from_pretrained(tmp_path / "ckpt").eval()
    loaded_score = loaded.heads["s"].pooling.strategies["attention"].score
    assert torch.equal(loaded_score.weight, score.weight.detach())
    with torch.no_grad():
        after = loaded(input_ids=ids, attention_mask=mask).preds_by_head["s"]
    torch.testing.assert_close(after, before, atol=0, rtol=0)


# ---------------------------------------------------------------------- the example
def test_compare_pooling_example_runs_end_to_end(tmp_path, monkeypatch) -> None:
    """examples/compare_pooling.py on 40 MiniLM texts and 2 layers (keeps it from rotting)."""
    import csv
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "compare_pooling.py"
    spec = importlib.util.spec_from_file_location("compare_pooling", path)
    example = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, example)  # dataclasses look it up there
    spec.loader.exec_module(example)
    csv_path, png_path = tmp_path / "cmp.csv", tmp_path / "cmp.png"
    args = ["--models", "minilm", "--minilm-train", "30", "--minilm-test", "10"]
    args += ["--layers", "2,-1"]
    args += ["--csv", str(csv_path), "--png", str(png_path), "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        results = example.main(args)
    finally:
        torch.set_num_threads(threads)

    strategies = {"first", "last", "mean", "max", "mean_sqrt_len", "weighted_mean", "pooler"}
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(results["minilm"].rows) == 2 * len(strategies)
    assert {r["strategy"] for r in rows} == strategies
    assert {r["layer"] for r in rows} == {"2", "6"}
    assert all(0.0 <= float(r["accuracy"]) <= 1.0 for r in rows)
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
