"""LoRA and QLoRA with heads: one call to create, adapters-only checkpoints, exact
reload, merging, every route peft offers, the Trainer, gradient checkpointing; 4-bit on CUDA.

Tiny random GPT-2 / Llama / BERT are saved to a folder first, so that the checkpoints can
reference their base by path (what makes them small).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ARCHS, VOCAB, build_tiny
from peft import LoraConfig, PeftModel, get_peft_model, inject_adapter_in_model
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModel,
    BitsAndBytesConfig,
    GPT2Model,
    LlamaForCausalLM,
    TrainingArguments,
)

from headkit import (
    CheckpointError,
    ConfigError,
    HeadConfig,
    HeadedModel,
    HeadedTrainer,
    create_headed_qlora,
    load_headed,
    load_lora_with_heads,
    merge_and_unload,
)
from headkit.checkpoint import MANIFEST, restore
from headkit.checkpoint.manifest import sha256_file
from headkit.integrations.peft import heads_to_save

pytestmark = pytest.mark.usefixtures("single_thread")

LORA = {"r": 4, "lora_alpha": 8}
#: where each tiny model keeps its blocks, inside its bare transformer (HeadedModel.backbone)
BLOCKS = {"gpt2": "h", "llama": "layers", "bert": "encoder.layer"}
LINEARS_PER_BLOCK = {"gpt2": 4, "llama": 7, "bert": 6}
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [20, 30, 40, 50, 60, 70]])
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]])
LABELS = {"cls": torch.tensor([0, 2, 1]), "tok": IDS % 4}


def heads() -> list[HeadConfig]:
    """A sequence classifier on layer 2 (of 3 blocks) and a token tagger on layer 1."""
    return [
        HeadConfig("cls", layer_hook=2, num_outputs=3, pred_for_sequence=True, pooling="mean"),
        HeadConfig("tok", layer_hook=1, num_outputs=4),
    ]


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny model (3 blocks) saved to a folder: the base a checkpoint references."""
    root = tmp_path_factory.mktemp("bases")
    for arch in ARCHS:
        build_tiny(arch).save_pretrained(root / arch)
    return {arch: root / arch for arch in ARCHS}


def create(path: Path, **kwargs: Any) -> HeadedModel:
    torch.manual_seed(0)
    kwargs.setdefault("head_configs", heads())
    return create_headed_qlora(path, lora_config=LoraConfig(**LORA), **kwargs)


def preds(model: Any) -> dict[str, torch.Tensor]:
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS, attention_mask=MASK).preds_by_head


def eval_loss(model: Any) -> float:
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=IDS, attention_mask=MASK, **LABELS).loss)


def train(model: Any, steps: int = 5, lr: float = 1e-2) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    model.train()
    for _ in range(steps):
        model(input_ids=IDS, attention_mask=MASK, **LABELS).loss.backward()
        opt.step()
        opt.zero_grad()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k] - b[k]).abs().max())


def lora_layers(module: torch.nn.Module) -> set[str]:
    return {n for n, m in module.named_modules() if isinstance(m, BaseTunerLayer)}


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# ---------------------------------------------------------------------- create
@pytest.mark.parametrize("arch", ARCHS)
def test_lora_targets_every_linear_of_the_blocks_that_run(arch, base_dirs):
    model = create(base_dirs[arch])
    blocks = BLOCKS[arch]
    # the deepest hook is layer 2: blocks 0 and 1 run, block 2 never does (early exit)
    assert {n.split(f"{blocks}.")[1].split(".")[0] for n in lora_layers(model.backbone)} == {
        "0",
        "1",
    }
    assert len(lora_layers(model.backbone)) == 2 * LINEARS_PER_BLOCK[arch]
    assert not lora_layers(model.heads)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.heads.parameters())


def test_layers_to_transform_counts_the_backbones_blocks(base_dirs):
    lora = LoraConfig(target_modules=["c_attn"], layers_to_transform=[1], **LORA)
    model = create_headed_qlora(base_dirs["gpt2"], lora_config=lora, head_configs=heads())
    assert lora_layers(model.backbone) == {"h.1.attn.c_attn"}


@pytest.mark.parametrize("arch", ARCHS)
def test_gradients_reach_exactly_the_lora_weights_and_trainable_heads(arch, base_dirs):
    configs = [*heads(), HeadConfig("frozen", layer_hook=1, num_outputs=2, trainable=False)]
    model = create(base_dirs[arch], head_configs=configs)
    before = eval_loss(model)
    model.train()
    model(input_ids=IDS, attention_mask=MASK, **LABELS).loss.backward()
    for name, p in model.named_parameters():
        trained = ".lora_" in name or name.startswith(("heads.cls.", "heads.tok."))
        assert (p.grad is not None) == trained, name
    assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)
    train(model, steps=15)
    assert eval_loss(model) < 0.8 * before


@pytest.mark.parametrize("arch", ARCHS)
def test_save_reload_is_exact_and_the_checkpoint_holds_only_what_was_trained(
    arch, base_dirs, tmp_path
):
    model = create(base_dirs[arch])
    train(model)
    want = preds(model)
    model.save_pretrained(tmp_path / "ckpt")
    names = sorted(p.name.split("-")[0] for p in (tmp_path / "ckpt").iterdir())
    assert names == ["README.md", "adapter", "head_configs.json", "heads"]  # no backbone copy
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    assert manifest["format_version"] == 2
    assert manifest["backbone"]["kind"] == "reference"
    adapter = load_file(next((tmp_path / "ckpt").glob("adapter-*/adapter_model.safetensors")))
    lora = {n: p for n, p in model.backbone.named_parameters() if ".lora_" in n}
    assert len(adapter) == len(lora) and all(".lora_" in k for k in adapter)
    assert sum(t.numel() for t in adapter.values()) == sum(p.numel() for p in lora.values())
    base = (base_dirs[arch] / "model.safetensors").stat().st_size
    assert folder_bytes(tmp_path / "ckpt") < base / 4
    for load in (HeadedModel.from_pretrained, load_lora_with_heads):
        again = load(tmp_path / "ckpt")
        assert_same(preds(again), want)
        assert all(p.requires_grad == (".lora_" in n) for n, p in again.backbone.named_parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_merge_and_unload_keeps_predictions(arch, base_dirs, tmp_path):
    model = create(base_dirs[arch])
    train(model)
    want = preds(model)
    merged = merge_and_unload(model)
    assert merged is model and not lora_layers(model)
    for name, got in preds(model).items():
        torch.testing.assert_close(got, want[name], rtol=0, atol=1e-5)
    merged.save_pretrained(tmp_path / "merged")  # a plain checkpoint: the changed backbone copied
    assert not list((tmp_path / "merged").glob("adapter-*"))
    assert list((tmp_path / "merged").glob("backbone-*"))
    assert_same(preds(HeadedModel.from_pretrained(tmp_path / "merged")), preds(model))


def test_class_first_form_and_a_frozen_pretrained_lm_head(base_dirs, tmp_path):
    path = base_dirs["llama"]
    lm = [HeadConfig("lm_head", is_causal_lm=True)]
    torch.manual_seed(0)
    model = create_headed_qlora(
        LlamaForCausalLM, path, None, LoraConfig(**LORA), lm, train_lm_head=False
    )
    ref = LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():  # LoRA starts as the identity: the LM's own logits (real tokens)
        want = ref(IDS, attention_mask=MASK).logits[MASK.bool()]
    torch.testing.assert_close(preds(model)["lm_head"][MASK.bool()], want)
    assert not any(p.requires_grad for p in model.heads.parameters())
    assert model.head_configs["lm_head"].trainable is False
    model.save_pretrained(tmp_path / "ckpt")
    again = load_lora_with_heads(LlamaForCausalLM, tmp_path / "ckpt")
    assert not any(p.requires_grad for p in again.heads.parameters())  # stays frozen
    # the path-only form, head configs second as in load_headed
    only_path = create_headed_qlora(path, lm, lora_config=LoraConfig(**LORA))
    assert all(p.requires_grad for p in only_path.heads.parameters())


def test_gradient_checkpointing_gives_the_same_gradients(base_dirs):
    """Non-reentrant recomputation, with the forward stopping after the deepest hooked block:
    the loss still reaches every LoRA weight and head, with the gradients of a plain run."""
    grads = []
    for checkpointing in (False, True):
        model = create(base_dirs["llama"], gradient_checkpointing=checkpointing)
        train(model, steps=1, lr=1e-2)  # lora_B leaves zero, so lora_A gets gradients too
        model.train()
        model(input_ids=IDS, attention_mask=MASK, **LABELS).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert model.backbone.layers[0].gradient_checkpointing
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys() and any(".lora_A" in n for n in plain)
    for name, g in plain.items():
        assert g is not None and g.abs().sum() > 0, name
        torch.testing.assert_close(checkpointed[name], g, rtol=1e-5, atol=1e-7)


def test_lora_refuses_what_would_adapt_nothing_or_drop_a_setting(base_dirs):
    embeddings = [HeadConfig("emb", layer_hook=0, num_outputs=2)]
    with pytest.raises(ConfigError, match=r"no linear layer of the backbone runs before"):
        create(base_dirs["gpt2"], head_configs=embeddings)
    with pytest.raises(ConfigError, match=r"modules_to_save=\['cls'\]: \['cls'\] name no module"):
        create_headed_qlora(
            base_dirs["gpt2"],
            lora_config=LoraConfig(modules_to_save=["cls"], **LORA),
            head_configs=heads(),
        )


CALL_CASES = {
    "no-head-configs": (
        lambda d: create_headed_qlora(d["gpt2"], lora_config=LoraConfig(**LORA)),
        r"head_configs=None is invalid; a list of HeadConfig",
    ),
    "class-without-path": (
        lambda d: create_headed_qlora(LlamaForCausalLM, head_configs=heads()),
        r"create_headed_qlora\(LlamaForCausalLM, \.\.\.\) needs the model path or id next",
    ),
    "two-paths": (
        lambda d: create_headed_qlora(d["gpt2"], d["llama"], head_configs=heads()),
        r"give a model class and a path, or a path",
    ),
    "target-not-found": (
        lambda d: create_headed_qlora(
            d["gpt2"], lora_config=LoraConfig(target_modules=["q_proj"]), head_configs=heads()
        ),
        r"lora_config does not fit the backbone: Target modules \{'q_proj'\} not found",
    ),
    "load-two-paths": (
        lambda d: load_lora_with_heads(d["gpt2"], d["llama"]),
        r"give the checkpoint path once \(a model class may come first\)",
    ),
    "load-class-of-another-family": (
        lambda d: load_lora_with_heads(GPT2Model, _llama_lora_ckpt(d)),
        r"model class GPT2Model \(model_type='gpt2'\) does not match the backbone of "
        r"'.*llama-lora', LlamaModel \(model_type='llama'\)",
    ),
    "load-not-a-model-class": (
        lambda d: load_lora_with_heads(torch.nn.Linear, _llama_lora_ckpt(d)),
        r"model class Linear is not a transformers model class; '.*llama-lora' holds LlamaModel",
    ),
}


def _llama_lora_ckpt(dirs: dict[str, Path]) -> Path:
    """A LoRA checkpoint on the tiny Llama base (saved once per module)."""
    folder = dirs["llama"].parent / "llama-lora"
    if not folder.exists():
        create(dirs["llama"]).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("case", list(CALL_CASES))
def test_a_wrong_call_is_a_config_error(case, base_dirs):
    call, pattern = CALL_CASES[case]
    with pytest.raises(ConfigError, match=pattern):
        call(base_dirs)


def test_lora_without_peft_says_what_to_install(base_dirs, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # as if peft were not installed
    with pytest.raises(ConfigError, match=r"LoRA needs the peft package: pip install"):
        create_headed_qlora(base_dirs["gpt2"], head_configs=heads())


# ---------------------------------------------------------------------- the routes of the issue
def _peft_gpt2() -> Any:
    torch.manual_seed(0)
    return get_peft_model(build_tiny("gpt2"), LoraConfig(target_modules=["c_attn"], **LORA))


def test_a_peft_model_is_a_backbone_and_its_checkpoint_reloads_exactly(tmp_path):
    """Route 1: HeadedModel(get_peft_model(base, cfg), heads) takes the PeftModel as its
    backbone: adapters and heads train, the checkpoint holds them and reloads exactly."""
    model = HeadedModel(_peft_gpt2(), heads())
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {n for n, _ in model.named_parameters() if ".lora_" in n or "heads." in n}
    train(model)
    model.save_pretrained(tmp_path / "ckpt")
    # built in memory: the base is copied, as it was before peft, next to the adapter
    saved = load_file(next((tmp_path / "ckpt").glob("backbone-*/model.safetensors")))
    assert not [k for k in saved if "lora" in k or "base_layer" in k]
    assert_same(preds(HeadedModel.from_pretrained(tmp_path / "ckpt")), preds(model))


def test_a_backbone_with_adapters_keeps_them_trainable_and_saved(tmp_path):
    """Route 2: HeadedModel(peft_model.get_base_model(), heads) froze the adapters, and with
    freeze_base_model=False the reload re-initialised them silently."""
    for freeze in (True, False):
        model = HeadedModel(_peft_gpt2().get_base_model(), heads(), freeze_base_model=freeze)
        # adapters in the blocks the heads reach train (block h.2 never runs: early exit
        # freezes what it holds, adapters included)
        reached = [p for n, p in model.named_parameters() if ".lora_" in n and ".h.2." not in n]
        assert reached and all(p.requires_grad for p in reached)
        train(model)
        model.save_pretrained(tmp_path / str(freeze))
        again = HeadedModel.from_pretrained(tmp_path / str(freeze), freeze_base_model=freeze)
        assert_same(preds(again), preds(model))


def test_adapters_injected_into_the_backbone_reference_the_base(base_dirs, tmp_path):
    """Route 3: adapters injected into model.backbone made from_pretrained look on the hub."""
    model = load_headed(base_dirs["gpt2"], head_configs=heads())
    inject_adapter_in_model(LoraConfig(target_modules=["c_attn"], **LORA), model.backbone)
    train(model)
    model.save_pretrained(tmp_path / "ckpt")
    assert not list((tmp_path / "ckpt").glob("backbone-*"))
    assert_same(preds(HeadedModel.from_pretrained(tmp_path / "ckpt")), preds(model))
    # onto a plain backbone through load_headed, too: the adapter is injected, then loaded
    onto = load_headed(base_dirs["gpt2"], head_folder_path=tmp_path / "ckpt")
    assert_same(preds(onto), preds(model))


def trained_copies(peft_model: PeftModel) -> set[str]:
    """The modules peft trains as copies (``modules_to_save``) inside the HeadedModel."""
    return {
        n.removeprefix("base_model.model.").split(".modules_to_save.")[0]
        for n, p in peft_model.named_parameters()
        if p.requires_grad and ".modules_to_save." in n
    }


def test_get_peft_model_of_a_headed_model_keeps_heads_trainable_and_saved(tmp_path):
    """Route 4: get_peft_model(HeadedModel, LoraConfig(...)) froze every head."""
    torch.manual_seed(0)
    headed = HeadedModel(build_tiny("gpt2"), heads(), loss_weighting="uncertainty")
    peft_model = get_peft_model(headed, LoraConfig(target_modules=["c_attn"], **LORA))
    assert trained_copies(peft_model) == {"heads.cls", "heads.tok", "loss_weighting"}
    train(peft_model)
    peft_model.save_pretrained(tmp_path / "peft")
    saved = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    assert any(".heads.cls." in k for k in saved) and any("loss_weighting" in k for k in saved)
    torch.manual_seed(1)  # other random heads: the adapter must bring the trained ones
    fresh = HeadedModel(build_tiny("gpt2"), heads(), loss_weighting="uncertainty")
    assert_same(preds(PeftModel.from_pretrained(fresh, tmp_path / "peft")), preds(peft_model))
    want = preds(peft_model)
    merged = peft_model.merge_and_unload()
    assert isinstance(merged, HeadedModel)
    for name, got in preds(merged).items():
        torch.testing.assert_close(got, want[name], rtol=0, atol=1e-5)
    # the recipe spelt out works the same
    explicit = HeadedModel(build_tiny("gpt2"), heads())
    cfg = LoraConfig(target_modules=["c_attn"], modules_to_save=heads_to_save(explicit), **LORA)
    explicit = get_peft_model(explicit, cfg)
    assert trained_copies(explicit) == {"heads.cls", "heads.tok"}


def test_peft_task_types_that_cannot_drive_a_headed_model_are_refused():
    headed = HeadedModel(build_tiny("gpt2"), heads())
    cfg = LoraConfig(target_modules=["c_attn"], task_type="CAUSAL_LM", **LORA)
    with pytest.raises(ConfigError, match=r"task_type='CAUSAL_LM'.*leave task_type=None"):
        get_peft_model(headed, cfg)


def test_prompt_learning_is_refused_with_what_headkit_takes():
    from peft import PromptTuningConfig

    prompt = get_peft_model(
        build_tiny("gpt2"), PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2)
    )
    with pytest.raises(ConfigError, match=r"prompt-learning method.*such as LoRA"):
        HeadedModel(prompt, heads())


def test_adapters_outside_the_backbone_are_refused():
    torch.manual_seed(0)
    task = get_peft_model(build_tiny("gpt2"), LoraConfig(target_modules=["c_attn", "lm_head"]))
    with pytest.raises(ConfigError, match=r"outside the backbone.*\['lm_head'\]"):
        HeadedModel(task, heads())


def test_a_peft_loader_reads_the_adapter_folder(base_dirs, tmp_path):
    model = create(base_dirs["gpt2"])
    train(model)
    model.save_pretrained(tmp_path / "ckpt")
    adapter = next((tmp_path / "ckpt").glob("adapter-*"))
    plain = PeftModel.from_pretrained(AutoModel.from_pretrained(base_dirs["gpt2"]), adapter)
    model.eval()
    with torch.no_grad():
        ours = model.backbone(input_ids=IDS, attention_mask=MASK).last_hidden_state
        theirs = plain.eval()(input_ids=IDS, attention_mask=MASK).last_hidden_state
    assert torch.equal(ours, theirs)


# ---------------------------------------------------------------------- strict reload
@pytest.fixture
def lora_ckpt(base_dirs, tmp_path) -> Path:
    model = create(base_dirs["gpt2"])
    train(model, steps=2)
    model.save_pretrained(tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _rewrite_adapter(ckpt: Path, edit) -> None:
    """Change the adapter's tensors and record the new checksum (so only the content is bad)."""
    f = next(ckpt.glob("adapter-*/adapter_model.safetensors"))
    state = load_file(f)
    edit(state)
    save_file(state, f, metadata={"format": "pt"})
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["adapter"]["files_sha256"][f.name] = sha256_file(f)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


def _first_key(state: dict) -> str:
    return sorted(state)[0]


ADAPTER_CASES = {
    "adapter-tensor-missing": (
        lambda c: _rewrite_adapter(c, lambda s: s.pop(_first_key(s))),
        r"adapter does not match the model's LoRA layers: missing \['h\.0\.attn\.c_attn\.lora_A",
    ),
    "adapter-tensor-unexpected": (
        lambda c: _rewrite_adapter(
            c,
            lambda s: s.update(
                {"base_model.model.h.2.attn.c_attn.lora_A.weight": torch.ones(4, 32)}
            ),
        ),
        r"unexpected \['h\.2\.attn\.c_attn\.lora_A\.weight'\]",
    ),
    "adapter-tensor-wrong-shape": (
        lambda c: _rewrite_adapter(
            c, lambda s: s.update({_first_key(s).replace("lora_A", "lora_B"): torch.ones(96, 2)})
        ),
        r"'h\.0\.attn\.c_attn\.lora_B\.weight' has shape \(96, 2\), but the model's is \(96, 4\)",
    ),
    "adapter-tensor-nan": (
        lambda c: _rewrite_adapter(c, lambda s: s[_first_key(s)].fill_(float("nan"))),
        r"adapter tensor 'h\.0\.attn\.c_attn\.lora_A\.weight' holds NaN or infinite values",
    ),
    "adapter-file-corrupt": (
        lambda c: next(c.glob("adapter-*/adapter_model.safetensors")).write_bytes(b"garbage"),
        r"adapter file '.*adapter_model\.safetensors' is corrupt or truncated",
    ),
    "adapter-folder-missing": (
        lambda c: [f.unlink() for f in next(c.glob("adapter-*")).iterdir()],
        r"adapter file '.*' named in head_configs\.json is missing",
    ),
    "adapter-config-megatron": (
        lambda c: _edit_adapter_config(c, megatron_config={"tensor_model_parallel_size": 1}),
        r"megatron_config=.* is not supported in headkit checkpoints",
    ),
    "adapter-rank-beyond-any-bound": (
        lambda c: _edit_adapter_config(c, r=10**6),
        r"its adapter's r=1000000 is invalid; a LoRA rank from 1 to 4096",
    ),
    "adapter-rank-pattern-beyond-any-bound": (
        lambda c: _edit_adapter_config(c, rank_pattern={"h\\.0\\.attn\\.c_attn": 10**6}),
        r"its adapter's rank_pattern\['h.*c_attn'\]=1000000 is invalid; a LoRA rank from 1 to",
    ),
    "adapter-rank-not-the-files": (  # what peft would build is bounded by the file read
        lambda c: _edit_adapter_config(c, r=64),
        r"its adapter's config gives layer 'h\.0\.attn\.c_attn' rank 64, but its saved "
        r"lora_A tensor has rank \d+",
    ),
    "adapter-folder-symlinked-outside": (
        lambda c: _move_adapter_outside(c),
        r"adapter folder '.*adapter-[0-9a-f]{12}' leads outside the checkpoint",
    ),
}


def _move_adapter_outside(ckpt: Path) -> None:
    """The adapter folder replaced by a symlink to the same files outside the checkpoint."""
    folder = next(ckpt.glob("adapter-*"))
    outside = ckpt.parent / "outside-adapter"
    folder.rename(outside)
    folder.symlink_to(outside)


def _edit_adapter_config(ckpt: Path, **changes: Any) -> None:
    f = next(ckpt.glob("adapter-*/adapter_config.json"))
    f.write_text(json.dumps({**json.loads(f.read_text()), **changes}))
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["adapter"]["files_sha256"][f.name] = sha256_file(f)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("case", list(ADAPTER_CASES))
def test_a_bad_adapter_is_a_checkpoint_error(case, lora_ckpt):
    spoil, pattern = ADAPTER_CASES[case]
    spoil(lora_ckpt)
    with pytest.raises(CheckpointError, match=pattern):
        HeadedModel.from_pretrained(lora_ckpt)


def _edit_manifest(ckpt: Path, edit) -> None:
    manifest = json.loads((ckpt / MANIFEST).read_text())
    edit(manifest)
    (ckpt / MANIFEST).write_text(json.dumps(manifest))


MANIFEST_CASES = {
    "adapter-path-escapes": (
        lambda m: m["adapter"].update(path="../elsewhere"),
        CheckpointError,
        r"adapter\.path='\.\./elsewhere' is invalid; the name of an 'adapter-\*' folder",
    ),
    "quantization-not-an-object": (
        lambda m: m["backbone"].update(quantization="4bit"),
        CheckpointError,
        r"backbone\.quantization='4bit' is invalid; a bitsandbytes config",
    ),
    "quantization-not-bitsandbytes": (
        lambda m: m["backbone"].update(quantization={"quant_method": "gptq", "bits": 4}),
        CheckpointError,
        r"backbone\.quantization=\{'quant_method': 'gptq', 'bits': 4\} is invalid",
    ),
}


@pytest.mark.parametrize("case", list(MANIFEST_CASES))
def test_a_bad_adapter_or_quantization_entry_is_refused(case, lora_ckpt):
    edit, error, pattern = MANIFEST_CASES[case]
    _edit_manifest(lora_ckpt, edit)
    with pytest.raises(error, match=pattern):
        HeadedModel.from_pretrained(lora_ckpt)


def test_a_backbone_with_two_adapters_cannot_be_saved_as_one(base_dirs, tmp_path):
    model = create(base_dirs["gpt2"])
    inject_adapter_in_model(LoraConfig(target_modules=["c_attn"], **LORA), model.backbone, "two")
    with pytest.raises(CheckpointError, match=r"carries adapters \['default', 'two'\]"):
        model.save_pretrained(tmp_path / "ckpt")


def test_a_checkpoint_without_adapter_cannot_load_into_a_lora_model(base_dirs, tmp_path):
    plain = load_headed(base_dirs["gpt2"], head_configs=heads())
    plain.save_pretrained(tmp_path / "plain")
    with pytest.raises(CheckpointError, match=r"holds no LoRA adapter, but the model's backbone"):
        restore(tmp_path / "plain", model=create(base_dirs["gpt2"]))
    with pytest.raises(CheckpointError, match=r"holds no LoRA adapter; load it with"):
        load_lora_with_heads(tmp_path / "plain")


# ---------------------------------------------------------------------- the Trainer
def _examples(n: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (4 + i % 3,), generator=g).tolist()
        out.append({"input_ids": ids, "cls": i % 3, "tok": [t % 4 for t in ids]})
    return out


def _trainer(path: Path, out: Path, **kwargs: Any) -> HeadedTrainer:
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=2e-2,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        **kwargs,
    )
    data = _examples()
    return HeadedTrainer(model=create(path), args=args, train_dataset=data, eval_dataset=data)


def test_trainer_checkpoints_are_adapters_and_resume_and_best_model_work(base_dirs, tmp_path):
    path = base_dirs["gpt2"]
    best = _trainer(
        path,
        tmp_path / "best",
        eval_strategy="steps",
        eval_steps=2,
        load_best_model_at_end=True,
        metric_for_best_model="eval_loss",
    )
    best.train()
    ckpt = Path(best.state.best_model_checkpoint)
    assert sorted(p.name.split("-")[0] for p in ckpt.glob("*-*") if p.is_dir()) == ["adapter"]
    assert_same(preds(best.model), preds(HeadedModel.from_pretrained(ckpt)))

    straight = _trainer(path, tmp_path / "straight")
    straight.train()
    resumed = _trainer(path, tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=str(tmp_path / "straight" / "checkpoint-2"))
    a, b = straight.model.state_dict(), resumed.model.state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


# ---------------------------------------------------------------------- QLoRA (4-bit)
HAS_CUDA_AND_BNB = torch.cuda.is_available() and importlib.util.find_spec("bitsandbytes")


@pytest.mark.skipif(bool(HAS_CUDA_AND_BNB), reason="this machine has CUDA and bitsandbytes")
def test_asking_for_4_bit_without_cuda_names_what_is_missing_before_loading(tmp_path):
    q = BitsAndBytesConfig(load_in_4bit=True)
    # the path does not exist: a loading attempt would be a CheckpointError, not this
    with pytest.raises(ConfigError, match=r"needs a CUDA device and the bitsandbytes package") as e:
        create_headed_qlora(tmp_path / "nope", quantization_config=q, head_configs=heads())
    missing = str(e.value).split("missing:")[1]
    if not torch.cuda.is_available():
        assert "a CUDA device" in missing
    if importlib.util.find_spec("bitsandbytes") is None:
        assert "bitsandbytes package (pip install 'headkit[qlora]')" in missing


@pytest.mark.skipif(bool(HAS_CUDA_AND_BNB), reason="this machine has CUDA and bitsandbytes")
def test_a_recorded_4_bit_base_is_not_silently_loaded_unquantised(lora_ckpt):
    manifest = json.loads((lora_ckpt / MANIFEST).read_text())
    manifest["backbone"]["quantization"] = BitsAndBytesConfig(load_in_4bit=True).to_dict()
    (lora_ckpt / MANIFEST).write_text(json.dumps(manifest, default=str))
    with pytest.raises(ConfigError, match=r"needs a CUDA device"):
        HeadedModel.from_pretrained(lora_ckpt)
    # asked for explicitly, the unquantised base loads
    assert load_lora_with_heads(lora_ckpt, quantization_config=False) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA_AND_BNB, reason="needs CUDA and bitsandbytes")
def test_qlora_trains_4_bit_saves_adapters_and_reloads_4_bit(base_dirs, tmp_path):
    import bitsandbytes as bnb

    torch.cuda.reset_peak_memory_stats()
    q = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    torch.manual_seed(0)
    model = create_headed_qlora(
        LlamaForCausalLM,
        base_dirs["llama"],
        q,
        LoraConfig(**LORA),
        heads(),
        gradient_checkpointing=True,
    )
    assert isinstance(model.backbone.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
    assert all(p.dtype == torch.float32 and p.requires_grad for p in model.heads.parameters())
    ids, mask = IDS.cuda(), MASK.cuda()
    labels = {k: v.cuda() for k, v in LABELS.items()}
    model.eval()
    with torch.no_grad():
        before = float(model(input_ids=ids, attention_mask=mask, **labels).loss)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(15):
        model(input_ids=ids, attention_mask=mask, **labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, **labels)
    assert float(out.loss) < before
    model.save_pretrained(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / MANIFEST).read_text())
    assert manifest["backbone"]["quantization"]["load_in_4bit"] is True
    assert not list((tmp_path / "ckpt").glob("backbone-*"))
    again = load_lora_with_heads(tmp_path / "ckpt")
    assert isinstance(again.backbone.layers[0].self_attn.q_proj.base_layer, bnb.nn.Linear4bit)
    with torch.no_grad():
        got = again.eval()(input_ids=ids, attention_mask=mask).preds_by_head
    assert_same(got, out.preds_by_head)
    peak = torch.cuda.max_memory_allocated() / 2**20
    print(f"QLoRA test model: peak GPU memory {peak:.1f} MiB")
