"""No host-device synchronisation in a headed forward on CUDA (benchmark scenario h
measures what it costs).

The per-batch input and label checks must run on data already on the host, or once per
shape, never by reading a CUDA tensor back (``int(t.max())``, ``bool(t.any())``,
``.item()``) on every batch: each such read stalls the GPU queue. Syncs are counted with
``torch.cuda.set_sync_debug_mode`` (in "warn" mode, so every site is listed, not only the
first); the first call per shape may sync.
"""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch

from headkit import HeadConfig, HeadedModel

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs a CUDA device (counts host-device syncs with set_sync_debug_mode)",
    ),
]


def _syncs(fn) -> list[str]:
    """Every synchronising CUDA call ``fn`` makes, as "file:line: message"."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # headkit's own: transformers' mask code may read the mask (``padding_mask.all()``) itself
    return [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if "synchron" in str(w.message) and f"{os.sep}headkit{os.sep}" in w.filename
    ]


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
@pytest.mark.parametrize("layer", [-1, 1])
def test_headed_forward_does_not_sync(make_tiny, arch: str, layer: int) -> None:
    kw = {}
    if "check_inputs" in inspect.signature(HeadedModel.__init__).parameters:
        kw["check_inputs"] = True
    heads = [
        HeadConfig("tags", layer_hook=layer, num_outputs=5),
        HeadConfig("cls", layer_hook=layer, num_outputs=2, pred_for_sequence=True, pooling="mean"),
        HeadConfig("score", layer_hook=layer, is_regression=True, loss_fct="mse"),
    ]
    model = HeadedModel(make_tiny(arch).cuda(), heads, **kw).train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 100, (4, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    batch = {
        "input_ids": ids,
        "attention_mask": mask,
        "tags": torch.randint(0, 5, (4, 12), generator=g),
        "cls": torch.randint(0, 2, (4,), generator=g),
        "score": torch.randn(4, 12, generator=g),
    }
    batch = {k: v.cuda() for k, v in batch.items()}

    def step() -> None:
        model(**batch).loss.backward()

    step()  # the first call per shape may check on the host
    syncs = _syncs(step)
    syncs += _syncs(step)  # and the next, which reads the first one's loss flags
    assert not syncs, f"{len(syncs)} host-device syncs in a headed forward:\n" + "\n".join(syncs)
