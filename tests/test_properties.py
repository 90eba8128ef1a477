"""Property-based tests: any HeadConfig values, batch shape, padding side and pooling give
either a correct result or a clear headkit error, never another exception type.

Correct means: finite predictions of the documented shape ((batch, n) for sequence heads,
(batch, seq, n) otherwise), a finite loss for valid labels, and a BatchError for labels made
invalid on purpose. The tiny backbones (GPT-2 decoder, BERT encoder with pooler) are built
once per module; hypothesis runs derandomised so CI sees the same examples every time.
"""

from __future__ import annotations

import math
from functools import cache
from typing import Any

import pytest
import torch
from conftest import HIDDEN, VOCAB, build_tiny
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from headkit import (
    ACTIVATIONS,
    LOSSES,
    POOLINGS,
    BatchError,
    ConfigError,
    HeadConfig,
    HeadedModel,
    HeadkitError,
)

pytestmark = pytest.mark.filterwarnings("ignore:head .* is a causal-LM head on a bidirectional")
CLASSIFICATION_LOSSES = {n for n in LOSSES.names() if LOSSES.get(n).classes}

LAYERS = 2
SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.filter_too_much],
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@cache
def backbone(arch: str):
    """Built once; HeadedModel only freezes it, so sharing it between examples is safe."""
    return build_tiny(arch, num_layers=LAYERS)


# ---------------------------------------------------------------------- strategies
def _mostly(valid: st.SearchStrategy, invalid: st.SearchStrategy) -> st.SearchStrategy:
    """Valid values about three times in four."""
    return st.one_of(valid, valid, valid, invalid)


BOOL = _mostly(st.booleans(), st.sampled_from([0, 1, None, "yes"]))
ACTIVATION = _mostly(
    st.sampled_from(ACTIVATIONS.names()), st.sampled_from(["relu2", "", "SIGMOID", 3, None])
)
POOLING_PARTS = [*POOLINGS.names(), "cls"]
# patch_mean averages a vision backbone's patches; on a text backbone it is refused naming
# the reason (tests/heads/test_patch_mean.py), so text-only properties draw the others.
TEXT_POOLING_PARTS = [p for p in POOLING_PARTS if p != "patch_mean"]
POOLING = st.one_of(
    st.none(),
    st.lists(st.sampled_from(POOLING_PARTS), min_size=1, max_size=3).map("+".join),
    st.sampled_from(["", "meen", "mean+", "MEAN", 5]),
)
LOSS = _mostly(
    st.sampled_from([*LOSSES.names(), None, "CROSS_ENTROPY", "BCE"]),
    st.sampled_from(["hinge", "", 0]),
)

CONFIG_FIELDS = {
    "name": _mostly(st.sampled_from(["h", "head_1"]), st.sampled_from(["", "a.b", 5, None])),
    "in_size": _mostly(st.sampled_from([None, None, HIDDEN]), st.integers(-2, 2 * HIDDEN)),
    "num_outputs": _mostly(
        st.one_of(st.none(), st.integers(1, 6)), st.sampled_from([0, -1, "3", 2.0, True])
    ),
    "layer_hook": _mostly(
        st.integers(-LAYERS - 1, LAYERS), st.one_of(st.integers(-50, 50), st.just(1.5))
    ),
    "hidden_size": _mostly(st.integers(0, 8), st.sampled_from([-1, 2.5, None])),
    "num_layers": _mostly(st.integers(1, 3), st.sampled_from([0, -1, 1.0, "2"])),
    "output_activation": ACTIVATION,
    "hidden_activation": ACTIVATION,
    "target": _mostly(
        st.sampled_from([None, "y"]), st.sampled_from(["", "input_ids", "attention_mask", 3])
    ),
    "is_causal_lm": _mostly(st.sampled_from([False, False, True]), st.sampled_from([1, None])),
    "pred_for_sequence": BOOL,
    "is_regression": BOOL,
    "output_bias": BOOL,
    "loss_fct": LOSS,
    "trainable": BOOL,
    "loss_weight": _mostly(
        st.floats(0, 10), st.sampled_from([-1.0, math.nan, math.inf, "1", True])
    ),
    "ignore_pads": _mostly(st.sampled_from([None, True, False]), st.just("no")),
    "block_gradients": BOOL,
    "dropout": _mostly(st.sampled_from([0.0, 0.0, 0.1]), st.sampled_from([1.0, -0.1, "0"])),
    "pooling": POOLING,
    "extra": _mostly(st.just({}), st.sampled_from([[], "x"])),
}


@st.composite
def config_kwargs(draw) -> dict[str, Any]:
    """A random subset of HeadConfig fields with random (often valid) values."""
    keys = draw(st.sets(st.sampled_from(sorted(set(CONFIG_FIELDS) - {"name"}))))
    kwargs = {k: draw(CONFIG_FIELDS[k]) for k in sorted(keys)}
    kwargs["name"] = draw(CONFIG_FIELDS["name"])
    return kwargs


@st.composite
def head_kwargs(draw) -> dict[str, Any]:
    """Mostly valid configs of every kind of head, one field sometimes replaced by a random
    (often invalid) value."""
    kind = draw(st.sampled_from(["token", "sequence", "regression", "binary", "causal_lm"]))
    sequence = kind in ("sequence",) or (kind in ("regression", "binary") and draw(st.booleans()))
    num_layers = draw(st.integers(1, 3))
    kwargs: dict[str, Any] = {
        "name": "h",
        "num_outputs": draw(st.one_of(st.none(), st.integers(1, 5))),
        "layer_hook": draw(st.integers(-LAYERS - 1, LAYERS)),
        "num_layers": num_layers,
        "hidden_size": draw(st.integers(1, 8)) if num_layers > 1 else draw(st.integers(0, 4)),
        "hidden_activation": draw(st.sampled_from(ACTIVATIONS.names())),
        "output_activation": draw(st.sampled_from(ACTIVATIONS.names())),
        "pred_for_sequence": sequence,
        "ignore_pads": draw(st.sampled_from([None, True, False])),
        "output_bias": draw(st.booleans()),
        "block_gradients": draw(st.booleans()),
        "dropout": draw(st.sampled_from([0.0, 0.1])),
        "target": draw(st.sampled_from([None, "y"])),
    }
    if sequence:
        parts = draw(st.lists(st.sampled_from(POOLING_PARTS), max_size=3, unique=True))
        kwargs["pooling"] = "+".join(parts) or None
    if kind in ("token", "sequence"):
        kwargs["loss_fct"] = draw(st.sampled_from(["cross_entropy", "CROSS_ENTROPY", None]))
    elif kind == "regression":
        kwargs["is_regression"] = True
        kwargs["loss_fct"] = draw(st.sampled_from(["mse", "masked_mse", "l1", "Smooth_L1"]))
    elif kind == "binary":
        kwargs["loss_fct"] = draw(st.sampled_from(["bce", "BCE", "bce_with_logits"]))
        if kwargs["loss_fct"] != "bce_with_logits":
            kwargs["output_activation"] = "sigmoid"
    else:
        kwargs.update(is_causal_lm=True, num_outputs=draw(st.sampled_from([None, VOCAB])))
    if draw(st.integers(0, 4)) == 0:
        field = draw(st.sampled_from(sorted(CONFIG_FIELDS)))
        kwargs[field] = draw(CONFIG_FIELDS[field])
    return kwargs


# ---------------------------------------------------------------------- HeadConfig alone
@settings(max_examples=400, **SETTINGS)
@given(kwargs=st.one_of(config_kwargs(), head_kwargs()))
def test_any_config_is_valid_or_a_config_error(kwargs):
    try:
        cfg = HeadConfig(**kwargs)
    except HeadkitError as e:
        assert type(e) is ConfigError and str(e)
        return
    # a valid config survives JSON unchanged and re-validates
    assert HeadConfig.from_json(cfg.to_json()) == cfg
    assert HeadConfig.from_dict(cfg.to_dict()) == cfg


# ---------------------------------------------------------------------- model + batch
@st.composite
def batches(draw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input_ids, attention_mask): 1-3 rows of 1-6 tokens, padded left or right (or no mask);
    a row may be all padding."""
    batch, seq = draw(st.integers(1, 3)), draw(st.integers(1, 6))
    ids = torch.tensor(
        draw(st.lists(st.integers(3, VOCAB - 1), min_size=batch * seq, max_size=batch * seq))
    ).view(batch, seq)
    side = draw(st.sampled_from(["right", "left", "none"]))
    if side == "none":
        return ids, None
    lengths = draw(st.lists(st.integers(0, seq), min_size=batch, max_size=batch))
    positions = torch.arange(seq)
    mask = torch.stack(
        [positions < n if side == "right" else positions >= seq - n for n in lengths]
    ).long()
    return ids, mask


def counted_positions(cfg: HeadConfig, mask: torch.Tensor | None, lead: tuple) -> torch.Tensor:
    """Where a label counts in the loss: (batch,) or (batch, seq) booleans."""
    valid = torch.ones(lead, dtype=torch.bool)
    if not cfg.pred_for_sequence and cfg.ignore_pads and mask is not None:
        valid = mask.bool().clone()
    if cfg.is_causal_lm:
        valid[:, 0] = False  # position 0's label is never predicted (labels shift by one)
    return valid


def valid_labels(cfg: HeadConfig, lead: tuple, n: int, g: torch.Generator) -> torch.Tensor:
    loss = cfg.loss_fct.lower()
    if loss in CLASSIFICATION_LOSSES:
        labels = torch.randint(0, n, lead, generator=g)
        return torch.where(torch.rand(lead, generator=g) < 0.2, -100, labels)
    if loss in ("bce", "bce_with_logits"):
        return torch.randint(0, 2, (*lead, n), generator=g).float()
    return torch.randn((*lead, n), generator=g)


@settings(max_examples=250, **SETTINGS)
@given(
    kwargs=st.one_of(head_kwargs(), head_kwargs(), head_kwargs(), config_kwargs()),
    arch=st.sampled_from(["gpt2", "bert"]),
    batch=batches(),
    corruption=st.sampled_from(["none", "batch-size", "value"]),
    seed=st.integers(0, 2**16),
)
def test_any_head_on_any_batch_predicts_or_raises_a_headkit_error(
    kwargs, arch, batch, corruption, seed
):
    ids, mask = batch
    try:
        cfg = HeadConfig(**kwargs)
        model = HeadedModel(backbone(arch), [cfg]).eval()
    except HeadkitError as e:
        assert type(e) is ConfigError
        event("config rejected")
        return
    cfg = model.head_configs[cfg.name]
    n = cfg.num_outputs
    lead = (ids.shape[0],) if cfg.pred_for_sequence else tuple(ids.shape)

    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    pred = out.preds_by_head[cfg.name]
    assert pred.shape == (*lead, n)
    assert bool(torch.isfinite(pred).all())
    assert out.loss is None
    event(f"predictions ({arch}, pooling {cfg.pooling})")
    if cfg.loss_fct is None:
        event("no loss")
        return

    g = torch.Generator().manual_seed(seed)
    labels = valid_labels(cfg, lead, n, g)
    counted = counted_positions(cfg, mask, lead)
    if corruption == "batch-size":
        labels = torch.cat([labels, labels[:1]])
    elif corruption == "value":
        assume(bool(counted.any()))
        where = tuple(i.item() for i in counted.nonzero()[0])
        labels[where] = n if cfg.loss_fct.lower() in CLASSIFICATION_LOSSES else math.nan
    try:
        with torch.no_grad():
            out = model(ids, attention_mask=mask, **{cfg.target: labels})
    except HeadkitError as e:
        assert corruption != "none", f"valid labels rejected: {e}"
        assert type(e) is BatchError and cfg.name in str(e)
        event(f"{corruption} labels rejected")
        return
    assert corruption == "none", f"{corruption} labels were accepted"
    event(f"loss ({cfg.loss_fct.lower()}, {'sequence' if cfg.pred_for_sequence else 'token'})")
    loss = out.loss_by_head[cfg.name]
    assert loss.shape == () and bool(torch.isfinite(loss))
    if not counted.any():
        assert loss.item() == 0.0  # nothing counts: an exact zero


@settings(max_examples=60, **SETTINGS)
@given(
    pooling=st.lists(st.sampled_from(TEXT_POOLING_PARTS), min_size=1, max_size=3, unique=True),
    arch=st.sampled_from(["gpt2", "bert"]),
    batch=batches(),
)
def test_pooling_reads_padding_only_from_the_mask(pooling, arch, batch):
    """Changing the ids of padded positions never changes a sequence head's prediction."""
    ids, mask = batch
    assume(mask is not None)
    spec = "+".join(pooling)
    try:
        model = HeadedModel(
            backbone(arch), [HeadConfig("h", pred_for_sequence=True, pooling=spec)]
        ).eval()
    except ConfigError as e:
        assert "pooler" in spec and arch == "gpt2", e
        return
    scrambled = torch.where(mask.bool(), ids, (ids * 7 + 1) % (VOCAB - 3) + 3)
    with torch.no_grad():
        a = model(ids, attention_mask=mask).preds_by_head["h"]
        b = model(scrambled, attention_mask=mask).preds_by_head["h"]
    keep = mask.bool().any(1)  # rows with at least one real token
    torch.testing.assert_close(a[keep], b[keep], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- malformed inputs
ID_DTYPES = {
    torch.int64: True,
    torch.int32: True,
    torch.int16: False,
    torch.uint8: False,
    torch.float32: False,
    torch.bool: False,
}
MASK_DTYPES = [torch.int64, torch.int32, torch.bool, torch.float32]


@settings(max_examples=150, **SETTINGS)
@given(
    arch=st.sampled_from(["gpt2", "bert"]),
    batch=batches(),
    id_dtype=st.sampled_from(list(ID_DTYPES)),
    id_shape=st.sampled_from(["ok", "3d", "1d", "no-rows", "no-tokens"]),
    id_value=st.sampled_from(["ok", "too-large", "negative"]),
    container=st.sampled_from(["tensor", "tensor", "list", "numpy"]),
    mask_kind=st.sampled_from(["ok", "ok", "wrong-shape", "value-2", "list"]),
    mask_dtype=st.sampled_from(MASK_DTYPES),
    label_kind=st.sampled_from(["none", "tensor", "list", "numpy", "strings", "float"]),
)
def test_malformed_inputs_raise_a_batch_error(
    arch, batch, id_dtype, id_shape, id_value, container, mask_kind, mask_dtype, label_kind
):
    """Inputs are valid exactly when every part is; otherwise the error is a BatchError."""
    ids, mask = batch
    if mask is None:
        mask = torch.ones_like(ids)
    model = HeadedModel(
        backbone(arch), [HeadConfig("h", num_outputs=3, pred_for_sequence=True, pooling="mean")]
    ).eval()
    valid = True
    if id_value != "ok":
        ids = ids.clone()
        ids[0, 0] = VOCAB + 5 if id_value == "too-large" else -3
        valid = False
    if id_dtype != torch.int64:
        valid &= ID_DTYPES[id_dtype] and id_value == "ok"
        ids = ids.to(id_dtype)
    if id_shape != "ok":
        ids = {"3d": ids[..., None], "1d": ids[0], "no-rows": ids[:0], "no-tokens": ids[:, :0]}[
            id_shape
        ]
        mask = None if id_shape in ("1d", "3d") else mask[: ids.shape[0], : ids.shape[1]]
        valid = False
    if container != "tensor":
        ids = ids.tolist() if container == "list" else ids.numpy()
        valid = False
    if mask is not None and mask_kind != "ok":
        valid = False
        mask = {
            "wrong-shape": mask[:, :-1] if mask.shape[1] > 1 else torch.cat([mask, mask], 1),
            "value-2": mask * 2 + (mask == 0).long() * 2,
            "list": mask.tolist(),
        }[mask_kind]
    if isinstance(mask, torch.Tensor):
        mask = mask.to(mask_dtype) if mask_kind != "value-2" else mask.float()
    rows = len(ids) if hasattr(ids, "__len__") else 1
    labels: Any = {
        "none": None,
        "tensor": torch.arange(rows) % 3,
        "list": [i % 3 for i in range(rows)],
        "numpy": (torch.arange(rows) % 3).numpy(),
        "strings": ["pos"] * rows,
        "float": (torch.arange(rows) % 3).float(),
    }[label_kind]
    valid &= label_kind in ("none", "tensor", "list", "numpy")
    try:
        with torch.no_grad():
            out = model(ids, attention_mask=mask, h=labels)
    except HeadkitError as e:
        assert type(e) is BatchError, e
        assert not valid, f"valid inputs rejected: {e}"
        return
    assert valid, "invalid inputs were accepted"
    assert out.preds_by_head["h"].shape == (rows, 3)
    assert bool(torch.isfinite(out.preds_by_head["h"]).all())
