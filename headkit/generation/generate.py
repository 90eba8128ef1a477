"""Generation that also returns every head's output, in one pass with the KV cache.

``HeadedModel.generate`` drives transformers' own ``GenerationMixin.generate`` (processors,
stopping criteria, ``GenerationConfig``, streamers, ``num_return_sequences``) through a thin
driver whose ``forward`` runs the backbone once per step with the KV cache, computes the
next-token logits with the causal-LM head and every other head on the same hooked states, and
records the heads' outputs: no second forward, no copy of the decoding loop
(``docs/generation.md``).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel

from .._transformers import (
    CausalLMOutputWithPast,
    GenerationMode,
    ModelOutput,
    cache_of,
    model_output,
    slice_logits_to_keep,
)
from ..backbone.inputs import check_inputs, prepare_inputs, run_stage
from ..errors import BatchError, ConfigError
from .budget import check_generation_size, prompt_shape
from .recording import Recorder, stitch, until_eos
from .seq2seq import Seq2SeqDriver, encoder_head_outputs

if TYPE_CHECKING:
    from ..model.headed import HeadedModel

#: Decoding modes whose rows stay in place from step to step (beams reorder them).
_ROW_STABLE_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
#: Where per-step head outputs are read: at each token's own position, or at the step that
#: chose it.
HEAD_OUTPUTS_AT = ("token", "step")
#: generate() keywords that would hand a cache in or out of headkit's control.
_CACHE_KWARGS = ("cache", "past_key_values")


@dataclass
class HeadedGenerateOutput(ModelOutput):
    """What ``HeadedModel.generate`` returns (``R`` rows = batch × ``num_return_sequences``,
    ``P`` prompt positions, ``N`` generated tokens).

    - ``sequences`` (R, P + N): prompt and generated tokens, as the backbone's ``generate``
      returns them (after a row's eos, generate appends the pad token).
    - ``token_logprobs`` (R, N): log-probability of each generated token under the model's
      own next-token distribution (log-softmax of the causal-LM head's logits, before logits
      processors such as temperature or top-k), i.e. what a plain forward over ``sequences``
      gives at position t - 1 for the token at t.
    - ``head_outputs``: for every other head that is not ignored, token heads (R, N,
      num_outputs), value at generated token t computed on the hidden state at the position
      of token t itself; sequence heads (R, num_outputs), on each finished sequence (prompt
      and generated tokens up to and including the row's first eos). With
      ``head_outputs_at="step"`` entry t is read one position
      earlier, and sequence heads give (R, N, num_outputs). An encoder–decoder model's
      encoder heads (``stack="encoder"``) are computed once per prompt on the encoder's
      input: sequence heads (R, num_outputs), token heads (R, S, num_outputs) over the
      encoder's S input positions (each prompt's value repeated for its
      ``num_return_sequences`` rows).
    - ``generated_mask`` (R, N): 1 for generated tokens up to and including the row's first
      eos, 0 for the padding generate appends after it.
    - ``attention_mask`` (R, P + N): the prompt's mask followed by ``generated_mask``; a plain
      forward over ``sequences`` with this mask gives the same head outputs at every real
      position.
    - ``scores`` / ``logits``: per-step processed scores / raw logits, as transformers returns
      them, only when ``output_scores=True`` / ``output_logits=True`` is passed.
    """

    sequences: torch.LongTensor | None = None
    token_logprobs: torch.Tensor | None = None
    head_outputs: dict[str, torch.Tensor] | None = None
    generated_mask: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None

    @property
    def logprobs(self) -> torch.Tensor | None:  # the older name
        return self.token_logprobs


class HeadedGenerationMixin:
    """Gives ``HeadedModel`` its ``generate`` method (a model with a causal-LM head)."""

    @torch.no_grad()
    def generate(
        self: HeadedModel,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        *,
        ignore_heads: Iterable[str] = (),
        lm_head_name: str | None = None,
        head_outputs_at: str = "token",
        **kwargs: Any,
    ) -> HeadedGenerateOutput:
        """Generate with transformers' ``generate`` and return every head's output as well.

        Tokens come from the causal-LM head (the one named ``lm_head``, else the only
        ``is_causal_lm`` head, else ``lm_head_name``); greedy decoding gives exactly the tokens
        of the backbone's own ``*ForCausalLM.generate`` and sampling with a seed the same
        samples. ``generation_config`` and ``**kwargs`` are those of ``generate``
        (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
        ``repetition_penalty``, ``eos_token_id``, ``num_return_sequences``, ``streamer``,
        ``logits_processor``, ``stopping_criteria``, ...); greedy search and sampling are
        supported, beam search and assisted decoding are not (beams reorder rows).

        ``head_outputs_at="token"`` (the default): the output of a token head for generated
        token t is computed on the hidden state at the position of token t itself, i.e. the
        value a plain forward over the final ``sequences`` gives at that position; sequence
        heads pool each finished sequence (prompt and generated tokens up to and including the
        first eos), (R, num_outputs). ``head_outputs_at="step"``:
        entry t is computed at the step that chose token t, on the state of the
        position before it (the last prompt token for t = 0), so its ``[t + 1]`` is the
        default's ``[t]``; sequence heads give (R, N, num_outputs), entry t pooling the
        sequence up to that position. Every step runs the backbone
        once with the KV cache and all heads read the hooked states of that same forward; as
        ``generate`` never feeds its last token back, one extra cached step over that token
        alone (only as deep as the deepest head) gives its head outputs. Heads named in
        ``ignore_heads`` are not computed. Prompts must be left-padded (no ``attention_mask``:
        every token counts, pad ids included); the model runs in eval mode while generating.
        An encoder–decoder model (T5, BART, Whisper) generates from its encoder's input
        (``input_ids``, or ``input_features=`` for Whisper; padded on either side) with heads
        on its decoder (``stack="decoder"``); "prompt" positions are then the decoder's start.
        Its encoder heads (``stack="encoder"``) are computed once per prompt, in the one run
        of the encoder, and returned in ``head_outputs`` too.
        See ``HeadedGenerateOutput`` and ``docs/generation.md``.
        """
        if head_outputs_at not in HEAD_OUTPUTS_AT:
            raise ConfigError(
                f"head_outputs_at={head_outputs_at!r} is invalid; allowed: "
                f"{', '.join(map(repr, HEAD_OUTPUTS_AT))}"
            )
        ignore = {ignore_heads} if isinstance(ignore_heads, str) else set(ignore_heads)
        plan = _plan(self, ignore, lm_head_name)
        _check_prompt(self, input_ids, attention_mask, kwargs)
        if attention_mask is None and not self.info.encoder_decoder:  # every token counts
            attention_mask = torch.ones_like(input_ids)
        if generation_config is not None:
            generation_config = copy.deepcopy(generation_config)
            generation_config.return_dict_in_generate = True  # the cache and scores come back
        else:
            kwargs["return_dict_in_generate"] = True
        effective = _effective_config(self, generation_config, kwargs)
        keys, recorded = plan.head_layers | {plan.lm_layer}, set(plan.sequence_heads.values())
        layers = {k.index for k in keys}
        shape = prompt_shape(self, input_ids, kwargs)
        check_generation_size(self, shape, effective, layers, len(recorded))
        driver = _driver_class(type(self.backbone), self.info.encoder_decoder)(self, plan)
        was_training = self.training
        self.eval()  # dropout would add noise and draw from the sampling RNG
        try:
            encoder_outputs: dict[str, torch.Tensor] = {}
            if plan.encoder_heads:  # the encoder's one run: its output goes to generate
                main = self.info.main_input
                prompt = input_ids if main == "input_ids" else kwargs.get(main)
                given = {main: prompt, "attention_mask": attention_mask}
                encoder_outputs, kwargs["encoder_outputs"] = encoder_head_outputs(
                    self, plan.encoder_heads, given
                )
            out = driver.generate(
                input_ids,
                attention_mask=attention_mask,
                generation_config=generation_config,
                **kwargs,
            )
            result = _finish(driver, out, input_ids, attention_mask, effective, head_outputs_at)
            rows = result.sequences.shape[0]
            for name, value in encoder_outputs.items():  # one per prompt → one per row
                result.head_outputs[name] = value.repeat_interleave(rows // value.shape[0], 0)
            return result
        finally:
            self.train(was_training)


# ---------------------------------------------------------------------- planning and checks
@dataclass
class _Plan:
    """Which head chooses tokens, and which heads are computed at every step."""

    lm: str
    lm_layer: Any  # the state each head reads (HeadedModel.state_keys)
    token_heads: dict[str, Any]
    sequence_heads: dict[str, Any]
    encoder_heads: dict[str, Any]  # an encoder–decoder model's: computed once per prompt

    @property
    def head_layers(self) -> set:
        return set(self.token_heads.values()) | set(self.sequence_heads.values())


def _plan(model: HeadedModel, ignore: set[str], lm_name: str | None) -> _Plan:
    if model.info.own_positions:
        raise ConfigError(
            f"generate with heads does not support {type(model.backbone).__name__}, which "
            "numbers positions from its images itself (multimodal rotary positions); run "
            "forward on the generated sequences instead"
        )
    if not model.info.is_decoder and not model.info.encoder_decoder:
        raise ConfigError(
            f"generate needs a decoder-only backbone; {type(model.backbone).__name__} is "
            "bidirectional (every position sees the whole input)"
        )
    heads = sorted(model.head_configs)
    unknown = sorted(ignore - set(heads))
    if unknown:
        raise ConfigError(f"ignore_heads={unknown} names no head of the model; heads: {heads}")
    lm = _lm_head(model, lm_name)
    if lm in ignore:
        raise ConfigError(
            f"ignore_heads names {lm!r}, the causal-LM head generate chooses tokens with; "
            "leave it out of ignore_heads, or pass lm_head_name= to choose another causal-LM head."
        )
    cfg = model.head_configs[lm]
    vocab = model.info.vocab_size
    if vocab is not None and cfg.num_outputs != vocab:
        raise ConfigError(
            f"HeadConfig(name={lm!r}): num_outputs={cfg.num_outputs} is not the vocabulary size "
            f"({vocab}); generate needs a causal-LM head over the whole vocabulary"
        )
    hooks = model.state_keys()
    if model.info.encoder_decoder and not hooks[lm].on_decoder:
        raise ConfigError(
            f"HeadConfig(name={lm!r}) reads the encoder (stack='encoder'), but generate on an "
            "encoder–decoder model chooses tokens with a causal-LM head on its decoder; give "
            f"it stack='decoder', or pass lm_head_name= to choose a decoder head."
        )
    active = [n for n in model.head_configs if n != lm and n not in ignore]
    on_encoder = [n for n in active if model.info.encoder_decoder and not hooks[n].on_decoder]
    stepped = [n for n in active if n not in on_encoder]
    return _Plan(
        lm=lm,
        lm_layer=hooks[lm],
        token_heads={n: hooks[n] for n in stepped if not model.head_configs[n].pred_for_sequence},
        sequence_heads={n: hooks[n] for n in stepped if model.head_configs[n].pred_for_sequence},
        encoder_heads={n: hooks[n] for n in on_encoder},
    )


def _lm_head(model: HeadedModel, name: str | None) -> str:
    causal = [n for n, c in model.head_configs.items() if c.is_causal_lm]
    if name is not None:
        if name not in causal:
            raise ConfigError(
                f"lm_head_name={name!r} is not a causal-LM head of the model; causal-LM heads: "
                f"{causal or 'none'}"
            )
        return name
    if not causal:
        raise ConfigError(
            "generate needs a causal-LM head to choose tokens with, but the model has none "
            f"(heads: {sorted(model.head_configs)}); add HeadConfig('lm_head', "
            "is_causal_lm=True) and build the model from a *ForCausalLM so that it starts from "
            "the backbone's LM head"
        )
    if "lm_head" in causal or len(causal) == 1:
        return "lm_head" if "lm_head" in causal else causal[0]
    raise ConfigError(
        f"the model has several causal-LM heads {causal}; pass lm_head_name= to choose one"
    )


def _check_prompt(
    model: HeadedModel, input_ids: Any, attention_mask: Any, kwargs: dict[str, Any]
) -> None:
    """The prompt: valid ids, left padding only, and no cache or embeddings handed in."""
    if "inputs_embeds" in kwargs:
        raise BatchError("generate takes input_ids; inputs_embeds is not supported here")
    given = [k for k in _CACHE_KWARGS if kwargs.get(k) is not None]
    if given:
        raise ConfigError(
            f"generate with heads builds its own KV cache; {given[0]}= is not supported (head "
            "outputs need every position's states)"
        )
    if model.info.encoder_decoder:  # the encoder's input: checked, padded on either side
        main = model.info.main_input
        given = {main: input_ids if main == "input_ids" else kwargs.get(main)}
        prepare_inputs(model.backbone, model.info, {**given, "attention_mask": attention_mask})
        return
    if input_ids is None:
        raise BatchError("generate needs input_ids (the prompts)")
    check_inputs(model.backbone, input_ids, None, attention_mask, None, None)
    if attention_mask is None:
        return
    mask = attention_mask.long()
    empty = (mask.sum(-1) == 0).nonzero().flatten().tolist()
    if empty:
        raise BatchError(f"attention_mask rows {empty} are all padding; each prompt needs a token")
    # left padding: once a row's tokens start, no padding follows (mask never drops 1 → 0)
    bad = (mask[:, 1:] < mask[:, :-1]).any(-1).nonzero().flatten().tolist()
    if bad:
        raise BatchError(
            f"attention_mask rows {bad} have padding after their tokens (right padding); "
            "generation continues after the last position, so prompts must be left-padded: "
            "tokenizer.padding_side = 'left'"
        )


def _effective_config(
    model: HeadedModel, generation_config: GenerationConfig | None, kwargs: dict[str, Any]
) -> GenerationConfig:
    """The settings generate will use (the given config or kwargs over the model's), to check
    the decoding mode and know eos and the number of rows; generate gets the originals."""
    cfg = copy.deepcopy(generation_config) if generation_config is not None else GenerationConfig()
    cfg.update(**default_generation_config(model).to_dict(), defaults_only=True)
    cfg.update(**kwargs)
    mode = cfg.get_generation_mode(kwargs.get("assistant_model"))
    if mode not in _ROW_STABLE_MODES:
        raise ConfigError(
            f"generate with heads supports greedy search and sampling (num_beams=1, no "
            f"assistant); got {mode.value}: beams and assistants reorder or rewind rows, so "
            "per-step head outputs would not follow them"
        )
    if cfg.use_cache is False:
        raise ConfigError("generate with heads needs the KV cache; use_cache=False is invalid")
    return cfg


def default_generation_config(model: HeadedModel) -> GenerationConfig:
    """The model's generation defaults: those of the ``*ForCausalLM`` it was built from, else
    derived from the backbone's config."""
    own = getattr(model, "generation_config", None)
    if isinstance(own, GenerationConfig):
        return own
    return GenerationConfig.from_model_config(model.backbone.config)


# ---------------------------------------------------------------------- the driver
class _HeadedDriver:
    """The ``forward`` that ``GenerationMixin.generate`` calls: one backbone pass per step,
    next-token logits from the causal-LM head, and the other heads on the same states."""

    def __init__(self, headed: HeadedModel, plan: _Plan) -> None:
        super().__init__(headed.backbone.config)
        self.backbone = headed.backbone  # registered, so device and dtype are the backbone's
        self.__dict__["_headed"] = headed  # not a submodule: no second copy of its parameters
        self.plan = plan
        self.generation_config = copy.deepcopy(default_generation_config(headed))
        self.recorder = Recorder()
        self.final_step = False
        self.prompt_length: int | None = None  # an encoder–decoder model's decoder start

    def _validate_model_kwargs(self, model_kwargs: dict[str, Any]) -> None:
        """transformers' check of generate's keywords against ``forward``'s parameters, less
        the backbone's own inputs (``pixel_values``, ...), which ``forward`` passes on
        through its ``**kwargs`` to the input stage."""
        own = set(self._headed.info.extra_inputs)
        super()._validate_model_kwargs({k: v for k, v in model_kwargs.items() if k not in own})

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Any = None,  # the cache's name before transformers 5.24.0
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        headed = self._headed
        cache = cache if cache is not None else past_key_values
        past = int(cache.get_seq_length()) if cache is not None else 0
        flags = {k: kwargs.get(k) for k in ("output_attentions", "output_hidden_states")}
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "past_key_values": cache,
            "inputs_embeds": inputs_embeds,
            "token_type_ids": token_type_ids,
            "use_cache": use_cache,
            **flags,
        }
        if past == 0:  # a vision-language model's images, with the prompt only
            own = headed.info.extra_inputs
            given = {k: v for k, v in kwargs.items() if k in own and v is not None}
            batch.update({k: v for k, v in given.items() if not isinstance(v, dict) or v})
        inputs = prepare_inputs(headed.backbone, headed.info, batch, check=False)
        logits, cache, out = self.step(
            inputs, flags, past, input_ids, position_ids, cache, logits_to_keep
        )
        return model_output(
            CausalLMOutputWithPast,
            cache,
            logits=logits,
            hidden_states=getattr(out, "hidden_states", None),
            attentions=getattr(out, "attentions", None),
        )

    def step(
        self,
        inputs: Any,
        flags: dict[str, Any],
        past: int,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        cache: Any,
        logits_to_keep: int | torch.Tensor,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """(next-token logits from the causal-LM head, the cache, the backbone's output) of
        one step: the backbone run on ``inputs`` as deep as the heads (and before the final
        step the LM head) need, every other head's output recorded. Early exit: a step fills
        the cache it was given in place; the final step needs none."""
        headed, plan = self._headed, self.plan
        layers = plan.head_layers if self.final_step else plan.head_layers | {plan.lm_layer}
        early = cache is not None and not any(flags.values())
        captured, out = run_stage(headed.backbone, headed.info, inputs, layers, early)
        logits = None
        if not self.final_step:
            hidden = slice_logits_to_keep(captured[plan.lm_layer], logits_to_keep)
            lm = headed.heads[plan.lm]
            logits = lm.from_features(lm.features(hidden))  # (batch, kept, vocab)
        self.recorder.record(past, input_ids, position_ids, captured, logits, headed, plan)
        return logits, cache_of(out) if out is not None else cache, out

    def final_inputs(
        self, last: torch.Tensor, seen: torch.Tensor, cache: Any, position_ids: Any
    ) -> dict[str, Any]:
        """The keyword arguments of the extra step over the last generated token (``seen``:
        the mask over every position so far)."""
        return {
            "input_ids": last,
            "attention_mask": seen,
            "position_ids": position_ids,
            "cache": cache,
            "use_cache": True,
        }


@functools.cache
def _driver_class(backbone_cls: type, encoder_decoder: bool = False) -> type:
    """A generating model class of the backbone's family (``GPT2PreTrainedModel``, ...), so that
    ``generate`` sees that family's flags (attention kernels, cache support) and class name;
    an encoder–decoder family's drives its decoder (``seq2seq.Seq2SeqDriver``)."""
    family = [
        c
        for c in backbone_cls.__mro__
        if isinstance(c, type) and issubclass(c, PreTrainedModel) and c is not PreTrainedModel
    ]
    root = family[-1] if family else PreTrainedModel
    name = f"Headed{backbone_cls.__name__}ForGeneration"
    bases = (Seq2SeqDriver,) if encoder_decoder else ()
    return type(name, (*bases, _HeadedDriver, root, GenerationMixin), {"__module__": __name__})


def _finish(
    driver: _HeadedDriver,
    out: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    config: GenerationConfig,
    at: str = "token",
) -> HeadedGenerateOutput:
    """Run the extra step over the last token, then stitch the recorded outputs together
    (``at``: see ``HEAD_OUTPUTS_AT``)."""
    sequences = out.sequences  # (rows, P + N)
    rows, total = sequences.shape
    seq2seq = driver.prompt_length is not None  # P: the decoder's start
    P = driver.prompt_length if seq2seq else input_ids.shape[1]
    N = total - P
    # rows = batch × num_return_sequences, each prompt's rows together (repeat_interleave)
    if seq2seq:
        prompt_mask = torch.ones((rows, P), dtype=torch.long)
    else:
        prompt_mask = attention_mask.long().repeat_interleave(rows // input_ids.shape[0], 0)
    prompt_mask = prompt_mask.to(sequences.device)
    generated_mask = until_eos(sequences[:, P:], config.eos_token_id)
    full_mask = torch.cat([prompt_mask, generated_mask], -1)
    dev = driver.device  # generate may keep the sequences where the prompts were
    last = sequences[:, -1:].to(dev)
    rec, plan = driver.recorder, driver.plan
    if N > 0 and (plan.token_heads or plan.sequence_heads):
        last_pos = rec.last_position_ids
        driver.final_step = True
        seen = torch.cat([prompt_mask, torch.ones_like(generated_mask)], -1).to(dev)
        position = None if last_pos is None else last_pos + 1
        driver(**driver.final_inputs(last, seen, cache_of(out), position))
    elif N > 0:  # no head needs the last token's states: only its log-probability
        rec.choose(total - 1, last)
    rec.flush()
    headed = driver._headed
    shift = 1 if at == "step" else 0  # "step": entry t read one position earlier
    head_outputs = {
        n: stitch(rec.token_outputs[n], P - shift, total - shift) for n in plan.token_heads
    }
    for name, layer in plan.sequence_heads.items():
        states = stitch(rec.states[layer], 0, total)  # (rows, P + N, hidden)
        head, mask = headed.heads[name], full_mask.to(dev)
        if at == "token":
            head_outputs[name] = head(states, mask)
        elif N > 0:  # entry t pools positions 0 .. P - 1 + t: (rows, N, num_outputs)
            steps = [head(states[:, : P + t], mask[:, : P + t]) for t in range(N)]
            head_outputs[name] = torch.stack(steps, 1)
    logprobs = torch.stack([rec.logprobs[p] for p in range(P, total)], -1) if N else None
    return HeadedGenerateOutput(
        sequences=sequences,
        token_logprobs=logprobs,
        head_outputs=head_outputs,
        generated_mask=generated_mask,
        attention_mask=full_mask,
        scores=getattr(out, "scores", None),
        logits=getattr(out, "logits", None),
    )
