"""HeadedTrainer keeps its target columns itself: ``remove_unused_columns`` asks the model's
heads which columns it reads, not ``forward``'s signature."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import build_tiny
from datasets import Dataset
from transformers import TrainingArguments

from headkit import HeadConfig, HeadedModel, HeadedTrainer

pytestmark = pytest.mark.usefixtures("single_thread")


def test_headed_trainer_keeps_inputs_and_every_target_column(tmp_path: Path) -> None:
    heads = [
        HeadConfig("sent", num_outputs=3, pred_for_sequence=True),
        HeadConfig("ner", num_outputs=4, target="tags"),
    ]
    model = HeadedModel(build_tiny("gpt2", num_layers=2), heads)
    rows = [{"input_ids": [5, 6], "sent": 1, "tags": [0, 1], "text": "ab", "id": 3}]
    args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True)
    trainer = HeadedTrainer(model=model, args=args)
    kept = trainer._remove_unused_columns(Dataset.from_list(rows))
    assert sorted(kept.column_names) == ["input_ids", "sent", "tags"]
