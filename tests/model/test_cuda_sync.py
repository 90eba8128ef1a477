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


def _image_and_audio_batches(g: torch.Generator) -> dict[str, dict[str, torch.Tensor]]:
    from conftest import IMAGE_SIZE, IMAGE_TOKEN

    ids = torch.cat(
        [
            torch.ones(2, 1, dtype=torch.long),
            torch.full((2, 16), IMAGE_TOKEN),
            torch.randint(4, 40, (2, 3), generator=g),
        ],
        1,
    )
    audio_mask = torch.ones(2, 800, dtype=torch.long)
    audio_mask[1, 500:] = 0
    return {
        "vit": {"pixel_values": torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)},
        "wav2vec2": {
            "input_values": torch.randn(2, 800, generator=g),
            "attention_mask": audio_mask,
        },
        "bert": {"inputs_embeds": torch.randn(2, 6, 32, generator=g)},
        "t5": {
            "input_ids": torch.randint(3, 90, (2, 5), generator=g),
            "decoder_inputs_embeds": torch.randn(2, 3, 32, generator=g),
        },
        "llava": {
            "input_ids": ids,
            "pixel_values": torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g),
        },
    }


@pytest.mark.parametrize("arch", ["vit", "wav2vec2", "bert", "t5", "llava"])
def test_float_input_checks_read_the_first_batch_of_a_shape_only(make_tiny, arch: str) -> None:
    """NaN in pixels, audio or embeddings, and image tokens against images, are checked on the
    first batch of each shape (a NaN there is a BatchError) and not read again after it."""
    from headkit import BatchError

    head = HeadConfig("cls", num_outputs=2, pred_for_sequence=True, pooling="mean")
    head = head.replace(stack="decoder") if arch == "t5" else head
    model = HeadedModel(make_tiny(arch, 2).cuda(), [head]).eval()
    batch = _image_and_audio_batches(torch.Generator().manual_seed(0))[arch]
    batch = {k: v.cuda() for k, v in batch.items()}
    float_key = next(k for k, v in batch.items() if v.is_floating_point())
    poisoned = {**batch, float_key: batch[float_key].clone()}
    poisoned[float_key][1].view(-1)[0] = float("nan")
    with torch.no_grad(), pytest.raises(BatchError, match=rf"^{float_key} row 1 holds nan"):
        model(**poisoned)  # the first batch of its shape: read on the host

    def step() -> None:
        with torch.no_grad():
            model(**batch)

    step()
    syncs = _syncs(step) + _syncs(step)
    assert not syncs, f"{len(syncs)} host-device syncs in a headed forward:\n" + "\n".join(syncs)
