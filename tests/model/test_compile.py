"""torch.compile(HeadedModel, fullgraph=True) gives one graph that matches eager (benchmark
scenario i times it), and the guards' rules on the CPU (guards.py): value checks on every CPU
batch, the non-finite guard at once."""

from __future__ import annotations

import copy

import pytest
import torch

from headkit import HeadConfig, HeadedModel
from headkit.errors import BatchError, NonFiniteLossError
from headkit.model.guards import ValueChecks

pytestmark = pytest.mark.slow


def _heads(layer: int) -> list[HeadConfig]:
    return [
        HeadConfig("tags", layer_hook=layer, num_outputs=5),
        HeadConfig("cls", layer_hook=layer, num_outputs=2, pred_for_sequence=True, pooling="mean"),
        HeadConfig("score", layer_hook=layer, is_regression=True, loss_fct="mse"),
    ]


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (3, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "tags": torch.randint(0, 5, (3, 10), generator=g),
        "cls": torch.randint(0, 2, (3,), generator=g),
        "score": torch.randn(3, 10, generator=g),
    }


# Each architecture once, full depth and early exit each covered (a dynamo trace costs ~5 s;
# the train step below compiles GPT-2 with early exit).
@pytest.mark.parametrize("arch, layer", [("gpt2", -1), ("llama", 1), ("bert", 1)])
def test_compiles_as_one_graph_and_matches_eager(make_tiny, arch: str, layer: int) -> None:
    torch._dynamo.reset()
    model = HeadedModel(make_tiny(arch), _heads(layer), check_inputs=False).eval()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    batch = _batch()
    got, want = compiled(**batch), model(**batch)
    for name in want.preds_by_head:
        torch.testing.assert_close(got.preds_by_head[name], want.preds_by_head[name])
    torch.testing.assert_close(got.loss, want.loss)
    assert got.hidden_states is None  # (read inside the graph, not handed out unasked)


def test_a_compiled_train_step_learns_like_eager(tiny_gpt2) -> None:
    torch._dynamo.reset()
    eager = HeadedModel(tiny_gpt2, _heads(1), check_inputs=False).train()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True, backend="eager")
    batch = _batch(1)
    for m in (eager, compiled):
        m(**batch).loss.backward()
    for (n, p), q in zip(eager.heads.named_parameters(), twin.heads.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=n)


def test_value_checks_run_on_every_cpu_batch() -> None:
    checks = ValueChecks()
    batch = _batch()
    for _ in range(3):
        key = checks.due(batch)
        assert key is not None
        checks.passed(key)
    assert copy.deepcopy(checks).due(batch) is not None


def test_off_the_cpu_values_are_checked_once_per_batch_signature(tiny_bert) -> None:
    """The accelerator rule, run on the CPU: the first batch of each signature is checked."""
    checks = ValueChecks()
    checks.every_batch_devices = ()
    batch = _batch()
    key = checks.due(batch)
    assert key is not None and checks.due(batch) is not None  # not yet passed: checked
    checks.passed(key)
    assert checks.due(batch) is None and checks.due(_batch(1)) is None  # same signature
    assert checks.due({**batch, "cls": batch["cls"].int()}) is not None  # another dtype
    model = HeadedModel(tiny_bert, _heads(-1))
    model._value_checks.every_batch_devices = ()
    bad = _batch()
    bad["tags"][0, 0] = 7
    for _ in range(2):  # a batch that fails leaves its signature unchecked-for
        with pytest.raises(BatchError, match="class index 7 is out of range"):
            model(**bad)
    model(**_batch())  # this one passes: the signature is known...
    shorter = {k: v[:2] for k, v in bad.items()}
    with pytest.raises(BatchError, match="class index 7 is out of range"):
        model(**shorter)  # ...a new shape is checked again


def test_a_bad_label_in_a_later_cpu_batch_of_the_same_shape_is_still_caught(tiny_bert) -> None:
    model = HeadedModel(tiny_bert, _heads(-1))
    batch = _batch()
    model(**batch)
    batch["tags"][0, 0] = 7
    with pytest.raises(BatchError, match="class index 7 is out of range"):
        model(**batch)


def test_the_cpu_guard_raises_at_once_and_skip_leaves_the_head_out(tiny_bert) -> None:
    model = HeadedModel(tiny_bert, _heads(-1))
    batch = _batch()
    batch["score"][0, 0] = 1e30  # float32 overflow in the squared error: an infinite loss
    with pytest.raises(NonFiniteLossError, match="head 'score'"):
        model(**batch)
    model.nonfinite_loss = "skip"
    with pytest.warns(UserWarning, match="non-finite loss skipped"):
        out = model(**batch)
    assert set(out.adapted_loss_by_head) == {"tags", "cls"} and torch.isfinite(out.loss)


def test_a_deferred_guard_raises_at_the_next_forward_naming_the_head(tiny_bert) -> None:
    """The CUDA path of the guard, run on the CPU: the losses are read one step late."""
    model = HeadedModel(tiny_bert, _heads(-1))
    model._guard.deferred_devices = ("cpu",)
    bad, good = _batch(), _batch()
    bad["score"][0, 0] = 1e30  # an infinite squared error
    out = model(**bad)  # nothing read yet: the loss comes back as computed
    assert not torch.isfinite(out.loss)
    with pytest.raises(NonFiniteLossError, match=r"head 'score' produced a non-finite loss in an"):
        model(**good)
    out = model(**good)  # the flags were read: training goes on
    assert torch.isfinite(out.loss)
    model(**bad)
    twin = copy.deepcopy(model)  # a copy does not inherit what the original has yet to read
    assert torch.isfinite(twin(**good).loss)
    with pytest.raises(NonFiniteLossError):
        model._guard.check_pending(wait=True)
