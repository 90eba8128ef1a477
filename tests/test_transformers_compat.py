"""headkit/_transformers.py is the one home of transformers' non-public names.

Every import from a transformers submodule (``transformers.modeling_utils``, ...), every
private name (``_get_feature_vector_attention_mask``), goes through it, so a minor release
that moves one breaks one module, and CI's two ends (the newest and the lowest declared
transformers, ``make test`` and ``make test-oldest``) both run these tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import transformers
from conftest import build_tiny
from transformers import Trainer

import headkit._transformers as compat
from headkit.integrations.trainer import HeadedTrainer

PACKAGE = Path(__file__).resolve().parents[1] / "headkit"
HOME = PACKAGE / "_transformers.py"

#: What the compatibility module provides (a new name is added here and to its __all__).
PROVIDED = {
    "CACHE_FIELD",
    "CausalLMOutputWithPast",
    "Conv1D",
    "GenerationMode",
    "ModelOutput",
    "Seq2SeqLMOutput",
    "TRAINER_OVERRIDES",
    "auto_model_types",
    "cache_of",
    "can_record_outputs",
    "convert_file_size_to_int",
    "default_logging_level",
    "feat_extract_output_lengths",
    "feature_vector_attention_mask",
    "hooks_inside_checkpoint",
    "image_processor",
    "install_capturing_hooks",
    "is_auto_class",
    "logging",
    "model_output",
    "records_hidden_states",
    "resized_lm_head",
    "revert_weight_conversion",
    "slice_logits_to_keep",
}

#: transformers' private attributes headkit reads; only the compatibility module names them.
PRIVATE_NAMES = {
    "_CAN_RECORD_REGISTRY",
    "_can_record_outputs",
    "_get_feat_extract_output_lengths",
    "_get_default_logging_level",
    "_get_feature_vector_attention_mask",
    "_get_resized_lm_head",
    "_model_mapping",
}


def _submodules() -> set[str]:
    """transformers' submodule names, read from its folder (``dir`` would import them all)."""
    root = Path(transformers.__file__).parent
    return {p.stem for p in root.iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}


def private_transformers_uses(path: Path, submodules: set[str]) -> list[str]:
    """Each non-public transformers name ``path`` uses: imports from a submodule or of a
    ``_name``, ``transformers.<submodule>`` attribute chains, and the private names above."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        where = f"{path.name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
            private = [a.name for a in node.names if a.name.startswith("_")]
            if node.module != "transformers" or private:
                found.append(f"{where} from {node.module} import {[a.name for a in node.names]}")
        elif isinstance(node, ast.Import):
            found += [
                f"{where} import {a.name}" for a in node.names if a.name.startswith("transformers.")
            ]
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "transformers"
            and (node.attr.startswith("_") or node.attr in submodules)
        ):
            found.append(f"{where} transformers.{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE_NAMES:
            found.append(f"{where} .{node.attr}")
        elif isinstance(node, ast.Constant) and node.value in PRIVATE_NAMES:
            found.append(f"{where} {node.value!r}")
    return found


def test_no_private_transformers_name_is_used_outside_the_compatibility_module():
    submodules = _submodules()
    found = [
        f"{path.relative_to(PACKAGE)}: {use}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != HOME
        for use in private_transformers_uses(path, submodules)
    ]
    assert found == [], "use headkit._transformers for: " + "; ".join(found)


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    """The scan above can fail: each form it looks for is found in a file holding it."""
    bad = tmp_path / "example.py"
    bad.write_text(
        "import transformers.utils\n"
        "from transformers.modeling_utils import slice_logits_to_keep\n"
        "from transformers import _private\n"
        "x = transformers.models.auto\n"
        "y = model._get_feature_vector_attention_mask\n"
        "z = getattr(cls, '_model_mapping', None)\n"
        "from transformers import PreTrainedModel\n"  # public: fine
    )
    found = private_transformers_uses(bad, _submodules())
    assert sorted(f.split(" ", 1)[0] for f in found) == [f"example.py:{i}" for i in range(1, 7)]


def test_the_module_provides_exactly_its_listed_names():
    assert set(compat.__all__) == PROVIDED
    assert all(hasattr(compat, name) for name in PROVIDED)
    private = [n for n in dir(compat) if not n.startswith("_") and n not in PROVIDED]
    assert set(private) <= {"annotations", "Any", "functools", "nn", "torch", "transformers"}


def test_the_trainer_methods_headed_trainer_overrides_exist_on_the_installed_trainer():
    """HeadedTrainer overrides a few private Trainer methods (its checkpoint format); a
    rename in transformers would silently bypass them, so both CI ends check the names."""
    overridden = {
        n
        for n in vars(HeadedTrainer)
        if n.startswith("_") and not n.startswith("__") and hasattr(Trainer, n)
    }
    assert overridden == set(compat.TRAINER_OVERRIDES)
    assert all(callable(getattr(Trainer, n)) for n in compat.TRAINER_OVERRIDES)


@pytest.mark.parametrize("keep", [0, 1, 3, torch.tensor([0, 2])])
def test_slice_logits_to_keep_keeps_the_last_positions_or_the_given_ones(keep):
    hidden = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    if isinstance(keep, torch.Tensor):
        expected = hidden[:, keep, :]
    else:
        expected = hidden[:, -keep:, :] if keep else hidden
    assert torch.equal(compat.slice_logits_to_keep(hidden, keep), expected)


def test_model_output_puts_the_cache_where_the_installed_transformers_reads_it():
    cache = transformers.DynamicCache()
    out = compat.model_output(compat.CausalLMOutputWithPast, cache, logits=torch.zeros(1, 1, 2))
    assert compat.CACHE_FIELD in compat.CausalLMOutputWithPast.__dataclass_fields__
    assert compat.cache_of(out) is cache
    assert getattr(out, compat.CACHE_FIELD) is cache


def test_auto_model_types_and_auto_classes():
    assert "gpt2" in compat.auto_model_types("CAUSAL_LM")
    assert "bert" in compat.auto_model_types("MASKED_LM")
    assert "t5" in compat.auto_model_types("SEQ_TO_SEQ_CAUSAL_LM")
    assert compat.auto_model_types("NO_SUCH_TASK") == frozenset()
    assert compat.is_auto_class(transformers.AutoModelForCausalLM)
    assert not compat.is_auto_class(transformers.GPT2Model)


def test_capturing_hooks_are_detected_and_installed_on_a_real_model():
    model = build_tiny("llama")  # records hidden_states by hooks where transformers has them
    records = compat.records_hidden_states(model)
    declared = bool(compat.can_record_outputs(type(model)).get("hidden_states"))
    assert records == (declared and compat._capturing is not None)  # none before 5.2
    compat.install_capturing_hooks(model)  # a no-op where there are none
    with torch.no_grad():
        out = model(torch.tensor([[1, 2, 3]]), output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1


def test_speech_model_methods_are_found_on_the_model_or_its_encoder():
    wav2vec2, whisper = build_tiny("wav2vec2"), build_tiny("whisper")
    assert compat.feat_extract_output_lengths(wav2vec2) is not None
    assert compat.feature_vector_attention_mask(wav2vec2) is not None
    assert compat.feat_extract_output_lengths(whisper) is not None  # on its encoder
    assert compat.feat_extract_output_lengths(build_tiny("bert")) is None


def test_file_sizes_and_conv1d():
    assert compat.convert_file_size_to_int("5MB") == 5 * 10**6
    assert compat.convert_file_size_to_int(123) == 123
    assert isinstance(build_tiny("gpt2").transformer.h[0].attn.c_attn, compat.Conv1D)
