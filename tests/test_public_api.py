"""The public API of ``headkit``: every name stays importable, and importing it is lean.

``import headkit`` loads names on first use; ``from headkit import *`` imports torch and
transformers' modelling code but not the Trainer, peft, datasets, scikit-learn or matplotlib.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

import headkit

ROOT = Path(__file__).resolve().parents[1]

#: Every name ``from headkit import X`` gave before the import became lazy.
NAMES_BEFORE = [
    "ACTIVATIONS",
    "HEADS",
    "LOSSES",
    "POOLINGS",
    "BatchError",
    "CachedFeatures",
    "CheckpointError",
    "ConfigError",
    "Head",
    "HeadConfig",
    "HeadedCollator",
    "HeadedGenerateOutput",
    "HeadedModel",
    "HeadedModelOutput",
    "HeadedTrainer",
    "HeadkitError",
    "HeadwiseMetrics",
    "LossSpec",
    "LossWeighting",
    "MLPHead",
    "NonFiniteLossError",
    "PoolingStrategy",
    "ProbeResults",
    "ProbeRow",
    "SequencePooling",
    "__version__",
    "cache_features",
    "create_headed_qlora",
    "evaluate_head_wise",
    "get_model_params",
    "get_top_n_preds",
    "load_headed",
    "load_lora_with_heads",
    "merge_and_unload",
    "parse_layers",
    "predict_on_features",
    "print_trainable_parameters",
    "probe_layers",
    "to_sentence_transformer",
    "train_heads_on_features",
]
#: Importable by name, left out of ``__all__``.
BY_NAME_ONLY = {"HeadedTrainer", "SequencePooling", "merge_and_unload", "parse_layers"}
#: Must not be imported by ``import headkit`` or ``from headkit import *``.
NOT_IMPORTED = ("transformers.trainer", "peft", "datasets", "sklearn", "matplotlib")


@pytest.mark.parametrize("name", NAMES_BEFORE)
def test_every_name_stays_importable(name) -> None:
    namespace: dict = {}
    exec(f"from headkit import {name}", namespace)
    assert namespace[name] is getattr(headkit, name)
    assert name in dir(headkit)


def test_all_is_what_a_user_needs() -> None:
    # a registry like LOSSES, HEADS and POOLINGS; deploying; FSDP2 sharding; head rates;
    # calibration; reward models
    added = {"WEIGHTINGS", "export", "shard", "param_groups", "SlowHeadsWarning"}
    added |= {"PreferenceCollator", "preference_labels", "step_scores", "step_end_scores"}
    added |= {"calibrate", "Calibration"}
    assert set(headkit.__all__) == (set(NAMES_BEFORE) - BY_NAME_ONLY - {"__version__"}) | added
    assert len(headkit.__all__) == len(set(headkit.__all__))


def test_submodules_are_attributes_and_unknown_names_fail() -> None:
    assert headkit.packaged.__name__ == "headkit.packaged"
    assert headkit.config.HeadConfig is headkit.HeadConfig
    with pytest.raises(AttributeError, match="has no attribute 'HeadModel'"):
        headkit.HeadModel  # noqa: B018


def test_type_checkers_see_the_same_names() -> None:
    """The ``if TYPE_CHECKING:`` imports of ``headkit/__init__.py`` name each lazy name from
    the submodule the lazy table loads it from."""
    tree = ast.parse((ROOT / "headkit" / "__init__.py").read_text())
    block = next(
        n for n in tree.body if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n)
    )
    seen = {
        alias.name: node.module
        for node in ast.walk(block)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert seen == headkit._LAZY


def test_import_is_lean() -> None:
    """In a fresh interpreter: ``import headkit`` imports no torch; ``import *`` none of
    NOT_IMPORTED."""
    code = f"""
import sys
import headkit
print("IMPORT", sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules))
from headkit import *
print("STAR", sorted(m for m in {NOT_IMPORTED!r} if m in sys.modules))
"""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["IMPORT []", "STAR []"]
