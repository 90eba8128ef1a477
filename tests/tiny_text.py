"""A tiny word-piece tokenizer and text data with planted signals, built offline.

The vocabulary fits the tiny models of conftest (ids < VOCAB): special tokens, 40 words
``w0``..``w39``, the cue words ``good`` and ``not``, and the pieces ``un`` + ``##happy`` so
that "unhappy" splits into two sub-tokens.
"""

from __future__ import annotations

import random
from pathlib import Path

from conftest import VOCAB, build_tiny
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
WORDS = [f"w{i}" for i in range(40)]
CUES = ["good", "not", "un", "##happy"]


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A BERT-style fast tokenizer: [CLS] words [SEP], word pieces, pad id 0."""
    vocab = {t: i for i, t in enumerate(SPECIALS + WORDS + CUES)}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
    )


def save_tiny_text_model(path: Path, num_layers: int = 2) -> Path:
    """A tiny random BERT and the tokenizer above, saved to ``path`` (loadable by path)."""
    build_tiny("bert", num_layers=num_layers).save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def planted_texts(n: int, seed: int = 0) -> tuple[list[str], list[int], list[float]]:
    """Texts of 3-8 random words; label 1 iff "good" occurs (about 40% of texts); a score
    = the number of "good"s."""
    rng = random.Random(seed)
    texts, labels, scores = [], [], []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 8))]
        goods = rng.choice([0, 0, 0, 1, 2])
        for _ in range(goods):
            words.insert(rng.randrange(len(words) + 1), "good")
        texts.append(" ".join(words))
        labels.append(int(goods > 0))
        scores.append(float(goods))
    return texts, labels, scores


def tagged_sentences(n: int, seed: int = 0) -> tuple[list[list[str]], list[list[str]]]:
    """Word lists with one tag per word: "NEG" for the word after "not", "CUE" for "not" and
    "unhappy", "W" otherwise (some of the tags need context: the word after "not")."""
    rng = random.Random(seed)
    sents, tags = [], []
    for _ in range(n):
        words = [
            rng.choice(["not", "unhappy"] if rng.random() < 0.25 else WORDS)
            for _ in range(rng.randint(3, 8))
        ]
        t = []
        for i, w in enumerate(words):
            if w in ("not", "unhappy"):
                t.append("CUE")
            elif i > 0 and words[i - 1] == "not":
                t.append("NEG")
            else:
                t.append("W")
        sents.append(words)
        tags.append(t)
    return sents, tags
