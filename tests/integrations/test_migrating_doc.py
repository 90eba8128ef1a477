"""docs/migrating.md is a tested page: its ```python blocks run in order, in one namespace,
on tiny local models (the convention is written at the top of the page's source)."""

from __future__ import annotations

import re
from pathlib import Path

import datasets
import pytest
import transformers
from th_ports import HUB_NAMES, load_dataset, tiny_hub, training_args

PAGE = Path(__file__).resolve().parents[2] / "docs" / "migrating.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks() -> list[str]:
    return BLOCK.findall(PAGE.read_text())


def test_the_page_states_its_convention_and_has_the_ports():
    text = PAGE.read_text()
    assert text.startswith("<!--") and "tests/integrations/test_migrating_doc.py" in text
    assert "linear_probe.ipynb" in text and "joint_multitask_learning.ipynb" in text
    assert len(blocks()) >= 5


def test_the_pages_code_runs(tmp_path_factory, tmp_path: Path, monkeypatch, single_thread):
    hub = tiny_hub(tmp_path_factory.getbasetemp() / "hub")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(transformers, "TrainingArguments", training_args)
    namespace: dict = {"__name__": "migrating_md"}
    for i, code in enumerate(blocks()):
        for name in HUB_NAMES:
            code = code.replace(f'"{name}"', repr(hub[name]))
        exec(compile(code, f"{PAGE.name} block {i + 1}", "exec"), namespace)
    assert namespace["new_evals"][1] == pytest.approx(namespace["evals"][1], rel=1e-5)
