"""Find what headkit needs in any Hugging Face model by inspection, and run only what is needed.

No per-architecture map: the block stack is the ``nn.ModuleList`` whose length is the
config's ``num_hidden_layers`` (a vision-language model's: its language model's; an
encoder–decoder model has two, the encoder's and the decoder's); causality is read from the
attention modules' ``is_causal``. Hooked states follow ``output_hidden_states`` exactly:
index 0 is the input of the first block (the embeddings), index i the output of block i, and
the last index what HF returns there: the ``last_hidden_state`` (after the final norm) of
the module recording the states (the model, or a VLM's language model) where its forward ties
it, the last block's output where it does not (ViT, DINOv2, wav2vec2: see
``modalities.stack_ties_last``); index ``num_layers + 1`` is then the ``last_hidden_state``.
Captured states are keyed by ``StateKey(stack, index)``: the stack ("encoder": a model's
only stack, or an encoder–decoder model's encoder; "decoder") and the index into its states.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn
from transformers import PreTrainedModel

from .._transformers import auto_model_types, install_capturing_hooks, records_hidden_states
from ..errors import BatchError, ConfigError
from .modalities import (
    DECODER,
    computes_own_positions,
    extra_inputs,
    forward_params,
    has_cls_token,
    main_input_of,
    modality_of,
    pooler_of,
    recorded_block_classes,
    special_token_count,
    stack_length,
    stack_ties_last,
    stage_depths,
)
from .positions import PositionScheme, position_scheme


class StateKey(NamedTuple):
    """A captured hidden state: ``index`` into the hidden states of the block stack ``stack``
    ("encoder": a model's only stack, or an encoder–decoder model's encoder; "decoder").

    Index 0 is the embeddings, i the output of block i; ``num_layers + 1`` is the
    ``last_hidden_state`` of a stack whose ``hidden_states[-1]`` is taken before its final
    norm (see the module docstring)."""

    stack: str
    index: int

    @property
    def on_decoder(self) -> bool:
        """Whether this is a state of an encoder–decoder model's decoder."""
        return self.stack == DECODER


#: The input names the input stage handles itself (``inputs.STAGE_INPUTS``).
OWN_INPUTS = (
    "input_ids",
    "attention_mask",
    "position_ids",
    "past_key_values",
    "inputs_embeds",
    "token_type_ids",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
)


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
    last_from: str = ""  # with tie_last: whose last_hidden_state index L is ("": the runner's)
    vocab_size: int | None = None
    positions: PositionScheme | None = None  # position table and numbering (positions.py)
    modality: str = "text"  # modalities.MODALITIES
    main_input: str = "input_ids"  # what drives the backbone (main_input_name)
    extra_inputs: tuple[str, ...] = ()  # batch inputs of its forward beyond OWN_INPUTS
    has_cls: bool = False  # a vision model's class token
    special_tokens: int = 0  # a vision model's leading non-patch tokens (CLS, registers)
    own_positions: bool = False  # numbers positions itself (multimodal rotary)
    decoder: BackboneInfo | None = None  # an encoder–decoder model's decoder stack
    stack: str = "encoder"  # which stack this describes ("encoder": also a model's only one)
    stack_params: set[str] = field(default_factory=set)  # forward of the module running it

    def resolve_hook(self, layer_hook: int, head: str = "?") -> int:
        """Map a (possibly negative) ``layer_hook`` to 0..num_layers, or raise ConfigError."""
        total = self.num_layers + 1
        if not -total <= layer_hook < total:
            of = f" {self.stack}" if self.decoder is not None or self.stack == DECODER else ""
            raise ConfigError(
                f"HeadConfig(name={head!r}): layer_hook={layer_hook} is outside the backbone's"
                f"{of} hidden states; allowed: {-total}..{total - 1} (0 = embeddings, "
                f"{self.num_layers} or -1 = last layer; {self.num_layers} blocks)"
            )
        return layer_hook % total

    @property
    def encoder_decoder(self) -> bool:
        """Whether the backbone has an encoder and a decoder stack."""
        return self.decoder is not None

    @property
    def not_text(self) -> str | None:
        """What the backbone is when it is no text encoder or decoder ("an encoder–decoder",
        "a vision", "a speech", ...; None for text): exports refuse those, naming it."""
        if self.encoder_decoder:
            return "an encoder–decoder"
        return None if self.modality == "text" else f"a {self.modality}"

    def stack_info(self, stack: str) -> BackboneInfo:
        """The info of ``stack`` ("decoder": the decoder's; anything else, or a model with
        one stack: this one)."""
        return self.decoder if stack == DECODER and self.decoder is not None else self


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
        return _inspect_encoder_decoder(model, layers_path)
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    _refuse_hierarchical(model, text_cfg)
    n_layers = getattr(text_cfg, "num_hidden_layers", None)
    language_model = _language_model_path(model)
    path, layers = _find_layers(model, n_layers, layers_path, language_model)
    hidden = getattr(text_cfg, "hidden_size", None)
    if hidden is None:
        emb = model.get_input_embeddings()
        hidden = emb.weight.shape[1]
    pooler = pooler_of(model)
    pooler_size = None
    if pooler is not None:
        lins = [m for m in pooler.modules() if isinstance(m, nn.Linear)]
        pooler_size = lins[-1].out_features if lins else hidden
    names = forward_params(model)
    params = set(names)
    tie_last, last_from = stack_ties_last(model, config, path)
    return BackboneInfo(
        layers=layers,
        layers_path=path,
        num_layers=len(layers),
        hidden_size=int(hidden),
        is_decoder=_is_causal(model),
        pooler=pooler,
        pooler_size=pooler_size,
        forward_params=params,
        tie_last=tie_last,
        last_from=last_from,
        vocab_size=getattr(text_cfg, "vocab_size", None),
        # a vision-language model's positions are its language model's (not its vision tower's)
        positions=position_scheme(model.get_submodule(language_model or ""), params),
        modality=modality_of(model, params),
        main_input=main_input_of(model),
        extra_inputs=extra_inputs(names, OWN_INPUTS),
        has_cls=has_cls_token(model),
        special_tokens=special_token_count(model, int(hidden)),
        own_positions=computes_own_positions(model),
        stack_params=params,
    )


def _refuse_hierarchical(model: PreTrainedModel, config: object) -> None:
    """Hierarchical vision models (Swin, ...) merge patches between stages: their hidden
    states differ in length and width, so one head width and one position mask cannot read
    them. Refused rather than read wrong."""
    depths = stage_depths(config)
    if depths is None:
        return
    raise ConfigError(
        f"{type(model).__name__} is a hierarchical model (config.depths={depths}: "
        f"{len(depths)} stages that merge or pool positions), so its hidden_states change "
        "length and width from stage to stage, while headkit's heads read states of one "
        "width (hidden_size) over one set of positions; it is not supported: use a model "
        "whose blocks keep one shape (ViT, DINOv2, CLIP or SigLIP vision)"
    )


def _inspect_encoder_decoder(model: PreTrainedModel, layers_path: str | None) -> BackboneInfo:
    """The encoder's stack (``layers_path`` names it if needed) with the decoder's as
    ``decoder``; each stack runs through its own module (``get_encoder`` / ``get_decoder``)."""
    config = model.config
    stacks = {}
    for stack, module in (("encoder", model.get_encoder()), (DECODER, model.get_decoder())):
        prefix = path_of(model, module)
        path, layers = _find_layers(
            module, stack_length(config, stack), layers_path if stack == "encoder" else None
        )
        names = forward_params(module)
        tie_last, last_from = stack_ties_last(module, config, path)
        stacks[stack] = BackboneInfo(
            layers=layers,
            layers_path=f"{prefix}.{path}" if prefix else path,
            num_layers=len(layers),
            hidden_size=int(config.get_text_config().hidden_size),
            is_decoder=stack == DECODER,
            pooler=None,
            pooler_size=None,
            forward_params=set(names),
            stack_params=set(names),
            tie_last=tie_last,
            last_from=last_from,
            vocab_size=getattr(config, "vocab_size", None),
            stack=stack,
        )
    names = forward_params(model)
    params = set(names)
    main = main_input_of(model)
    return dataclasses.replace(
        stacks["encoder"],
        forward_params=params,
        positions=position_scheme(model.get_encoder(), params) if main == "input_ids" else None,
        modality=modality_of(model, params),
        main_input=main,
        extra_inputs=extra_inputs(names, OWN_INPUTS),
        decoder=stacks[DECODER],
    )


def path_of(root: nn.Module, module: nn.Module) -> str:
    """The name of ``module`` inside ``root`` ("" for root itself)."""
    return next((n for n, m in root.named_modules() if m is module), "")


def _language_model_path(model: nn.Module) -> str | None:
    """Where a vision-language model keeps its language model (searched first for the block
    stack, so that a vision tower of as many blocks is not taken for it)."""
    config = model.config
    text_cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text_cfg is config:
        return None
    for name in ("language_model", "text_model", "model"):
        if isinstance(getattr(model, name, None), nn.Module):
            return name
    return None


def _find_layers(
    model: nn.Module, n_layers: int | None, layers_path: str | None, prefer: str | None = None
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
    recorded = recorded_block_classes(model)
    if prefer:
        recorded += recorded_block_classes(model.get_submodule(prefer))

    def rank(item: tuple[str, nn.ModuleList]) -> tuple[bool, bool, int]:
        name, stack = item
        blocks = bool(recorded) and all(isinstance(b, recorded) for b in stack)
        return (bool(prefer) and not name.startswith(f"{prefer}."), not blocks, name.count("."))

    exact = sorted(
        ((n, m) for n, m in lists if n_layers is not None and len(m) == n_layers), key=rank
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
    mt = getattr(model.config, "model_type", None)
    return mt in auto_model_types("CAUSAL_LM") and mt not in auto_model_types("MASKED_LM")


def run_backbone(
    model: nn.Module,
    info: BackboneInfo,
    wanted: set[StateKey],
    early_exit: bool,
    inputs: dict,
    decoder_inputs: dict | None = None,
) -> tuple[dict, object | None]:
    """Run ``model(**inputs)`` capturing the hidden states at the resolved indices ``wanted``.

    With ``early_exit`` the forward stops right after the deepest wanted block, so later
    blocks never run; the model output is then ``None``. Hooks live for this call only.
    Under ``torch.compile`` the states come from the model's ``hidden_states`` instead
    (hooks cannot be added inside a traced graph), and every block runs. An encoder–decoder
    model runs its stacks itself (``run_encoder_decoder``).
    """
    if info.decoder is not None:
        return run_encoder_decoder(model, info, wanted, early_exit, inputs, decoder_inputs or {})
    states, out = _run_stack(model, info, {k.index for k in wanted}, early_exit, inputs)
    return {StateKey(info.stack, i): v for i, v in states.items()}, out


def run_encoder_decoder(
    model: nn.Module,
    info: BackboneInfo,
    wanted: set[StateKey],
    early_exit: bool,
    inputs: dict,
    decoder_inputs: dict,
) -> tuple[dict, object | None]:
    """The encoder's and the decoder's wanted states, by ``StateKey``.

    Without decoder states wanted, only the encoder runs (as deep as needed). Otherwise the
    encoder runs in full (or its ``encoder_outputs`` are given) and the decoder as deep as
    needed; the output is the decoder's (None after an early exit).
    """
    enc_wanted = {k.index for k in wanted if not k.on_decoder}
    dec_wanted = {k.index for k in wanted if k.on_decoder}
    encoder_outputs = decoder_inputs.get("encoder_outputs")
    if not dec_wanted and encoder_outputs is None:
        states, out = _run_stack(model.get_encoder(), info, enc_wanted, early_exit, inputs)
        return {StateKey(info.stack, i): v for i, v in states.items()}, out
    captured: dict = {}
    if encoder_outputs is None:
        states, encoder_outputs = _run_stack(model.get_encoder(), info, enc_wanted, False, inputs)
        captured = {StateKey(info.stack, i): v for i, v in states.items()}
    elif enc_wanted:
        raise BatchError("encoder heads need the encoder run: encoder_outputs cannot be given")
    dec = info.decoder
    kwargs = {k: v for k, v in decoder_inputs.items() if k != "encoder_outputs"}
    kwargs["encoder_hidden_states"] = encoder_outputs[0]
    if "encoder_attention_mask" in dec.forward_params and inputs.get("attention_mask") is not None:
        kwargs["encoder_attention_mask"] = inputs["attention_mask"]
    states, out = _run_stack(model.get_decoder(), dec, dec_wanted, early_exit, kwargs)
    captured.update({StateKey(DECODER, i): v for i, v in states.items()})
    return captured, out


def _run_stack(
    model: nn.Module, info: BackboneInfo, wanted: set[int], early_exit: bool, inputs: dict
) -> tuple[dict[int, torch.Tensor], object | None]:
    """``run_backbone`` for one block stack run by ``model`` (see there)."""
    if torch.compiler.is_compiling():
        return _run_traced(model, info, wanted, inputs)
    L = info.num_layers
    captured: dict[int, torch.Tensor] = {}
    tied = L in wanted and info.tie_last  # index L is a last_hidden_state ...
    recorded = tied and bool(info.last_from)  # ... of a part of the model (a VLM's LM)
    from_output = (tied and not recorded) or L + 1 in wanted
    hooked = sorted(i for i in wanted if i <= L and not (i == L and info.tie_last))
    full = from_output or recorded
    stop_at = max(hooked) if (early_exit and hooked and not full) else None
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

    def record_last(_module, _args, out) -> None:
        captured[L] = _last_hidden_state(out)

    try:
        if recorded:
            recorder = model.get_submodule(info.last_from)
            handles.append(recorder.register_forward_hook(record_last))
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
        last = _last_hidden_state(out)
        from_last = {L + 1} | ({L} if tied and not recorded else set())
        captured.update({i: last for i in wanted if i in from_last})
    missing = wanted - set(captured)
    if missing:
        raise RuntimeError(f"layers {sorted(missing)} did not run in {type(model).__name__}")
    return captured, out


def _last_hidden_state(out: object) -> torch.Tensor:
    return out[0] if not hasattr(out, "last_hidden_state") else out.last_hidden_state


def _run_traced(
    model: nn.Module, info: BackboneInfo, wanted: set[int], inputs: dict
) -> tuple[dict[int, torch.Tensor], object]:
    """``run_backbone`` inside torch.compile: HF's ``hidden_states`` (the same indices)."""
    L = info.num_layers
    if wanted <= {L + 1} or (wanted <= {L, L + 1} and info.tie_last and not info.last_from):
        out = model(**inputs)
        return {i: _last_hidden_state(out) for i in wanted}, out
    asked = inputs.get("output_hidden_states")
    out = model(**{**inputs, "output_hidden_states": True})
    states = out.hidden_states
    captured = {i: (_last_hidden_state(out) if i == L + 1 else states[i]) for i in wanted}
    if not asked:
        out.hidden_states = None
    return captured, out


def stack_runners(model: nn.Module, info: BackboneInfo) -> list[tuple[nn.Module, BackboneInfo]]:
    """The modules that run the block stacks, with their infos: the backbone itself, or an
    encoder–decoder model's encoder and decoder."""
    if info.decoder is None:
        return [(model, info)]
    return [(model.get_encoder(), info), (model.get_decoder(), info.decoder)]


def prepare_tracing(model: nn.Module, info: BackboneInfo, wanted: set[StateKey]) -> None:
    """Install transformers' own output-capturing hooks now, as its first
    ``output_hidden_states=True`` call would: under torch.compile heads below the last layer
    read ``hidden_states``, and hooks cannot be installed inside a traced graph. They do
    nothing unless hidden states are asked for. Each stack's runner gets them (an
    encoder–decoder model's two stacks); every part of a vision-language model does (its
    vision tower records its states whatever the heads read)."""
    if info.modality == "vision-language":  # its vision tower always records its states
        for module in model.modules():
            if isinstance(module, PreTrainedModel) and records_hidden_states(module):
                install_capturing_hooks(module)
        return
    for runner, stack in stack_runners(model, info):
        keys = {k.index for k in wanted if k.on_decoder == (stack.stack == DECODER)}
        tied = stack.tie_last and not stack.last_from  # read from the runner's output
        if keys <= {stack.num_layers + 1} or (keys <= {stack.num_layers} and tied):
            continue
        if records_hidden_states(runner):
            install_capturing_hooks(runner)
