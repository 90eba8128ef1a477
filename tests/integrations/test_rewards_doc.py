"""docs/rewards.md is a tested page: its ```python blocks run in order, in one namespace, on
tiny local models (the convention is written at the top of the page's source): MiniLM's
folder is a tiny random BERT with MiniLM's tokenizer, and the block that loads SmolLM2 is
replaced by a tiny Llama with a byte-level tokenizer that defines the same names."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from conftest import build_tiny

import headkit.packaged

PAGE = Path(__file__).resolve().parents[2] / "docs" / "rewards.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)

TINY_SMOLLM2 = """
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from conftest import build_tiny

alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
byte_level = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok_lm = PreTrainedTokenizerFast(tokenizer_object=byte_level)
lm = HeadedModel(
    build_tiny("llama", 2, vocab_size=300, bos_token_id=298, eos_token_id=299, pad_token_id=299),
    [HeadConfig("lm_head", is_causal_lm=True), HeadConfig("prm", num_outputs=2)],
)
"""


def blocks() -> list[str]:
    return BLOCK.findall(PAGE.read_text())


def tiny_minilm(folder: Path) -> Path:
    """A 4-layer random BERT of MiniLM's vocabulary, with MiniLM's tokenizer files."""
    real = headkit.packaged.minilm_path()
    build_tiny("bert", 4, vocab_size=30522, max_position_embeddings=512).save_pretrained(folder)
    for name in os.listdir(real):
        if "token" in name or name == "vocab.txt":
            shutil.copy(real / name, folder / name)
    return folder


def test_the_page_states_its_convention_and_covers_the_issue():
    text = PAGE.read_text()
    assert text.startswith("<!--") and "tests/integrations/test_rewards_doc.py" in text
    for topic in (
        "preference pairs",
        "Several rewards",
        "middle layer",
        "LoRA",
        "Export",
        "process",
    ):
        assert topic in text, topic
    assert sum("smollm2_path" in b for b in blocks()) == 1


def test_the_pages_code_runs(tmp_path: Path, monkeypatch, single_thread):
    folder = tiny_minilm(tmp_path / "minilm")
    monkeypatch.setattr(headkit.packaged, "minilm_path", lambda: folder)
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    namespace: dict = {"__name__": "rewards_md"}
    for i, code in enumerate(blocks()):
        if "smollm2_path" in code:
            code = TINY_SMOLLM2
        exec(compile(code, f"{PAGE.name} block {i + 1}", "exec"), namespace)
    assert 0.0 <= namespace["metrics"]["eval_reward_pairwise_accuracy"] <= 1.0
    assert namespace["same"] is True
    assert namespace["rm"].config.num_labels == 1
    assert len(namespace["out"].sequences) == 1
    assert namespace["newline"] == [namespace["tok_lm"].convert_tokens_to_ids("Ċ")]
    assert namespace["out"].head_outputs["prm"].shape[-1] == 2
