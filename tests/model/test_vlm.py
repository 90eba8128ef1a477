"""Heads on vision-language models (Llava, Qwen2-VL): the language model's hidden states,
image tokens as positions like any other or pooled apart (pool_over), early exit in the
language model, processor-built batches, generate with images, LoRA checkpoints."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from conftest import IMAGE_SIZE, IMAGE_TOKEN, build_tiny
from peft import LoraConfig
from tiny_media import (
    assert_compiles_like_eager,
    assert_heads_match_hf,
    heads_at_every_layer,
    llava_processor,
    planted_images,
)

from headkit import (
    BatchError,
    ConfigError,
    HeadConfig,
    HeadedCollator,
    HeadedModel,
    create_headed_qlora,
    load_lora_with_heads,
)

pytestmark = pytest.mark.usefixtures("single_thread")

LAYERS = 3
PATCHES = (IMAGE_SIZE // 8) ** 2  # image tokens per image (CLS dropped)


def _llava_batch() -> dict[str, torch.Tensor]:
    """Two prompts with one image each, the second left-padded by two tokens."""
    g = torch.Generator().manual_seed(0)
    text = torch.randint(4, 40, (2, 4), generator=g)
    image = torch.full((2, PATCHES), IMAGE_TOKEN)
    ids = torch.cat([torch.ones(2, 1, dtype=torch.long), image, text], 1)
    ids[1] = torch.cat([torch.zeros(2, dtype=torch.long), ids[1, :-2]])
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    pixels = torch.randn(2, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels}


def _qwen_batch() -> dict[str, torch.Tensor]:
    """One prompt with a 4x4-patch image (4 merged image tokens between its markers)."""
    ids = torch.tensor([[5, 98, 96, 96, 96, 96, 99, 6, 7]])
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(16, 3 * 2 * 2 * 2, generator=torch.Generator().manual_seed(1)),
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
        "mm_token_type_ids": (ids == 96).long(),
    }


def _heads() -> list[HeadConfig]:
    return heads_at_every_layer(LAYERS, ("last", "mean"), "tok")


@pytest.mark.parametrize(("arch", "batch"), [("llava", _llava_batch), ("qwen2-vl", _qwen_batch)])
def test_heads_equal_the_language_models_hidden_states(arch: str, batch) -> None:
    backbone = build_tiny(arch, LAYERS)
    model = HeadedModel(backbone, _heads())
    assert model.info.modality == "vision-language"
    assert model.info.layers_path == "language_model.layers"  # not the vision tower's
    inputs = batch()
    out = model(**inputs)
    hf = backbone(**inputs, output_hidden_states=True)
    assert_heads_match_hf(model, out, hf.hidden_states, inputs.get("attention_mask"))


def test_pool_over_text_or_image_tokens_only() -> None:
    backbone = build_tiny("llava", LAYERS)
    heads = [
        HeadConfig(
            f"{which}",
            layer_hook=2,
            pred_for_sequence=True,
            pooling="mean",
            pool_over=which,
            num_outputs=3,
            loss_fct=None,
        )
        for which in ("all", "text", "image")
    ]
    model = HeadedModel(backbone, heads)
    with torch.no_grad():  # one projection for all three: only the pooled positions differ
        for name in ("text", "image"):
            model.heads[name].load_state_dict(model.heads["all"].state_dict())
    inputs = _llava_batch()
    out = model(**inputs)
    hidden = backbone.model(**inputs, output_hidden_states=True).hidden_states[2]
    real = inputs["attention_mask"].bool()
    image = inputs["input_ids"] == IMAGE_TOKEN
    for name, keep in (("all", real), ("text", real & ~image), ("image", real & image)):
        mean = (hidden * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
        expected = model.heads[name].from_features(mean)
        torch.testing.assert_close(out.preds_by_head[name], expected, msg=name)
    assert not torch.allclose(out.preds_by_head["text"], out.preds_by_head["image"])
    with pytest.raises(BatchError, match=r"pool_over='text'.*pass input_ids, not inputs_embeds"):
        embeds = backbone.get_input_embeddings()(inputs["input_ids"].clamp(max=50))
        model(inputs_embeds=embeds, attention_mask=inputs["attention_mask"])


def test_pool_over_is_validated_documented_and_saved(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"pool_over='pixels' is invalid; allowed: 'all', 'text'"):
        HeadConfig("h", pred_for_sequence=True, pool_over="pixels")
    with pytest.raises(ConfigError, match=r"pool_over applies only to sequence heads"):
        HeadConfig("h", pool_over="text")
    with pytest.raises(ConfigError, match=r"pool_over='image' needs a vision-language model"):
        HeadedModel(
            build_tiny("gpt2", 2), [HeadConfig("h", pred_for_sequence=True, pool_over="image")]
        )
    cfg = HeadConfig("h", pred_for_sequence=True, pool_over="image")
    assert cfg.to_dict()["pool_over"] == "image"
    assert "pool_over" not in HeadConfig("h", pred_for_sequence=True).to_dict()
    assert HeadConfig.from_dict(cfg.to_dict()) == cfg


def _block_calls(backbone, names: tuple[str, ...], model, inputs) -> Counter:
    """How often each block class among ``names`` runs during ``model(**inputs)``."""
    calls: Counter = Counter()

    def hook(module, *_) -> None:
        calls[type(module).__name__] += 1

    blocks = [m for m in backbone.modules() if type(m).__name__ in names]
    handles = [m.register_forward_hook(hook) for m in blocks]
    try:
        model(**inputs)
    finally:
        for h in handles:
            h.remove()
    return calls


def test_early_exit_stops_in_the_language_model() -> None:
    backbone = build_tiny("llava", 4)
    inputs = _llava_batch()
    for layer, lm_blocks in ((1, 1), (3, 3), (-1, 4)):
        model = HeadedModel(backbone, [HeadConfig("h", layer_hook=layer, pred_for_sequence=True)])
        calls = _block_calls(backbone, ("LlamaDecoderLayer", "CLIPEncoderLayer"), model, inputs)
        assert calls["LlamaDecoderLayer"] == lm_blocks
        assert calls["CLIPEncoderLayer"] == 2  # the image features are computed first, in full


def test_processor_batches_and_generate_with_an_image() -> None:
    processor = llava_processor()
    images, _ = planted_images(2)
    texts = ["<image> w1 w2 w3", "<image> w4"]
    examples = []
    for text, image in zip(texts, images):
        enc = processor(text=text, images=image, return_tensors="pt")
        examples.append({k: v[0] if k != "pixel_values" else v for k, v in enc.items()})
    assert int((examples[0]["input_ids"] == IMAGE_TOKEN).sum()) == PATCHES
    hf = build_tiny("llava", 2, task="image-text-to-text")
    model = HeadedModel(
        hf,
        [
            HeadConfig("lm_head", is_causal_lm=True),
            HeadConfig("answer_known", num_outputs=2, pred_for_sequence=True, layer_hook=1),
        ],
    )
    batch = HeadedCollator(model, padding_side="left")(examples)
    assert batch["pixel_values"].shape == (2, 3, IMAGE_SIZE, IMAGE_SIZE)  # concatenated
    assert batch["attention_mask"][1].tolist()[:2] == [0, 0]
    torch.testing.assert_close(model(**batch).preds_by_head["lm_head"], hf(**batch).logits)
    options = {"max_new_tokens": 3, "min_new_tokens": 3, "do_sample": False}
    out = model.generate(**batch, **options)
    assert torch.equal(out.sequences, hf.generate(**batch, **options))
    plain = model(**{**batch, "input_ids": out.sequences, "attention_mask": out.attention_mask})
    torch.testing.assert_close(
        out.head_outputs["answer_known"], plain.preds_by_head["answer_known"]
    )


def test_lora_and_a_value_head_on_a_vlm_reload_exactly(tmp_path) -> None:
    build_tiny("llava", LAYERS).save_pretrained(tmp_path / "llava")
    value = HeadConfig(
        "value", num_outputs=1, pred_for_sequence=True, is_regression=True, loss_fct="mse"
    )
    torch.manual_seed(0)
    model = create_headed_qlora(
        tmp_path / "llava", head_configs=[value], lora_config=LoraConfig(r=4, lora_alpha=8)
    )
    adapted = {n.split(".lora_")[0] for n, _ in model.backbone.named_parameters() if ".lora_" in n}
    assert adapted and all(
        ".language_model.layers." in n or n.startswith("language_model.layers.") for n in adapted
    )
    inputs = _llava_batch()
    target = torch.tensor([0.5, -1.0])
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(3):
        model(**inputs, value=target).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    expected = model(**inputs).logits
    model.save_pretrained(tmp_path / "ckpt")
    assert not list((tmp_path / "ckpt").glob("backbone-*"))  # the base is referenced
    for load in (HeadedModel.from_pretrained, load_lora_with_heads):
        again = load(tmp_path / "ckpt")
        assert torch.equal(again(**inputs).logits, expected)


def test_compiles_as_one_graph_reading_transformers_capture_hooks() -> None:
    heads = [h for h in _heads() if h.layer_hook == 1]
    model = HeadedModel(build_tiny("llava", LAYERS), heads, check_inputs=False)
    assert_compiles_like_eager(model, _llava_batch())


def test_generate_refuses_a_model_that_numbers_positions_from_its_images() -> None:
    model = HeadedModel(
        build_tiny("qwen2-vl", 2, task="image-text-to-text"),
        [HeadConfig("lm_head", is_causal_lm=True)],
    )
    with pytest.raises(ConfigError, match=r"generate with heads does not support Qwen2VLModel"):
        model.generate(**_qwen_batch(), max_new_tokens=2)
