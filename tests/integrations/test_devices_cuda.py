"""``--device cuda`` on the commands that load a checkpoint without running data through it.

``export`` loads the checkpoint on the GPU, traces the export there and checks it against the
model there; an ONNX graph is then run with onnxruntime on the CPU and compared with the GPU's
outputs within the export's own ``atol`` (1e-4, as a CPU export: the float32 matmuls are full
float32 on the GPU unless TF32 is switched on, which headkit does not do). ``convert`` and
``push --include-backbone`` save from the GPU: the same weights, byte for byte, as from the
CPU (checkpoint files differ only by the save's token: ``saved_files``).
"""

from __future__ import annotations

import copy
import json

import pytest
import test_deploy_cli
import torch
from onnx_checks import compare_with_eager, padded
from saved_files import saved_files
from th_fixtures import FULL, LORA
from transformers import AutoModelForTokenClassification

import headkit
from headkit import ConfigError
from headkit.cli.main import main

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (--device cuda)"),
]

DEVICE = "cuda"
checkpoint = test_deploy_cli.checkpoint  # the CPU checkpoint fixture


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_export_onnx_on_the_gpu_is_checked_there_and_runs_on_the_cpu(
    checkpoint, tmp_path, capsys, exporter
):
    folder, model = checkpoint
    out = tmp_path / "onnx"
    args = ["export", str(folder), "--output", str(out), "--exporter", exporter]
    assert main([*args, "--device", DEVICE, "--quiet"]) == 0
    assert f"({exporter} exporter, 2 of 2 blocks" in capsys.readouterr().out
    described = json.loads((out / "headkit_onnx.json").read_text())
    assert [o["name"] for o in described["outputs"]] == ["tags", "mood"]
    assert max(described["verified"]["max_abs_diff"].values()) <= 1e-4
    batch = padded(torch.randint(4, 48, (2, 9)), [9, 4], "left")
    batch["token_type_ids"] = torch.zeros_like(batch["input_ids"])
    assert max(compare_with_eager(model, out / "model.onnx", batch).values()) <= 1e-4


def test_export_transformers_on_the_gpu_writes_the_files_of_a_cpu_export(checkpoint, tmp_path):
    folder, model = checkpoint
    args = ["export", str(folder), "--format", "transformers", "--head", "tags", "--quiet"]
    cpu, gpu = tmp_path / "cpu" / "hf", tmp_path / "gpu" / "hf"  # one card title
    assert main([*args, "--output", str(cpu)]) == 0
    assert main([*args, "--output", str(gpu), "--device", DEVICE]) == 0
    # the sidecar and the card record the check's difference, measured on each device
    measured = {"headkit_transformers.json", "README.md"}
    written = saved_files(gpu, skip=measured)
    assert "model.safetensors" in written and written == saved_files(cpu, skip=measured)
    assert (
        json.loads((gpu / "headkit_transformers.json").read_text())["verified"]["max_abs_diff"]
        <= 1e-4
    )
    loaded = AutoModelForTokenClassification.from_pretrained(gpu, trust_remote_code=False)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded(input_ids=ids).logits, model(input_ids=ids).preds_by_head["tags"]
        )


@pytest.mark.parametrize("folder", [FULL, LORA], ids=["full", "lora"])
def test_convert_on_the_gpu_writes_the_weights_of_a_cpu_convert(tmp_path, folder):
    assert main(["convert", str(folder), str(tmp_path / "cpu"), "--quiet"]) == 0
    gpu = tmp_path / "gpu"
    assert main(["convert", str(folder), str(gpu), "--quiet", "--device", DEVICE]) == 0
    written = saved_files(gpu)
    assert any(n.endswith(".safetensors") for n in written)
    assert written == saved_files(tmp_path / "cpu")


def test_push_with_the_backbone_on_the_gpu_stages_the_files_of_a_cpu_push(checkpoint, tmp_path):
    folder, _ = checkpoint
    args = ["push", str(folder), "me/tagger", "--dry-run", "--include-backbone", "--quiet"]
    assert main([*args, "--output", str(tmp_path / "cpu")]) == 0
    assert main([*args, "--output", str(tmp_path / "gpu"), "--device", DEVICE]) == 0
    staged = saved_files(tmp_path / "gpu")
    assert any(n.startswith("backbone-TOKEN/") for n in staged)
    assert staged == saved_files(tmp_path / "cpu")


def test_a_model_object_is_exported_where_it_is(checkpoint, tmp_path):
    _, model = checkpoint
    with pytest.raises(ConfigError, match="the model given is on cpu"):
        headkit.export(model, tmp_path / "refused", "transformers", head="tags", device=DEVICE)
    on_gpu = copy.deepcopy(model).to(DEVICE)
    result = headkit.export(
        on_gpu, tmp_path / "hf", "transformers", head="tags", tokenizer=False, device=DEVICE
    )
    assert result.max_abs_diff <= 1e-4
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_a_model_object_is_pushed_from_where_it_is(checkpoint, tmp_path):
    _, model = checkpoint
    with pytest.raises(ConfigError, match="the model given is on cpu"):
        model.push_to_hub("me/tagger", dry_run=True, output=tmp_path / "staged", device=DEVICE)
    assert list(tmp_path.iterdir()) == []
