"""``headkit predict CHECKPOINT --data FILE --output FILE``: every head's predictions.

One output row per input: the text and, per head, the class and ``<head>_prob`` for
classifiers, the 0/1 decision and ``<head>_prob`` for binary heads, the value for regressors
(token heads: a list per word). CSV, TSV or JSON Lines by the output's suffix. Importing this
module imports argparse only; ``run`` imports the rest.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .options import DATA_HELP, add_batching

HELP = "write every head's predictions for a data file"
EXAMPLE = """example:
  headkit predict runs/sentiment --data new.csv --output predictions.csv
writes the text and one column per head: the class and <head>_prob for classifiers,
the 0/1 decision and <head>_prob for binary heads, the value for regressors
(JSONL when --output ends in .jsonl)"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("--data", required=True, help=DATA_HELP)
    p.add_argument("--output", required=True, help="predictions file: .csv, .tsv or .jsonl")
    p.add_argument("--text-column", help="default: the one used in training")
    add_batching(p)


def run(args: argparse.Namespace) -> None:
    out = run_predict(
        args.checkpoint,
        args.data,
        args.output,
        text_column=args.text_column,
        batch_size=args.batch_size,
        limit=args.limit,
        progress=not args.quiet,
    )
    print(f"wrote {out}")


def run_predict(
    checkpoint: str | Path,
    data: str,
    output: str | Path,
    text_column: str | None = None,
    batch_size: int = 32,
    limit: int | None = None,
    progress: bool = True,
) -> Path:
    """Write one row per input: the text and, per head, its class and probability or value."""
    import torch
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from ..data.collator import HeadedCollator
    from .checkpoints import open_checkpoint
    from .datafiles import read_rows, require_columns, write_rows
    from .rows import encode_rows, readable

    model, tokenizer, settings = open_checkpoint(checkpoint)
    text_column = text_column or settings.get("text_column", "text")
    rows = read_rows(data, limit)
    require_columns(rows, {"--text-column": text_column}, data)
    configs = list(model.head_configs.values())
    max_length = settings.get("max_length", 128)
    examples, word_index = encode_rows(rows, tokenizer, configs, text_column, None, max_length)
    loader = DataLoader(examples, batch_size=batch_size, collate_fn=HeadedCollator(model))
    out_rows = [{text_column: r[text_column]} for r in rows]
    done = 0
    with torch.no_grad():
        for batch in tqdm(loader, desc="predict", disable=not progress):
            preds = model(**batch).preds_by_head
            for i in range(batch["input_ids"].shape[0]):
                row = out_rows[done + i]
                for name, cfg in model.head_configs.items():
                    p = preds[name][i]  # (num_outputs,) or (seq, num_outputs)
                    if not cfg.pred_for_sequence:
                        p = p[[j for j, w in enumerate(word_index[done + i]) if w >= 0]]
                    row.update(readable(name, cfg, p))
            done += batch["input_ids"].shape[0]
    return write_rows(output, out_rows)
