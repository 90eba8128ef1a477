"""ONNX export: one graph computing every head, verified with onnxruntime.

``export_onnx(model, directory)`` writes ``model.onnx`` and ``headkit_onnx.json``:

- inputs ``input_ids`` and ``attention_mask`` (int64, (batch, sequence), both dynamic), and
  ``token_type_ids`` where the backbone has a token-type table (BERT-style);
- one output per head, named by the head: (batch, num_outputs) for sequence heads,
  (batch, sequence, num_outputs) for token heads; poolings and output activations inside;
- the backbone cut after the deepest hooked block: the graph holds a copy of the backbone whose
  block list stops there (``cut_backbone``), so the blocks after it are not in the file. Head
  inputs come from the same input stage (``prepare_inputs``: positions from the mask, so
  either padding side works), hooked states and ``model/head_inputs.head_inputs`` as ``forward``;
- the JSON says what each output is (layer, pooling, activation, loss, classes), which
  exporter ran, and how the export was verified.

torch's exporter (``torch.onnx.export(..., dynamo=True)``, which needs onnxscript) runs first;
the TorchScript exporter only if it fails (the JSON and the result say which ran). Before
anything is moved into ``directory`` the graph is run with onnxruntime on batches of other
shapes than the example, padded on either side, and compared with the eager model: within
``atol`` (1e-4) for every head, at real tokens for token heads (what a model computes at
padding is not defined). Needs ``pip install 'headkit[onnx]'``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..backbone.inputs import prepare_inputs, run_stage
from ..backbone.inspection import BackboneInfo
from ..checkpoint.card import EXPORT_CARD, export_card, head_summary, write_export_card
from ..errors import ConfigError, HeadkitError
from ..heads.base import HeadDict
from ..model.head_inputs import head_inputs
from ..model.headed import HeadedModel
from .exporting import (
    check_atol,
    check_export_target,
    check_heads,
    export_folder,
    files_sha256,
    max_difference,
    recorded_tokenizer,
    sample_batches,
    write_json,
)

GRAPH = "model.onnx"
SIDECAR = "headkit_onnx.json"
INSTALL = "pip install 'headkit[onnx]'"
#: Above this many bytes of weights the graph keeps them in ``model.onnx.data`` (protobuf's
#: 2 GiB limit on one file).
EXTERNAL_DATA_BYTES = 1 << 30
EXPORTERS = ("auto", "dynamo", "torchscript")
#: The ONNX opsets torch's exporters write (the TorchScript one stops at
#: ``TORCHSCRIPT_MAX_OPSET``).
OPSETS = (7, 23)
TORCHSCRIPT_MAX_OPSET = 20
_EXAMPLE = (2, 16)  # (batch, sequence) of the traced example: 0/1 sizes would specialise


@dataclass
class OnnxExport:
    """What ``export_onnx`` wrote: the folder, the graph, which exporter ran, the blocks in the
    graph, the largest difference from eager per head, and the JSON written beside it."""

    directory: Path
    graph: Path
    exporter: str
    blocks: int
    max_abs_diff: dict[str, float]
    description: dict[str, Any] = field(repr=False)
    export_s: float = 0.0


def require_onnx() -> None:
    """A ConfigError naming the install command when onnx, onnxruntime or onnxscript is missing."""
    for name in ("onnx", "onnxruntime", "onnxscript"):
        try:
            __import__(name)
        except ImportError:
            raise ConfigError(
                f"ONNX export needs onnx, onnxruntime and onnxscript ({name} is missing): {INSTALL}"
            ) from None


def cut_backbone(backbone: nn.Module, info: BackboneInfo, blocks: int) -> tuple[nn.Module, Any]:
    """A copy of ``backbone`` sharing its weights whose block stack holds only its first
    ``blocks`` blocks (and whose config says so); the raw output of the last one is its last
    hidden state (``tie_last_hidden_states=False``). Returns (copy, its BackboneInfo)."""
    path = info.layers_path.split(".")
    root = copy.copy(backbone)
    root._modules = dict(backbone._modules)
    parent = root
    for name in path[:-1]:  # copies down to the stack's parent: the original stays whole
        child = copy.copy(parent._modules[name])
        child._modules = dict(child._modules)
        parent._modules[name] = child
        parent = child
    stack = nn.ModuleList(list(info.layers)[:blocks])
    parent._modules[path[-1]] = stack
    config = copy.deepcopy(backbone.config)
    config.num_hidden_layers = blocks
    config.tie_last_hidden_states = False
    root.config = config
    return root, dataclasses.replace(info, layers=stack, num_layers=blocks, tie_last=False)


class ExportGraph(nn.Module):
    """What the ONNX graph computes: the input stage and the (cut) backbone, the hooked
    states, each head's input (``model/head_inputs.head_inputs``, as ``forward``) and head.
    Traceable: no input checks, no early-exit exception (the cut stands for it)."""

    def __init__(self, model: HeadedModel, names: list[str]) -> None:
        super().__init__()
        keys = model.state_keys()
        self.state_keys = {n: keys[n] for n in names}
        wanted = set(self.state_keys.values())
        info = model.info
        deepest = max(k.index for k in wanted)
        self.blocks = info.num_layers
        if deepest < info.num_layers or not info.tie_last:
            self.blocks = max(deepest, 1)  # index 0 (embeddings) is the input of block 0
            backbone, info = cut_backbone(model.backbone, info, self.blocks)
        else:
            backbone = model.backbone
        self.backbone = backbone
        self.info = info
        self.wanted = wanted
        self.heads = HeadDict({n: model.heads[n] for n in names})

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None:
            batch["token_type_ids"] = token_type_ids
        inputs = prepare_inputs(self.backbone, self.info, batch, check=False)
        captured, _ = run_stage(self.backbone, self.info, inputs, self.wanted, False)
        features = head_inputs(self.heads, self.state_keys, captured, inputs.mask)
        return tuple(head.from_features(features[n]) for n, head in self.heads.items())


def _card(model: HeadedModel, names: list[str], diffs: Any, atol: float, where: Any) -> str:
    """The export's model card: one ONNX graph of the heads, run with onnxruntime."""
    usage = [
        "import onnxruntime as ort",
        "from transformers import AutoTokenizer",
        "",
        f'session = ort.InferenceSession("path/to/this/folder/{GRAPH}")',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")',
        'inputs = tokenizer(texts, padding=True, return_tensors="np")',
        "wanted = {i.name for i in session.get_inputs()}",
        "outputs = session.run(None, {k: v for k, v in inputs.items() if k in wanted})",
        f"# one output per head, in this order: {', '.join(names)}",
    ]
    facts = [
        f"Heads {', '.join(names)} of a headkit model, exported as one ONNX graph "
        f"({GRAPH}; the backbone cut after the deepest hooked layer, pooling and activations "
        f"inside); outputs checked against the heads' (allowed difference {atol:g}); "
        f"{SIDECAR} describes each output.",
    ]
    return export_card(model, names, "onnx", Path(where), usage, facts)


def export_onnx(
    model: HeadedModel,
    directory: str | os.PathLike,
    *,
    tokenizer: Any = None,
    heads: list[str] | str | None = None,
    opset: int | None = None,
    atol: float = 1e-4,
    token_type_ids: bool | None = None,
    exporter: str = "auto",
    overwrite: bool = False,
) -> OnnxExport:
    """Export ``model``'s heads (all, or ``heads``) as one ONNX graph in ``directory`` and
    verify it (see the module docstring). ``tokenizer`` (default: the one recorded beside the
    backbone's source, if any; False: none) is saved beside it. ``token_type_ids``: whether the
    graph takes them (default: where the backbone has a token-type table). ``exporter``:
    "auto" (torch's dynamo exporter, the TorchScript one if it fails), "dynamo" or
    "torchscript". ``directory`` must be new, empty or an earlier ONNX export (replaced only
    with ``overwrite=True``; see ``exporting.export_folder``)."""
    check_onnx_options(opset, atol, exporter)
    require_onnx()
    names = check_heads(model, heads, "export(format='onnx')")
    _check_exportable(model)
    types = _token_types(model) if token_type_ids in (None, True) else 0
    if token_type_ids is True and not types:
        raise ConfigError(
            f"token_type_ids=True, but {type(model.backbone).__name__} has no token-type table"
        )
    if tokenizer is None:
        tokenizer = recorded_tokenizer(model)
    was_training = model.training
    model.eval()
    try:
        graph = ExportGraph(model, names).eval()
        with export_folder(directory, SIDECAR, overwrite=overwrite, what="ONNX export") as tmp:
            t0 = time.perf_counter()
            exporter = _export(graph, model, tmp / GRAPH, names, types, opset, exporter)
            export_s = time.perf_counter() - t0
            diffs = _verify(model, tmp / GRAPH, names, types, atol)
            description = describe(model, names, graph, types, exporter, tmp / GRAPH, diffs, atol)
            if tokenizer:
                tokenizer.save_pretrained(tmp)
            description["files"] = sorted([*(p.name for p in tmp.iterdir()), SIDECAR])
            card = _card(model, names, diffs, atol, directory)
            sha = write_export_card(tmp, Path(directory), Path(directory, SIDECAR), card)
            if sha is not None:
                description[EXPORT_CARD] = sha
            description["files_sha256"] = files_sha256(tmp, SIDECAR)
            write_json(tmp / SIDECAR, description)
    finally:
        model.train(was_training)
    root = Path(directory)
    return OnnxExport(root, root / GRAPH, exporter, graph.blocks, diffs, description, export_s)


def check_onnx_options(opset: Any, atol: Any, exporter: Any) -> None:
    """Refuse ``opset``, ``atol`` and ``exporter`` before anything is built (ConfigError naming
    the value and the allowed range)."""
    if not isinstance(exporter, str) or exporter not in EXPORTERS:
        raise ConfigError(
            f"exporter={_short(exporter)} is invalid; allowed: {', '.join(EXPORTERS)}"
        )
    if opset is not None:
        top = OPSETS[1] if exporter != "torchscript" else min(OPSETS[1], TORCHSCRIPT_MAX_OPSET)
        if not isinstance(opset, int) or isinstance(opset, bool) or not OPSETS[0] <= opset <= top:
            raise ConfigError(
                f"opset={_short(opset)} is invalid; allowed: an integer from {OPSETS[0]} to "
                f"{top} (exporter={exporter!r}), or None for the exporter's default"
            )
    check_atol(atol)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_exportable(model: HeadedModel) -> None:
    info = model.info
    if info.not_text:
        raise ConfigError(
            f"ONNX export takes text encoders and decoders (input_ids, attention_mask); "
            f"{type(model.backbone).__name__} is {info.not_text} model"
        )
    if "input_ids" not in model.info.forward_params:
        raise ConfigError(
            f"ONNX export takes token inputs (input_ids, attention_mask); "
            f"{type(model.backbone).__name__} takes none"
        )
    if model.dtype != torch.float32:
        raise ConfigError(
            f"ONNX export needs a float32 model, got {model.dtype}: export model.float() "
            "(and convert the graph to float16 afterwards if you need it)"
        )


def _token_types(model: HeadedModel) -> int:
    """Rows of the backbone's token-type table when its forward takes ``token_type_ids``."""
    rows = getattr(model.backbone.config, "type_vocab_size", None)
    takes = "token_type_ids" in model.info.forward_params
    return int(rows) if takes and isinstance(rows, int) and rows > 0 else 0


def _example(model: HeadedModel, types: int) -> tuple[torch.Tensor, ...]:
    batch, seq = _EXAMPLE
    vocab = model.get_input_embeddings().num_embeddings
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(model.device)
    mask = torch.ones_like(ids)
    mask[1, seq // 2 :] = 0
    return (ids, mask, torch.zeros_like(ids)) if types else (ids, mask)


def _export(
    graph: ExportGraph,
    model: HeadedModel,
    path: Path,
    names: list[str],
    types: int,
    opset: Any,
    exporter: str = "auto",
) -> str:
    """Write the graph with torch's dynamo exporter, or the TorchScript one when that fails
    ("auto", with a warning giving the reason) or is asked for; returns which ran."""
    inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if types else [])
    args = _example(model, types)
    axes = {n: {0: "batch", 1: "sequence"} for n in inputs}
    if exporter != "torchscript":
        try:
            _dynamo_export(graph, args, path, inputs, names, axes, opset)
            return "dynamo"
        except Exception as e:  # any failure of the new exporter: try the older one, say so
            if exporter == "dynamo":
                raise
            reason = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        for p in path.parent.glob(f"{path.name}*"):
            p.unlink()
        warnings.warn(
            f"torch.onnx dynamo export failed ({reason}); using the TorchScript exporter",
            stacklevel=3,
        )
    for n in names:  # the TorchScript exporter names every dynamic axis itself
        seq = model.head_configs[n].pred_for_sequence
        axes[n] = {0: "batch"} if seq else {0: "batch", 1: "sequence"}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # its tracer warnings about data-dependent branches
        torch.onnx.export(
            graph,
            args,
            str(path),
            dynamo=False,
            input_names=inputs,
            output_names=names,
            dynamic_axes=axes,
            opset_version=opset or 17,
        )
    return "torchscript"


def _dynamo_export(
    graph: ExportGraph,
    args: tuple,
    path: Path,
    inputs: list[str],
    names: list[str],
    axes: dict,
    opset: Any,
) -> None:
    big = sum(p.numel() * p.element_size() for p in graph.parameters()) > EXTERNAL_DATA_BYTES
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)  # "torchvision is not installed. Skipping ..." and the like
    try:
        _run_dynamo(graph, args, path, inputs, names, axes, opset, big)
    finally:
        logger.setLevel(level)


def _run_dynamo(
    graph: ExportGraph,
    args: tuple,
    path: Path,
    inputs: list[str],
    names: list[str],
    axes: dict,
    opset: Any,
    big: bool,
) -> None:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # the exporter's chatter about its internals
        torch.onnx.export(
            graph,
            args,
            str(path),
            dynamo=True,
            input_names=inputs,
            output_names=names,
            dynamic_shapes={n: axes[n] for n in inputs},
            custom_translation_table=_translations(),
            opset_version=opset,
            external_data=big,
            verbose=False,
        )


def _translations() -> dict:
    """ONNX for the ops torch's exporter has none for: ``frexp`` (overflow-safe pooling)."""
    return {torch.ops.prims.frexp.default: _frexp}


def _frexp(x: Any) -> tuple[Any, Any]:
    """(mantissa in [0.5, 1), int32 exponent) with x = mantissa * 2**exponent; (0, 0) for 0,
    inf and nan. Computed in float64 from log2, then corrected by one step: exact."""
    from onnx import TensorProto
    from onnxscript import opset18 as op

    d = op.Cast(x, to=TensorProto.DOUBLE)
    ax = op.Abs(d)

    def c(v: float) -> Any:
        return op.CastLike(op.Constant(value_float=v), ax)

    finite = op.And(op.Greater(ax, c(0.0)), op.Less(ax, c(math.inf)))
    safe = op.Where(finite, ax, c(1.0))
    e = op.Add(op.Floor(op.Div(op.Log(safe), c(math.log(2.0)))), c(1.0))
    m = op.Div(safe, op.Pow(c(2.0), e))
    e = op.Add(e, op.Where(op.GreaterOrEqual(m, c(1.0)), c(1.0), c(0.0)))
    e = op.Sub(e, op.Where(op.Less(m, c(0.5)), c(1.0), c(0.0)))
    e = op.Where(finite, e, c(0.0))
    mantissa = op.CastLike(op.Where(finite, op.Div(d, op.Pow(c(2.0), e)), c(0.0)), x)
    return mantissa, op.Cast(e, to=TensorProto.INT32)


def session(path: str | os.PathLike, threads: int | None = None) -> Any:
    """An onnxruntime CPU session of an exported graph (``threads``: intra-op threads)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or torch.get_num_threads()
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _verify(
    model: HeadedModel, path: Path, names: list[str], types: int, atol: float
) -> dict[str, float]:
    """Run the graph on ``sample_batches`` and compare with the eager model; a HeadkitError
    naming the head, shape and difference when one is off by more than ``atol``."""
    sess = session(path)
    vocab = model.get_input_embeddings().num_embeddings
    limit = model.info.positions.max_length if model.info.positions else None
    worst = dict.fromkeys(names, 0.0)
    for batch in sample_batches(vocab, limit, model.device, token_types=types):
        feed = {k: v.cpu().numpy() for k, v in batch.items()}
        outs = sess.run(names, feed)
        with torch.no_grad():
            eager = model(**batch).preds_by_head
        for name, out in zip(names, outs):
            per_token = not model.head_configs[name].pred_for_sequence
            diff = max_difference(eager[name], out, batch["attention_mask"], per_token)
            worst[name] = max(worst[name], diff)
            if not diff <= atol:
                raise HeadkitError(
                    f"the exported ONNX graph disagrees with the model on head {name!r}: max "
                    f"|difference| {diff:.3g} > atol={atol:g} on a batch of shape "
                    f"{tuple(batch['input_ids'].shape)}; nothing was written"
                )
    return worst


def describe(
    model: HeadedModel,
    names: list[str],
    graph: ExportGraph,
    types: int,
    exporter: str,
    path: Path,
    diffs: dict[str, float],
    atol: float,
) -> dict[str, Any]:
    """The JSON written beside the graph: inputs, outputs (one per head) and how to read them."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    inputs = ["input_ids", "attention_mask"] + (["token_type_ids"] if types else [])
    info = model.info
    outputs = []
    for n in names:
        cfg = model.head_configs[n]
        shape = ["batch", cfg.num_outputs] if cfg.pred_for_sequence else None
        outputs.append(
            {
                "name": n,
                "dtype": "float32",
                "shape": shape or ["batch", "sequence", cfg.num_outputs],
                "head": head_summary(cfg, info.num_layers),
            }
        )
    return {
        "format": "headkit-onnx",
        "format_version": 1,
        "graph": GRAPH,
        "exporter": exporter,
        "opset": opset,
        "inputs": [{"name": n, "dtype": "int64", "shape": ["batch", "sequence"]} for n in inputs],
        "outputs": outputs,
        "backbone": {
            "class": type(model.backbone).__name__,
            "name_or_path": str(getattr(model.backbone.config, "name_or_path", "") or ""),
            "num_layers": info.num_layers,
            "blocks_in_graph": graph.blocks,
            "max_length": info.positions.max_length if info.positions else None,
        },
        "padding": "attention_mask: 1 for a token, 0 for padding, on either side; token-head "
        "outputs at padding positions are not defined",
        "verified": {"atol": atol, "max_abs_diff": diffs, "onnxruntime": _ort_version()},
    }


def _ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def _check_target(directory: Path, overwrite: bool, **options: Any) -> None:
    """``headkit.export``'s check before anything is loaded or built: the options, and the
    folder (``exporting.check_export_target``)."""
    check_onnx_options(
        options.get("opset"), options.get("atol", 1e-4), options.get("exporter", "auto")
    )
    check_export_target(directory, SIDECAR, overwrite, "onnx export")


export_onnx.check_target = _check_target  # type: ignore[attr-defined]
