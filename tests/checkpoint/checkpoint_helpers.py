"""What the checkpoint tests share: a two-row batch (the second row left-padded), the heads
most of them save, and reading and comparing predictions."""

from __future__ import annotations

import torch

from headkit import HeadConfig, HeadedModel

MANIFEST = "head_configs.json"
#: A mean-pooled sequence head on the last layer and a token head on layer 1.
HEADS = [
    HeadConfig("cls", num_outputs=3, pred_for_sequence=True, pooling="mean"),
    HeadConfig("tok", num_outputs=4, layer_hook=1),
]
IDS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
MASK = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])


def predict(model: HeadedModel) -> dict[str, torch.Tensor]:
    """Every head's predictions on ``IDS`` / ``MASK``, in eval mode."""
    with torch.no_grad():
        return model.eval()(IDS, attention_mask=MASK).preds_by_head


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """The same heads with exactly equal predictions."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_same(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], dtypes: bool = False
) -> None:
    """Like ``same``, naming the head that differs (and, with ``dtypes``, its dtype too)."""
    assert a.keys() == b.keys()
    for k in a:
        assert not dtypes or a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k
