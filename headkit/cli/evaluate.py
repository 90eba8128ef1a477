"""``headkit eval CHECKPOINT --data FILE``: per-head metrics of a checkpoint on a data file.

Columns default to those used in training (``headkit_cli.json`` in the checkpoint folder).
``--output`` is checked before the model is loaded (not an input; an existing file only with
``--overwrite``) and written atomically. Importing this module imports argparse only; ``run``
imports the rest.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .options import DATA_HELP, add_batching, add_encoding, add_overwrite, key_value

if TYPE_CHECKING:
    from ..model.headed import HeadedModel

HELP = "per-head metrics of a checkpoint on a data file"
EXAMPLE = """example:
  headkit eval runs/sentiment --data test.csv
  headkit eval runs/sentiment --data other.csv --record   # into its model card too
  headkit eval runs/sentiment --data test.parquet --text-column review \\
      --label-column sentiment=stars"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("--data", required=True, help=DATA_HELP)
    p.add_argument("--text-column", help="default: the one used in training")
    p.add_argument(
        "--label-column",
        type=key_value,
        action="append",
        metavar="TARGET=COLUMN",
        help="default: the ones used in training (repeatable)",
    )
    p.add_argument("--output", help="also write the metrics to this JSON file")
    p.add_argument(
        "--record",
        action="store_true",
        help="also record the metrics and the data's name in the checkpoint's headkit_cli.json "
        "and its model card (README.md: evaluation section, model-index); another data set "
        "adds a result, the same data replaces its earlier one; the weights are not touched",
    )
    add_overwrite(p)
    add_encoding(p)
    add_batching(p)


def run(args: argparse.Namespace) -> None:
    from .outputs import check_output_file, local_inputs, write_text

    if args.output:
        check_output_file(args.output, local_inputs(args.data, args.checkpoint), args.overwrite)
    if args.record:
        from .checkpoints import check_recordable

        check_recordable(args.checkpoint)  # before the model is loaded
    labels = dict(args.label_column) if args.label_column else None
    metrics = run_eval(
        args.checkpoint,
        args.data,
        text_column=args.text_column,
        label_columns=labels,
        batch_size=args.batch_size,
        limit=args.limit,
        progress=not args.quiet,
        encoding=args.encoding,
        device=args.device,
    )
    print(metrics_table(metrics))
    if args.output:
        write_text(args.output, json.dumps(metrics, indent=2) + "\n")
        print(f"wrote {args.output}")
    if args.record:
        from .checkpoints import record_metrics

        if not any(metrics.values()):
            raise ConfigError(
                f"--record: no head had labels in {args.data!r}; nothing to record in "
                f"CHECKPOINT={str(args.checkpoint)!r}",
                field="--record",
                value=str(args.checkpoint),
            )
        record_metrics(args.checkpoint, metrics, data=args.data)
        print(f"recorded in {args.checkpoint} (headkit_cli.json, README.md)")


def run_eval(
    checkpoint: str | Path,
    data: str,
    text_column: str | None = None,
    label_columns: dict[str, str] | None = None,
    batch_size: int = 32,
    limit: int | None = None,
    progress: bool = True,
    model: HeadedModel | None = None,
    encoding: str | None = None,
    device: str | None = None,
) -> dict[str, dict[str, float]]:
    """Per-head metrics of a checkpoint on a data file (columns default to training's)."""
    from .checkpoints import CLI_SETTINGS, read_settings
    from .datafiles import read_rows, require_columns, require_labels

    opened = None
    if model is None and not Path(checkpoint, CLI_SETTINGS).is_file():
        # no settings to check the columns by (not headkit train's folder): the loader's error
        from .checkpoints import open_checkpoint

        opened = open_checkpoint(checkpoint)
    settings = read_settings(Path(checkpoint))  # the columns first: before torch is imported
    max_length = settings.get("max_length", 128)
    if label_columns is None and (settings.get("format") or not settings.get("label_columns")):
        # reward data, or no recorded label columns: the heads tell the data's format
        from ..metrics import evaluate_head_wise
        from .checkpoints import open_checkpoint
        from .rewards import collator_for, data_format, encode_reward_rows

        rows = read_rows(data, limit, encoding)
        opened = opened or open_checkpoint(checkpoint, model)
        model, tokenizer, _ = opened
        if device is not None:  # --device (the batches follow the model)
            from .options import resolve_device

            model.to(resolve_device(device))
        kind = data_format(model.head_configs, list(rows[0]))
        if kind is not None:  # reward data: pairwise_accuracy, or the PRM's step accuracy
            separator = settings.get("step_separator", "\n")
            examples, _ = encode_reward_rows(
                rows, tokenizer, model.head_configs, kind, max_length, separator
            )
            collate = collator_for(model, tokenizer, kind)
            return evaluate_head_wise(
                model, examples, collate, batch_size=batch_size, progress=progress
            )
    text_column = text_column or settings.get("text_column", "text")
    label_columns = label_columns or settings.get("label_columns")
    if not label_columns:
        raise ConfigError(
            "--label-column is needed: the checkpoint does not name its label columns"
        )
    rows = read_rows(data, limit, encoding)
    labelled = {f"--label-column {t}": c for t, c in label_columns.items()}
    require_columns(rows, {"--text-column": text_column, **labelled}, data)
    require_labels(rows, labelled, data)
    from ..metrics import evaluate_head_wise
    from .checkpoints import open_checkpoint
    from .rows import encode_rows

    model, tokenizer, settings = opened or open_checkpoint(checkpoint, model)
    if device is not None:  # --device (the batches follow the model)
        from .options import resolve_device

        model.to(resolve_device(device))
    configs = list(model.head_configs.values())
    examples, _ = encode_rows(rows, tokenizer, configs, text_column, label_columns, max_length)
    return evaluate_head_wise(model, examples, batch_size=batch_size, progress=progress)


def metrics_table(metrics: dict[str, dict[str, float]]) -> str:
    """One line per head: ``name  metric value  metric value ...``."""
    lines = []
    for head, values in metrics.items():
        cells = "  ".join(f"{k} {v:.4f}" for k, v in values.items())
        lines.append(f"  {head:<20} {cells}")
    return "\n".join(lines) if lines else "  (no head had labels in the data)"
