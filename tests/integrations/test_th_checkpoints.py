"""transformer-heads' checkpoints load with its recorded predictions, losses and generations
(recorded once from transformer-heads 0.2.2: fixtures/transformer_heads/record.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from saved_files import saved_files
from th_fixtures import (
    FULL,
    GPT2_BASE,
    HEADS_ONLY,
    LLAMA_BASE,
    LORA,
    assert_recorded_preds,
    batch,
    labels,
    records,
)
from transformers import GPT2LMHeadModel, GPT2Model, LlamaForCausalLM

from headkit import CheckpointError, ConfigError, HeadedModel, load_headed, load_lora_with_heads
from headkit.cli import main as cli_main
from headkit.compat import get_multi_head_transformer

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("folder", [FULL, LORA], ids=["full", "lora"])
def test_from_pretrained_gives_its_recorded_predictions(folder: Path):
    model = HeadedModel.from_pretrained(folder)
    assert_recorded_preds(model, folder.name)
    assert model.head_configs["seq"].pooling == "last"  # it read the last non-padding token


def test_every_loader_reads_both_formats():
    assert_recorded_preds(load_headed(FULL), "gpt2-full")
    assert_recorded_preds(load_headed(GPT2LMHeadModel, FULL), "gpt2-full")
    assert_recorded_preds(
        get_multi_head_transformer(GPT2LMHeadModel).from_pretrained(FULL), "gpt2-full"
    )
    assert_recorded_preds(load_lora_with_heads(LlamaForCausalLM, LORA), "llama-lora")
    assert_recorded_preds(load_lora_with_heads(LORA), "llama-lora")
    # its heads-only save (a quantised load_headed's) and its full save, onto a given backbone
    assert_recorded_preds(
        load_headed(GPT2LMHeadModel, str(GPT2_BASE), head_folder_path=HEADS_ONLY), "gpt2-heads"
    )
    assert_recorded_preds(load_headed(str(GPT2_BASE), head_folder_path=FULL), "gpt2-full")


def test_lora_format_merges_its_lm_head_adapter_and_injects_the_rest():
    model = load_lora_with_heads(LlamaForCausalLM, LORA)
    adapted = {n.split(".lora_A")[0] for n, _ in model.backbone.named_parameters() if "lora_A" in n}
    assert len(adapted) == 4 * 7  # every linear layer of the 4 blocks; lm_head is a head here
    plain = HeadedModel(
        LlamaForCausalLM.from_pretrained(LLAMA_BASE), list(model.head_configs.values())
    )
    lm, base = (
        model.heads["lm_head"].output_projection().weight,
        plain.heads["lm_head"].output_projection().weight,
    )
    assert not torch.allclose(lm, base)  # its LoRA update of lm_head is in the head


def test_a_model_class_of_another_family_is_refused():
    with pytest.raises(ConfigError, match=r"GPT2Model .*model_type='gpt2'.*model_type='llama'"):
        load_lora_with_heads(GPT2Model, LORA)
    with pytest.raises(ConfigError, match="model_type='llama'"):
        load_headed(LlamaForCausalLM, FULL)


def test_heads_only_and_missing_pieces_say_what_to_do(tmp_path: Path):
    with pytest.raises(CheckpointError, match=r"heads only .*load_headed\(ModelClass"):
        HeadedModel.from_pretrained(HEADS_ONLY)
    with pytest.raises(CheckpointError, match="holds no LoRA adapter"):
        load_lora_with_heads(FULL)
    broken = tmp_path / "broken"
    shutil.copytree(LORA, broken)
    (broken / "tok.safetensors").unlink()
    (broken / "adapter_config.json").write_text(
        (LORA / "adapter_config.json").read_text().replace('"llama-base"', f'"{LLAMA_BASE}"')
    )
    with pytest.raises(CheckpointError, match=r"tok.safetensors' is missing"):
        HeadedModel.from_pretrained(broken)
    pickled = tmp_path / "pickled"
    shutil.copytree(FULL, pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle files .*never loads"):
        HeadedModel.from_pretrained(pickled)


def test_its_losses_with_its_token_rule_switched_on():
    model = HeadedModel.from_pretrained(FULL).eval()
    rec = records()["gpt2-full"]
    with torch.no_grad():
        ours = model(**batch(), **labels())
    for name in ("tok", "reg"):  # token heads with ignore_pads: it dropped each row's last token
        assert abs(float(ours.loss_by_head[name]) - rec["loss_by_head"][name]) > 1e-4
        cfg = model.head_configs[name].replace(ignore_pads="transformer-heads")
        model.head_configs[name] = model.heads[name].config = cfg
    with torch.no_grad():
        th = model(**batch(), **labels())
    for name, value in rec["loss_by_head"].items():
        assert float(th.loss_by_head[name]) == pytest.approx(value, rel=1e-5), name
    assert float(th.loss) == pytest.approx(rec["loss"], rel=1e-5)
    # its adapted_loss_by_head left loss_weight out; headkit's includes it (0.5 for seqreg)
    assert float(th.adapted_loss_by_head["seqreg"]) == pytest.approx(
        0.5 * rec["loss_by_head"]["seqreg"], rel=1e-5
    )


def test_generation_at_step_is_its_alignment_and_token_is_one_position_later():
    model = HeadedModel.from_pretrained(LORA)
    g = records()["llama-lora"]["generate"]
    args = dict(max_new_tokens=g["max_new_tokens"], do_sample=False, eos_token_id=2, pad_token_id=2)
    step = model.generate(torch.tensor(g["prompt"]), head_outputs_at="step", **args)
    assert step.sequences.tolist() == g["sequences"]
    torch.testing.assert_close(step.logprobs, torch.tensor(g["logprobs"]), atol=1e-5, rtol=1e-4)
    for name, values in g["head_outputs"].items():  # sequence heads too: (batch, steps, n)
        torch.testing.assert_close(
            step.head_outputs[name], torch.tensor(values), atol=1e-5, rtol=1e-4
        )
    token = model.generate(torch.tensor(g["prompt"]), **args)
    torch.testing.assert_close(token.head_outputs["reg"][:, :-1], step.head_outputs["reg"][:, 1:])
    assert token.head_outputs["seq"].shape == (1, 2)  # one per finished sequence
    with pytest.raises(ConfigError, match="head_outputs_at='steps' is invalid"):
        model.generate(torch.tensor(g["prompt"]), head_outputs_at="steps", **args)


def test_convert_writes_a_headkit_checkpoint_atomically(tmp_path: Path):
    out = tmp_path / "converted"
    assert cli_main(["convert", str(LORA), str(out), "--quiet"]) == 0
    manifest = json.loads((out / "head_configs.json").read_text())
    assert manifest["format"] == "headkit" and manifest["adapter"]["path"].startswith("adapter-")
    assert cli_main(["convert", str(LORA), str(out), "--quiet"]) == 2  # exists: refused
    assert cli_main(["convert", str(LORA), str(out), "--quiet", "--overwrite"]) == 0
    assert cli_main(["convert", str(out), str(tmp_path / "again"), "--quiet"]) == 2  # not its kind
    assert cli_main(["convert", str(HEADS_ONLY), str(tmp_path / "h"), "--quiet"]) == 2  # --base
    assert (
        cli_main(
            ["convert", str(HEADS_ONLY), str(tmp_path / "h"), "--base", str(GPT2_BASE), "--quiet"]
        )
        == 0
    )
    assert_recorded_preds(HeadedModel.from_pretrained(tmp_path / "h"), "gpt2-heads")
    full = tmp_path / "full"
    assert cli_main(["convert", str(FULL), str(full), "--quiet"]) == 0
    assert any(p.name.startswith("backbone-") for p in full.iterdir())  # copied: self-contained
    assert_recorded_preds(HeadedModel.from_pretrained(full), "gpt2-full")
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temporary left


@pytest.mark.parametrize("folder", [FULL, LORA], ids=["full", "lora"])
def test_convert_on_the_cpu_device_writes_what_the_default_writes(tmp_path: Path, folder: Path):
    assert cli_main(["convert", str(folder), str(tmp_path / "default"), "--quiet"]) == 0
    cpu = tmp_path / "cpu"
    assert cli_main(["convert", str(folder), str(cpu), "--quiet", "--device", "cpu"]) == 0
    written = saved_files(cpu)
    assert any(name.endswith(".safetensors") for name in written)
    assert written == saved_files(tmp_path / "default")


def test_convert_refuses_a_device_torch_does_not_see_before_writing(tmp_path: Path, capsys):
    unseen = f"cuda:{max(7, torch.cuda.device_count())}"
    out = tmp_path / "converted"
    assert cli_main(["convert", str(LORA), str(out), "--quiet", "--device", unseen]) == 2
    err = capsys.readouterr().err
    assert f"--device={unseen!r}: torch sees no such device here" in err
    assert list(tmp_path.iterdir()) == []


def test_convert_titles_its_card_with_out_not_its_temporary_folder(tmp_path: Path):
    out = tmp_path / "converted"
    assert cli_main(["convert", str(LORA), str(out), "--quiet"]) == 0
    card = (out / "README.md").read_text()
    assert "\n# converted\n" in card and ".convert-" not in card
    assert HeadedModel.from_pretrained(out) is not None  # the card rendered again: it loads
