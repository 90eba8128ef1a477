"""Find what headkit needs in any Hugging Face model by inspection, and run only what is needed.

No per-architecture map: the block stack is the ``nn.ModuleList`` whose length is the
config's ``num_hidden_layers``; causality is read from the attention modules' ``is_causal``.
Hooked states follow ``output_hidden_states`` exactly: index 0 is the input of the first
block (the embeddings), index i the output of block i, and the last index the model's
``last_hidden_state`` (after the final norm where the model has one).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel

from ..errors import ConfigError
from .positions import PositionScheme, position_scheme


class _StopForward(Exception):
    """Raised by a capture hook once the deepest needed layer has run (early exit)."""


@dataclass
class BackboneInfo:
    """What was learnt about a backbone by inspecting it."""

    layers: nn.ModuleList
    layers_path: str
    num_layers: int
    hidden_size: int
    is_decoder: bool
    pooler: nn.Module | None
    pooler_size: int | None
    forward_params: set[str] = field(default_factory=set)
    tie_last: bool = True
    vocab_size: int | None = None
    positions: PositionScheme | None = None  # position table and numbering (positions.py)

    def resolve_hook(self, layer_hook: int, head: str = "?") -> int:
        """Map a (possibly negative) ``layer_hook`` to 0..num_layers, or raise ConfigError."""
        total = self.num_layers + 1
        if not -total <= layer_hook < total:
            raise ConfigError(
                f"HeadConfig(name={head!r}): layer_hook={layer_hook} is outside the backbone's "
                f"hidden states; allowed: {-total}..{total - 1} (0 = embeddings, "
                f"{self.num_layers} or -1 = last layer; {self.num_layers} blocks)"
            )
        return layer_hook % total


def base_model_of(model: PreTrainedModel) -> PreTrainedModel:
    """The bare transformer inside a task model (``GPT2LMHeadModel`` → ``GPT2Model``)."""
    base = getattr(model, "base_model", model)
    return base if isinstance(base, nn.Module) else model


def inspect_backbone(model: PreTrainedModel, layers_path: str | None = None) -> BackboneInfo:
    """Inspect a bare transformer (see ``base_model_of``).

    ``layers_path`` (a module path such as ``"model.layers"``) names the block stack when
    inspection cannot find it: the shallowest ``nn.ModuleList`` of ``num_hidden_layers``.
    """
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ConfigError(
            f"{type(model).__name__} is an encoder-decoder model; headkit supports encoder-only "
            "and decoder-only transformers"
        )
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    n_layers = getattr(text_cfg, "num_hidden_layers", None)
    path, layers = _find_layers(model, n_layers, layers_path)
    hidden = getattr(text_cfg, "hidden_size", None)
    if hidden is None:
        emb = model.get_input_embeddings()
        hidden = emb.weight.shape[1]
    pooler = getattr(model, "pooler", None)
    pooler_size = None
    if isinstance(pooler, nn.Module):
        lins = [m for m in pooler.modules() if isinstance(m, nn.Linear)]
        pooler_size = lins[-1].out_features if lins else hidden
    else:
        pooler = None
    params = set(inspect.signature(model.forward).parameters)
    return BackboneInfo(
        layers=layers,
        layers_path=path,
        num_layers=len(layers),
        hidden_size=int(hidden),
        is_decoder=_is_causal(model),
        pooler=pooler,
        pooler_size=pooler_size,
        forward_params=params,
        tie_last=getattr(config, "tie_last_hidden_states", None) is not False,
        vocab_size=getattr(text_cfg, "vocab_size", None),
        positions=position_scheme(model, params),
    )


def _find_layers(
    model: nn.Module, n_layers: int | None, layers_path: str | None
) -> tuple[str, nn.ModuleList]:
    if layers_path is not None:
        try:
            found = model.get_submodule(layers_path) if layers_path else None
        except AttributeError:
            found = None
        if not isinstance(found, nn.ModuleList) or not len(found):
            lists = [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
            raise ConfigError(
                f"layers_path={layers_path!r} is not a non-empty nn.ModuleList of "
                f"{type(model).__name__}; its ModuleLists: {lists[:10]}"
            )
        return layers_path, found
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    exact = sorted(
        ((n, m) for n, m in lists if n_layers is not None and len(m) == n_layers),
        key=lambda nm: nm[0].count("."),
    )
    if not exact:
        found = ", ".join(f"{n} ({len(m)})" for n, m in lists[:10]) or "none"
        raise ConfigError(
            f"cannot find the block stack of {type(model).__name__}: no nn.ModuleList has "
            f"num_hidden_layers={n_layers} modules (ModuleLists found: {found}); pass "
            "layers_path='...' (e.g. 'model.layers') to name it"
        )
    return exact[0]  # the shallowest stack of the right length


def _is_causal(model: nn.Module) -> bool:
    flags = [
        m.is_causal for m in model.modules() if isinstance(getattr(m, "is_causal", None), bool)
    ]
    if flags:
        return any(flags)
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    mt = getattr(model.config, "model_type", None)
    return mt in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and mt not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def run_backbone(
    model: nn.Module,
    info: BackboneInfo,
    wanted: set[int],
    early_exit: bool,
    inputs: dict,
) -> tuple[dict[int, torch.Tensor], object | None]:
    """Run ``model(**inputs)`` capturing the hidden states at the resolved indices ``wanted``.

    With ``early_exit`` the forward stops right after the deepest wanted block, so later
    blocks never run; the model output is then ``None``. Hooks live for this call only.
    Under ``torch.compile`` the states come from the model's ``hidden_states`` instead
    (hooks cannot be added inside a traced graph), and every block runs.
    """
    if torch.compiler.is_compiling():
        return _run_traced(model, info, wanted, inputs)
    L = info.num_layers
    captured: dict[int, torch.Tensor] = {}
    from_output = L in wanted and info.tie_last
    hooked = sorted(i for i in wanted if not (i == L and info.tie_last))
    stop_at = max(hooked) if (early_exit and hooked and not from_output) else None
    handles = []

    def make_hook(idx: int):
        def hook(_module, args, kwargs_or_out, out=None):
            if idx == 0:  # pre-hook: the first block's input is hidden_states[0]
                captured[0] = args[0] if args else kwargs_or_out["hidden_states"]
            else:
                o = kwargs_or_out
                captured[idx] = o[0] if isinstance(o, (tuple, list)) else o
            if idx == stop_at:
                raise _StopForward

        return hook

    try:
        for idx in hooked:
            if idx == 0:
                h = info.layers[0].register_forward_pre_hook(make_hook(0), with_kwargs=True)
            else:
                h = info.layers[idx - 1].register_forward_hook(make_hook(idx))
            handles.append(h)
        try:
            out = model(**inputs)
        except _StopForward:
            out = None
    finally:
        for h in handles:
            h.remove()
    if from_output:
        captured[L] = out[0] if not hasattr(out, "last_hidden_state") else out.last_hidden_state
    missing = wanted - set(captured)
    if missing:
        raise RuntimeError(f"layers {sorted(missing)} did not run in {type(model).__name__}")
    return captured, out


def _run_traced(
    model: nn.Module, info: BackboneInfo, wanted: set[int], inputs: dict
) -> tuple[dict[int, torch.Tensor], object]:
    """``run_backbone`` inside torch.compile: HF's ``hidden_states`` (the same indices)."""
    L = info.num_layers
    if wanted <= {L} and info.tie_last:
        out = model(**inputs)
        last = out[0] if not hasattr(out, "last_hidden_state") else out.last_hidden_state
        return {L: last} if wanted else {}, out
    asked = inputs.get("output_hidden_states")
    out = model(**{**inputs, "output_hidden_states": True})
    states = out.hidden_states
    captured = {i: states[i] for i in wanted}
    if not asked:
        out.hidden_states = None
    return captured, out


def prepare_tracing(model: nn.Module, info: BackboneInfo, wanted: set[int]) -> None:
    """Install transformers' own output-capturing hooks now, as its first
    ``output_hidden_states=True`` call would: under torch.compile heads below the last layer
    read ``hidden_states``, and hooks cannot be installed inside a traced graph. They do
    nothing unless hidden states are asked for."""
    if wanted <= {info.num_layers} and info.tie_last:
        return
    try:
        from transformers.utils import output_capturing as oc
    except ImportError:  # transformers < 5.2.0: hidden_states without hooks
        return
    registry = getattr(oc, "_CAN_RECORD_REGISTRY", None)
    install = getattr(oc, "maybe_install_capturing_hooks", None)
    if registry is not None and install is not None and registry.get(model).get("hidden_states"):
        install(model)
