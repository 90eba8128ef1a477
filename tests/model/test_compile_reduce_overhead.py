"""``torch.compile(model, mode="reduce-overhead")`` with many heads: CUDA graphs replay a whole
train step as one launch, so small batches stop paying a launch per operation.

CUDA graphs need one graph with no host reads and no graph breaks, forward and backward. On the
CPU that is what is tested (dynamo's full graph and AOTAutograd's joint forward-backward graph,
which a CUDA graph records; inductor's code generation is left out: on 2 CPU cores it takes
minutes, and it records no CUDA graph there). With a GPU, the ``gpu`` test records and replays
the graphs and checks that none was skipped. docs/training.md says when to use it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build_tiny

from headkit import HeadConfig, HeadedModel

pytestmark = pytest.mark.slow


def _heads(n: int) -> list[HeadConfig]:
    """``n`` mean-pooled sequence heads, token heads (CE, MSE) and a regression head."""
    seq = [
        HeadConfig(f"s{i}", num_outputs=2, pred_for_sequence=True, pooling="mean", target="cls")
        for i in range(n)
    ]
    return [
        *seq,
        HeadConfig("tags", num_outputs=5),
        HeadConfig("level", num_outputs=1, is_regression=True, loss_fct="mse"),  # masked: pads
        HeadConfig("score", num_outputs=1, pred_for_sequence=True, is_regression=True,
                   loss_fct="mse", pooling="mean"),
    ]  # fmt: skip


def _batch(device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (4, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "cls": torch.randint(0, 2, (4,), generator=g),
        "tags": torch.randint(0, 5, (4, 10), generator=g),
        "score": torch.randn(4, generator=g),
        "level": torch.randn(4, 10, generator=g),
    }
    return {k: v.to(device) for k, v in batch.items()}


def _train_steps(model: HeadedModel, steps: int, device: str) -> list[torch.Tensor]:
    """``steps`` SGD steps on fresh batches; the losses of each (copied out of the step)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    for step in range(steps):
        torch.compiler.cudagraph_mark_step_begin()  # a new step: the last outputs may be reused
        out = model(**_batch(device, step))
        losses.append(out.loss.detach().clone())
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_a_train_step_with_many_heads_traces_as_one_joint_graph(arch: str) -> None:
    torch._dynamo.reset()
    eager = HeadedModel(build_tiny(arch), _heads(6), check_inputs=False).train()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")  # breaks would raise
    for a, b in zip(_train_steps(eager, 3, "cpu"), _train_steps(compiled, 3, "cpu")):
        torch.testing.assert_close(a, b)
    for (name, p), q in zip(eager.heads.named_parameters(), twin.heads.parameters()):
        torch.testing.assert_close(p, q, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CUDA graphs)")
def test_reduce_overhead_replays_cuda_graphs_and_learns_like_eager() -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = HeadedModel(build_tiny("llama").cuda(), _heads(6), check_inputs=False).train()
    twin = copy.deepcopy(eager)
    compiled = torch.compile(twin, mode="reduce-overhead", fullgraph=True)
    for a, b in zip(_train_steps(eager, 4, "cuda"), _train_steps(compiled, 4, "cuda")):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for (name, p), q in zip(eager.heads.named_parameters(), twin.heads.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
