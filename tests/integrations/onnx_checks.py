"""What the ONNX export tests check on every graph: other shapes than the example, padding on
either side, against the eager model; the blocks whose weights are in the file."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import torch

from headkit.integrations.onnx import session


def blocks_in_graph(graph: Path, layers_path: str) -> set[int]:
    """Indices of the blocks whose weights the graph holds (``backbone.<layers_path>.<i>.``)."""
    names = {i.name for i in onnx.load(str(graph), load_external_data=False).graph.initializer}
    pattern = re.compile(rf"backbone\.{re.escape(layers_path)}\.(\d+)\.")
    return {int(m.group(1)) for n in names if (m := pattern.match(n))}


def check_cut(model, graph: Path, blocks: int) -> None:
    """The graph's weights are at most the model's minus the blocks after ``blocks`` (names
    may be folded by the optimiser; sizes are not): leaving a block in would add its size."""
    proto = onnx.load(str(graph))
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16)
    in_graph = sum(int(np.prod(t.dims)) for t in proto.graph.initializer if t.data_type in floats)
    layers = model.info.layers
    unused = sum(p.numel() for block in layers[blocks:] for p in block.parameters())
    one = sum(p.numel() for p in layers[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    assert in_graph <= total - unused + 256, (in_graph, total, unused)
    assert in_graph >= blocks * one, (in_graph, blocks, one)  # the needed blocks are there


def compare_with_eager(model, graph: Path, batch: dict[str, torch.Tensor]) -> dict[str, float]:
    """Largest |onnxruntime - eager| per head on ``batch`` (token heads: at real tokens)."""
    sess = session(graph, threads=1)
    wanted = [i.name for i in sess.get_inputs()]
    feed = {k: v.numpy() for k, v in batch.items() if k in wanted}
    names = [o.name for o in sess.get_outputs()]
    outs = dict(zip(names, sess.run(names, feed)))
    with torch.no_grad():
        eager = model(**batch).preds_by_head
    keep = batch["attention_mask"].bool().numpy()
    diffs = {}
    for name in names:
        ours, theirs = eager[name].numpy(), outs[name]
        assert ours.shape == theirs.shape, (name, ours.shape, theirs.shape)
        diff = np.abs(ours - theirs)
        diffs[name] = float((diff if ours.ndim == 2 else diff[keep]).max())
    return diffs


def padded(ids: torch.Tensor, lengths: list[int], side: str) -> dict[str, torch.Tensor]:
    """``ids`` with rows cut to ``lengths`` real tokens, padded on ``side`` (mask 0)."""
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        if side == "right":
            mask[i, :n] = 1
        else:
            mask[i, ids.shape[1] - n :] = 1
    return {"input_ids": ids, "attention_mask": mask}
