"""Float inputs are checked like token ids, and images and image tokens must agree (issue 31,
item 3): each hostile batch below is a BatchError naming the input (and the row), raised
before the backbone runs, never NaN predictions or a torch shape error."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    IDEFICS3_IMAGE_TOKENS,
    IMAGE_SIZE,
    IMAGE_TOKEN,
    MEL_BINS,
    MEL_FRAMES,
    build_tiny,
)

from headkit import BatchError, HeadConfig, HeadedModel

pytestmark = pytest.mark.usefixtures("single_thread")

SEQ = HeadConfig("h", pred_for_sequence=True, num_outputs=2)
PATCHES = (IMAGE_SIZE // 8) ** 2  # the tiny Llava's image tokens per image


def _poison(x: torch.Tensor, row: int, value: float) -> torch.Tensor:
    x = x.clone()
    x[row].view(-1)[3] = value
    return x


def _model(arch: str, **kw) -> HeadedModel:
    return HeadedModel(build_tiny(arch, 2, **kw), [SEQ])


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_pixels_audio_spectrograms_and_embeddings_name_the_input_and_row(value):
    g = torch.Generator().manual_seed(0)
    cases = {
        "pixel_values": (_model("vit"), torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)),
        "input_values": (_model("wav2vec2"), torch.randn(3, 400, generator=g)),
        "input_features": (
            HeadedModel(build_tiny("whisper", 2), [SEQ]),
            torch.randn(3, MEL_BINS, MEL_FRAMES, generator=g),
        ),
        "inputs_embeds": (_model("bert"), torch.randn(3, 5, 32, generator=g)),
    }
    for name, (model, clean) in cases.items():
        model(**{name: clean})  # the clean batch runs
        with pytest.raises(BatchError, match=rf"^{name} row 2 holds {value}; allowed: finite"):
            model(**{name: _poison(clean, 2, value)})


def test_non_finite_decoder_embeddings_and_vlm_pixels_are_refused():
    t5 = _model("t5")
    ids = torch.randint(3, 90, (2, 4))
    embeds = _poison(torch.randn(2, 3, 32), 1, float("nan"))
    with pytest.raises(BatchError, match=r"^decoder_inputs_embeds row 1 holds nan"):
        t5(input_ids=ids, decoder_inputs_embeds=embeds)
    llava = HeadedModel(build_tiny("llava", 2), [SEQ])
    batch = _llava_batch()
    batch["pixel_values"] = _poison(batch["pixel_values"], 1, float("inf"))
    with pytest.raises(BatchError, match=r"^pixel_values row 1 holds inf"):
        llava(**batch)


def test_encoder_and_decoder_rows_must_agree():
    t5 = _model("t5")
    with pytest.raises(
        BatchError,
        match=r"^decoder_input_ids has 3 rows but the encoder's input_ids has 2; allowed: one "
        r"decoder row per encoder row$",
    ):
        t5(input_ids=torch.randint(3, 90, (2, 4)), decoder_input_ids=torch.randint(3, 90, (3, 2)))


def test_an_image_smaller_than_one_patch_names_the_patch_size():
    vit = _model("vit")
    with pytest.raises(
        BatchError,
        match=r"^pixel_values of \(4, 32\) pixels are smaller than one patch of ViTModel "
        r"\(patch_size=8\); allowed: images of at least 8x8 pixels$",
    ):
        vit(pixel_values=torch.randn(1, 3, 4, 32), interpolate_pos_encoding=True)


# ---------------------------------------------------------------------- vision-language batches
def _llava_batch() -> dict[str, torch.Tensor]:
    """Two prompts with one image each."""
    g = torch.Generator().manual_seed(0)
    text = torch.randint(4, 40, (2, 4), generator=g)
    ids = torch.cat(
        [torch.ones(2, 1, dtype=torch.long), torch.full((2, PATCHES), IMAGE_TOKEN), text], 1
    )
    pixels = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def test_llava_image_tokens_and_images_must_agree():
    llava = HeadedModel(build_tiny("llava", 2), [SEQ])
    batch = _llava_batch()
    llava(**batch)
    with pytest.raises(
        BatchError,
        match=rf"^input_ids hold {2 * PATCHES} image tokens \(id {IMAGE_TOKEN}\) but the batch has "
        r"no pixel_values; pass the images",
    ):
        llava(input_ids=batch["input_ids"])
    with pytest.raises(BatchError, match=r"^pixel_values must be a floating-point torch.Tensor, "):
        llava(**{**batch, "pixel_values": (batch["pixel_values"] * 100).long()})
    with pytest.raises(
        BatchError,
        match=rf"^input_ids hold {2 * PATCHES} image tokens \(id {IMAGE_TOKEN}\) but pixel_values "
        rf"hold 1 image\(s\) of {PATCHES} patches each \({PATCHES} tokens\)",
    ):
        llava(**{**batch, "pixel_values": batch["pixel_values"][:1]})
    text_only = torch.randint(4, 40, (2, 6))
    with pytest.raises(
        BatchError, match=r"^the batch has pixel_values of shape \(2, 3, 32, 32\) but"
    ):
        llava(input_ids=text_only, pixel_values=batch["pixel_values"])
    with pytest.raises(
        BatchError, match=r"^image_sizes of shape \(2, 2\) \(\[\[32, 32\], \[64, 32\]\]\)"
    ):
        llava(**batch, image_sizes=torch.tensor([[32, 32], [64, 32]]))


def test_qwen2_vl_image_grid_must_describe_the_pixels_and_the_tokens():
    qwen = HeadedModel(build_tiny("qwen2-vl", 2), [SEQ])
    ids = torch.tensor([[5, 98, 96, 96, 96, 96, 99, 6, 7]])
    batch = {
        "input_ids": ids,
        "pixel_values": torch.randn(16, 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(1)),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "mm_token_type_ids": (ids == 96).long(),
    }
    qwen(**batch)
    with pytest.raises(
        BatchError,
        match=r"^image_grid_thw \(\[\[1, 4, 8\]\]\) describes 32 patches, but pixel_values",
    ):
        qwen(**{**batch, "image_grid_thw": torch.tensor([[1, 4, 8]])})
    fewer = torch.tensor([[5, 98, 96, 96, 96, 6, 99, 6, 7]])
    with pytest.raises(
        BatchError,
        match=r"^input_ids hold 3 image tokens, but image_grid_thw describes 4 \(16 patches",
    ):
        qwen(**{**batch, "input_ids": fewer, "mm_token_type_ids": (fewer == 96).long()})
    with pytest.raises(BatchError, match=r"^image_grid_thw of shape \(1, 2\); expected one"):
        qwen(**{**batch, "image_grid_thw": torch.tensor([[4, 4]])})


def test_idefics3_image_tokens_must_be_the_real_images_merged_patches():
    """Idefics3 takes (batch, images, channels, height, width); all-zero images are padding."""
    idefics = HeadedModel(build_tiny("idefics3", 2), [SEQ])
    image = torch.full((2, IDEFICS3_IMAGE_TOKENS), IMAGE_TOKEN)
    ids = torch.cat([torch.ones(2, 1, dtype=torch.long), image, torch.randint(4, 40, (2, 4))], 1)
    pixels = torch.randn(2, 1, 3, IMAGE_SIZE, IMAGE_SIZE)
    idefics(input_ids=ids, pixel_values=pixels)
    padded = torch.cat([pixels, torch.zeros_like(pixels)], 1)  # a padding image per prompt
    idefics(input_ids=ids, pixel_values=padded)
    with pytest.raises(
        BatchError,
        match=rf"^input_ids hold {2 * IDEFICS3_IMAGE_TOKENS} image tokens \(id {IMAGE_TOKEN}\) but "
        rf"pixel_values hold 1 image\(s\) of {IDEFICS3_IMAGE_TOKENS} patches each",
    ):
        idefics(input_ids=ids, pixel_values=torch.cat([pixels[:1], torch.zeros_like(pixels[:1])]))


def test_finite_values_whose_sum_overflows_are_accepted():
    """The check sums first (one pass) and only looks closer when the sum is not finite."""
    from headkit.backbone.checks import check_finite

    big = torch.full((2, 4), 3e38)  # each finite, their sum is not
    check_finite("inputs_embeds", big)
    big[1, 2] = float("-inf")
    with pytest.raises(BatchError, match=r"^inputs_embeds row 1 holds -inf"):
        check_finite("inputs_embeds", big)
