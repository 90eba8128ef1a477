"""``headkit predict CHECKPOINT --data FILE [--output FILE]``: every head's predictions.

One output row per input: ``row`` (the input's row number, from 0), the text (in a file) and,
per head, the class, ``<head>_prob`` and ``<head>_prob_<class>`` for each class for
classifiers, the 0/1 decision and ``<head>_prob`` for binary heads, the value for regressors
(token heads: a list per word). CSV, TSV or JSON Lines by the output's suffix; without
``--output``, CSV on standard output (without the text column) and nothing else there. The
output is checked before the model is loaded: it may not be an input, and an existing file is
replaced only with ``--overwrite``. Importing this module imports argparse only; ``run``
imports the rest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ConfigError
from .options import DATA_HELP, add_batching, add_encoding, add_overwrite

HELP = "write every head's predictions for a data file (a file, or CSV on standard output)"
EXAMPLE = """example:
  headkit predict runs/sentiment --data new.csv --output predictions.csv
  headkit predict runs/sentiment --data new.csv --quiet > predictions.csv
writes the row number and one column per head: the class, <head>_prob and
<head>_prob_<class> per class for classifiers, the 0/1 decision and <head>_prob for binary
heads, the value for regressors (JSONL when --output ends in .jsonl; a file also gets the
text column)"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("--data", required=True, help=DATA_HELP)
    p.add_argument(
        "--output",
        help="predictions file: .csv, .tsv or .jsonl (default: CSV on standard output)",
    )
    add_overwrite(p)
    p.add_argument("--text-column", help="default: the one used in training")
    add_encoding(p)
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
        overwrite=args.overwrite,
        encoding=args.encoding,
        device=args.device,
    )
    if out is not None:
        print(f"wrote {out}")


def run_predict(
    checkpoint: str | Path,
    data: str,
    output: str | Path | None = None,
    text_column: str | None = None,
    batch_size: int = 32,
    limit: int | None = None,
    progress: bool = True,
    overwrite: bool = False,
    encoding: str | None = None,
    device: str | None = None,
) -> Path | None:
    """Write one row per input (see the module docstring) to ``output``, or as CSV to
    standard output when it is None; returns the file written (None for standard output)."""
    from .datafiles import OUTPUT_SUFFIXES, read_rows, write_rows, write_table
    from .outputs import check_output_file, local_inputs

    if output is not None:
        check_output_file(output, local_inputs(data, checkpoint), overwrite)
        if Path(output).suffix.lower() not in OUTPUT_SUFFIXES:
            raise ConfigError(
                f"--output={str(output)!r}: unknown format {Path(output).suffix!r}; allowed: "
                ".csv, .tsv, .jsonl"
            )
    rows = read_rows(data, limit, encoding)
    with_text = output is not None
    out_rows = _predictions(
        checkpoint, rows, data, text_column, batch_size, progress, with_text, device
    )
    if output is None:
        write_table(sys.stdout, out_rows)
        sys.stdout.flush()
        return None
    return write_rows(output, out_rows)


def _predictions(
    checkpoint: str | Path,
    rows: list[dict],
    data: str,
    text_column: str | None,
    batch_size: int,
    progress: bool,
    with_text: bool,
    device: str | None = None,
) -> list[dict]:
    from .checkpoints import CLI_SETTINGS, read_settings
    from .datafiles import require_columns

    if Path(checkpoint, CLI_SETTINGS).is_file():  # the columns first: before torch is imported
        settings = read_settings(Path(checkpoint))
        require_columns(
            rows, {"--text-column": text_column or settings.get("text_column", "text")}, data
        )
    import torch
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from ..data.collator import HeadedCollator
    from ..metrics import batch_to_device
    from .checkpoints import open_checkpoint
    from .options import resolve_device
    from .rows import encode_rows, readable

    model, tokenizer, settings = open_checkpoint(checkpoint)
    model.to(resolve_device(device))  # --device
    text_column = text_column or settings.get("text_column", "text")
    require_columns(rows, {"--text-column": text_column}, data)
    configs = list(model.head_configs.values())
    max_length = settings.get("max_length", 128)
    examples, word_index = encode_rows(rows, tokenizer, configs, text_column, None, max_length)
    loader = DataLoader(examples, batch_size=batch_size, collate_fn=HeadedCollator(model))
    out_rows = [
        {"row": i, **({text_column: r[text_column]} if with_text else {})}
        for i, r in enumerate(rows)
    ]
    done = 0
    with torch.no_grad():
        for batch in tqdm(loader, desc="predict", disable=not progress):
            preds = {
                k: v.cpu()
                for k, v in model(**batch_to_device(batch, model.device)).preds_by_head.items()
            }
            for i in range(batch["input_ids"].shape[0]):
                row = out_rows[done + i]
                for name, cfg in model.head_configs.items():
                    p = preds[name][i]  # (num_outputs,) or (seq, num_outputs)
                    if not cfg.pred_for_sequence:
                        p = p[[j for j, w in enumerate(word_index[done + i]) if w >= 0]]
                    row.update(readable(name, cfg, p))
            done += batch["input_ids"].shape[0]
    return out_rows
