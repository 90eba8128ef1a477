"""The prelude of the transformer-heads ports (its notebooks and tests, and the code blocks of
docs/migrating.md): tiny local models under its hub names and synthetic data under its
dataset names, so its code runs as written, offline, in seconds.

``tiny_hub(root)`` saves a tiny GPT-2 and a tiny Llama (12 blocks, hidden 32, the tiny
word-piece tokenizer of tiny_text.py saved beside each) and returns ``{hub name: local path}``
for ``"gpt2"``, ``"meta-llama/Llama-2-7b-hf"``, ``"meta-llama/Meta-Llama-3-8B"`` and
``"mistralai/Mistral-7B-v0.1"`` (a Llama: the same family of blocks). ``load_dataset(name,
...)`` stands in for ``datasets.load_dataset`` for ``"imdb"`` (text, label: 1 iff "good"
occurs) and ``"wikitext"`` (text), small splits. ``training_args(**its)`` is
``TrainingArguments`` with its arguments and a CPU-sized run on top (a few steps, no saves,
no bitsandbytes optimiser: ``optim="paged_adamw_32bit"`` needs CUDA).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from conftest import build_tiny
from datasets import Dataset, DatasetDict
from tiny_text import planted_texts, tiny_tokenizer
from transformers import TrainingArguments

HUB_NAMES = {
    "gpt2": "gpt2",
    "meta-llama/Llama-2-7b-hf": "llama",
    "meta-llama/Meta-Llama-3-8B": "llama",
    "mistralai/Mistral-7B-v0.1": "llama",
}


def tiny_hub(root: Path) -> dict[str, str]:
    """Save the tiny models (once per ``root``) and map the hub names to their folders."""
    return _saved(str(root))


@functools.cache
def _saved(root: str) -> dict[str, str]:
    paths = {}
    for arch in ("gpt2", "llama"):
        path = Path(root) / f"tiny-{arch}"
        if not path.exists():
            build_tiny(arch, num_layers=12, seed=3).save_pretrained(path)
            tiny_tokenizer().save_pretrained(path)
        paths[arch] = str(path)
    return {name: paths[arch] for name, arch in HUB_NAMES.items()}


def load_dataset(name: str, *_: Any, **__: Any) -> DatasetDict:
    """Synthetic stand-ins for the datasets its notebooks load from the hub."""
    if name == "imdb":
        splits = {"train": (12, 0), "test": (8, 1)}
        return DatasetDict(
            {
                split: Dataset.from_dict(dict(zip(("text", "label"), planted_texts(n, seed)[:2])))
                for split, (n, seed) in splits.items()
            }
        )
    if name == "wikitext":
        splits = {"train": (12, 2), "validation": (8, 3), "test": (4, 4)}
        return DatasetDict(
            {
                split: Dataset.from_dict({"text": planted_texts(n, seed)[0]})
                for split, (n, seed) in splits.items()
            }
        )
    raise ValueError(f"no synthetic stand-in for dataset {name!r}; allowed: imdb, wikitext")


def training_args(**its: Any) -> TrainingArguments:
    """``TrainingArguments(**its)`` sized for a CPU test: 2 steps, no saves, adamw_torch."""
    its.pop("optim", None)  # paged_adamw_32bit is bitsandbytes', CUDA only
    run = {"max_steps": 2, "save_strategy": "no", "use_cpu": True, "disable_tqdm": True}
    return TrainingArguments(**{**its, **run, "report_to": []})
