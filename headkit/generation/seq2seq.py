"""Generation with heads on an encoder–decoder model (T5, BART, Whisper).

transformers' ``generate`` runs the encoder once (``get_encoder``), then calls the driver's
``forward`` with the decoder's new tokens, the encoder's outputs and the cache at every step.
``Seq2SeqDriver.forward`` runs only the decoder, as deep as the heads need, through the same
input stage and hooked run as ``HeadedModel.forward`` (``prepare_decoder_inputs``,
``run_stage``); the next-token logits and every other head come from that same pass
(``generation._HeadedDriver.step``). Heads on the encoder (``stack="encoder"``) are computed
once per prompt by ``encoder_head_outputs``, which runs the encoder (the only run: its output
goes to ``generate`` as ``encoder_outputs``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers.modeling_outputs import Seq2SeqLMOutput

from ..backbone.inputs import BackboneInputs, prepare_decoder_inputs, prepare_inputs, run_stage

if TYPE_CHECKING:
    from .headed import HeadedModel


def encoder_head_outputs(
    headed: HeadedModel, heads: dict[str, Any], encoder_inputs: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], Any]:
    """(each encoder head's output on the prompts, the encoder's output for ``generate``):
    the encoder runs once, in full, with the heads' layers captured. ``heads``: name → the
    state it reads; ``encoder_inputs``: the encoder's input and ``attention_mask``. Sequence
    heads give (batch, num_outputs), token heads (batch, encoder positions, num_outputs)."""
    inputs = prepare_inputs(headed.backbone, headed.info, encoder_inputs, check=False)
    captured, encoder_outputs = run_stage(
        headed.backbone, headed.info, inputs, set(heads.values()), early_exit=False
    )
    masks = headed.head_masks(inputs)
    outputs = {name: headed.heads[name](captured[key], masks[name]) for name, key in heads.items()}
    return outputs, encoder_outputs


class Seq2SeqDriver:
    """Mixed into the generation driver (``generation._HeadedDriver``) of an encoder–decoder
    backbone: its encoder for ``generate``, a decoder-only ``forward``, and the inputs of the
    extra step over the last token."""

    def get_encoder(self, *args: Any, **kwargs: Any) -> torch.nn.Module:
        """The backbone's encoder (``generate`` runs it once per prompt)."""
        return self.backbone.get_encoder()

    @property
    def encoder(self) -> torch.nn.Module:
        """The backbone's encoder (``generate`` reads its inputs' names here)."""
        return self.backbone.get_encoder()

    @property
    def decoder(self) -> torch.nn.Module:
        """The backbone's decoder (``generate`` reads its inputs' names here)."""
        return self.backbone.get_decoder()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.Tensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: Any = None,
        cache: Any = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Any = None,  # the cache's name before transformers 5.24.0
        **kwargs: Any,
    ) -> Seq2SeqLMOutput:
        headed = self._headed
        cache = cache if cache is not None else past_key_values
        past = int(cache.get_seq_length()) if cache is not None else 0
        if past == 0:
            self.prompt_length = int(decoder_input_ids.shape[1])
        self.encoder_state = (encoder_outputs, attention_mask)  # for the extra final step
        flags = {k: kwargs.get(k) for k in ("output_attentions", "output_hidden_states")}
        batch = {
            "decoder_input_ids": decoder_input_ids,
            "decoder_attention_mask": decoder_attention_mask,
            "decoder_position_ids": kwargs.get("decoder_position_ids"),
            "past_key_values": cache,
            "use_cache": use_cache,
            **flags,
        }
        dec_kwargs, _ = prepare_decoder_inputs(headed.backbone, headed.info, batch, check=False)
        dec_kwargs["encoder_outputs"] = encoder_outputs
        encoder_inputs = {} if attention_mask is None else {"attention_mask": attention_mask}
        inputs = BackboneInputs(
            encoder_inputs, None, tuple(decoder_input_ids.shape), decoder_kwargs=dec_kwargs
        )
        logits, cache, out = self.step(
            inputs, flags, past, decoder_input_ids, None, cache, logits_to_keep
        )
        return Seq2SeqLMOutput(
            logits=logits,
            cache=cache,
            decoder_hidden_states=getattr(out, "hidden_states", None),
            decoder_attentions=getattr(out, "attentions", None),
        )

    def final_inputs(
        self, last: torch.Tensor, seen: torch.Tensor, cache: Any, position_ids: Any
    ) -> dict[str, Any]:
        """The keyword arguments of the extra step over the last generated token."""
        encoder_outputs, attention_mask = self.encoder_state
        return {
            "decoder_input_ids": last,
            "attention_mask": attention_mask,
            "encoder_outputs": encoder_outputs,
            "cache": cache,
            "use_cache": True,
        }
