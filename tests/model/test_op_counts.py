"""A head costs its own work and nothing else, counted in aten operations (deterministic, so a
regression fails here; ``benchmarks/bench_op_counts.py`` reports the same counts as figures).

On a GPU each operation is a kernel launch: with 25 heads, 30 operations of bookkeeping per head
were 750 launches a step. Counted with ``benchmarks/_ops.py``'s ``OpCounter`` (view-like
operations left out: they launch nothing).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _ops  # noqa: E402

from headkit import HeadConfig, HeadedModel  # noqa: E402


@pytest.mark.parametrize("arch", _ops.ARCHS)
@pytest.mark.parametrize("kind", _ops.KINDS)
def test_an_extra_head_adds_at_most_its_own_operations(arch: str, kind: str) -> None:
    counted = _ops.per_extra_head(arch, kind, n_heads=3)
    # a Linear, its loss, the mean over what counts, the total, and their gradients: 8 to 10
    assert counted["per_extra_head"] <= _ops.MAX_OPS_PER_EXTRA_HEAD, counted
    # once the heads share one loss call: the Linear, its weight gradient, a row sum, an add
    assert counted["per_stacked_head"] <= _ops.MAX_OPS_PER_STACKED_HEAD, counted
    assert counted["host_reads_per_extra_head"] == 0, counted
    # labels are checked, masked and counted once per target, not once per head
    assert not {"where", "bitwise_and", "scalar_tensor", "ones"} & set(counted["extra_ops"])


def test_heads_on_one_target_with_different_rules_each_count_their_labels() -> None:
    """Sharing is per (target, rule, mask, shape): a token head that counts padding and one
    that skips it read the same labels differently, and each gets its own loss."""
    heads = [
        HeadConfig("skips", num_outputs=3, target="t"),
        HeadConfig("counts", num_outputs=3, target="t", ignore_pads=False),
    ]
    model = HeadedModel(_ops.build_model("gpt2"), heads)
    data = _ops.batch()
    out = model(input_ids=data["input_ids"], attention_mask=data["attention_mask"], t=data["t"])
    keep = data["attention_mask"].bool()
    for name, rows in (("skips", keep), ("counts", torch.ones_like(keep))):
        preds = out.preds_by_head[name]
        want = torch.nn.functional.cross_entropy(preds[rows], data["t"][rows])
        torch.testing.assert_close(out.loss_by_head[name], want)


@pytest.mark.parametrize("arch", _ops.DECODERS)
def test_a_decode_step_costs_the_backbones_plus_the_heads_matmuls(arch: str) -> None:
    step = _ops.decode_step_ops(arch, first=2, more=4)
    assert step["headed"] <= step["allowed"], step
    assert step["headed"] - step["head_matmuls"] <= _ops.MAX_DECODE_STEP_FACTOR * step["backbone"]


def test_log_probabilities_computed_in_batches_equal_those_of_every_step(monkeypatch) -> None:
    """A step only keeps its logits; their log-probabilities are computed together, in batches
    of at most ``MAX_PENDING_LOGITS`` elements: the batching changes no value."""
    from headkit.generation import recording

    model = _ops.headed_for_generation(_ops.build_model("llama"))
    settings = {"max_new_tokens": 7, "do_sample": False, "eos_token_id": None, "pad_token_id": 2}
    whole = model.generate(**_ops.prompts(), **settings)
    per_step = _ops.BATCH * _ops.VOCAB  # one step's logits: a batch every step, then every 3
    for steps in (1, 3):
        monkeypatch.setattr(recording, "MAX_PENDING_LOGITS", steps * per_step)
        batched = model.generate(**_ops.prompts(), **settings)
        assert torch.equal(batched.sequences, whole.sequences)
        assert torch.equal(batched.token_logprobs, whole.token_logprobs)
    logits = model(**_ops.prompts()).preds_by_head["lm_head"][:, -1].float()
    first = whole.sequences[:, 6:7]
    want = logits.log_softmax(-1).gather(-1, first).squeeze(-1)
    torch.testing.assert_close(whole.token_logprobs[:, 0], want)
