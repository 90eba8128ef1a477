"""``headkit probe``: one linear probe per layer, held-out score against depth.

Reads texts and labels from a data file (and, with ``--test-data``, the test split to score
on from another), runs ``probe_layers`` and writes ``DIR/probe_results.json`` and
``DIR/probe_results.png`` (docs/probing.md); existing results are replaced only with
``--overwrite``, checked before the model is loaded. Importing this module imports argparse
only; ``run`` imports the rest.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import ConfigError
from .options import (
    DATA_HELP,
    add_batching,
    add_encoding,
    add_overwrite,
    floats,
    fraction,
    key_value,
    layers,
    poolings,
    seed,
    val_splits,
)

if TYPE_CHECKING:
    from ..probe.results import ProbeResults

HELP = "one linear probe per layer: score vs depth, error bars, control"
EXAMPLE = """example:
  headkit probe --model packaged:minilm --data reviews.csv --text-column text \\
      --label-column label --layers all --pooling mean,first --control --val-splits 3 \\
      --output runs/probe
  headkit probe --model ./my-bert --data pos.jsonl --task token --layers -4: --output runs/pos
  headkit probe --model packaged:minilm --data train.csv --test-data test.csv --output runs/p
  headkit probe --model ./my-vit --data images.csv --image-column path --output runs/vit
  headkit probe --model ./my-wav2vec2 --data clips.csv --audio-column wav --output runs/w2v
  headkit probe --model packaged:minilm --data train.csv --output runs/p --save runs/probe-head
  headkit probe --model packaged:minilm --data pairs.jsonl --output runs/reward
writes DIR/probe_results.json (held-out "accuracy" or "r2" per layer, per-class metrics, the
best probe's predictions; "pairwise_accuracy" and "mean_margin" for preference pairs: a
file with chosen / rejected columns, as TRL writes them) and DIR/probe_results.png; with
--test-data the probes are scored on that file (validation still comes from --data); --save
writes the best probe as a headkit checkpoint (headkit predict / eval / export read it)"""

#: The files ``headkit probe`` writes into its output folder.
RESULT_FILES = ("probe_results.json", "probe_results.png")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--model", required=True, help="path, hub id, packaged:minilm or packaged:smollm2")
    add("--data", required=True, help=DATA_HELP)
    add(
        "--test-data",
        help="score on this file (an official test split; same columns) instead of holding "
        "out --test-fraction of --data",
    )
    add("--text-column", default="text", help="default: text (token task: the words)")
    media = p.add_mutually_exclusive_group()
    media.add_argument(
        "--image-column",
        help="probe images instead of texts: a column of image paths (relative to the data "
        "file's folder) or a datasets Image column, read by the model folder's image processor",
    )
    media.add_argument(
        "--audio-column",
        help="probe audio instead of texts: a column of WAV paths (relative to the data "
        "file's folder) or a datasets Audio column, read by the model folder's feature extractor",
    )
    add("--label-column", default="label", help="default: label (token task: one per word)")
    add(
        "--task",
        choices=("classification", "regression", "token", "pairwise"),
        help="default: pairwise for data with chosen / rejected columns (preference pairs: a "
        "linear reward per layer), else classification",
    )
    # no string default: argparse would convert it (importing torch) before a usage error
    add("--layers", type=layers, help="all (default), 0,3,6 or -4: (0 = embeddings)")
    add("--pooling", type=poolings, help="mean (default), or several: mean,first,last,max")
    add("--control", action="store_true", help="also probe a control task: selectivity")
    add(
        "--folds",
        type=val_splits,
        help="k-fold cross-validation picks the L2 and the layer (default: 5 folds)",
    )
    add(
        "--val-splits",
        type=val_splits,
        help="random validation splits instead of folds (each holds out 20%% of --data)",
    )
    add("--seed", type=seed, default=0, help="seed of the held-out split (default 0)")
    add(
        "--test-fraction",
        type=fraction,
        help="held-out share of --data (default 0.2; not with --test-data)",
    )
    add("--l2", type=floats, help="L2 penalties chosen from on validation (default 1e-4..1)")
    add("--output", required=True, help="folder for probe_results.json and .png")
    add(
        "--save",
        metavar="DIR",
        help="also write the best probe (on validation) as a headkit checkpoint folder: a "
        "Linear head with the probe's weights, for headkit predict / eval / export",
    )
    add_overwrite(p, "existing probe results in --output")
    add_encoding(p)
    add_batching(p)
    add(
        "--model-kwarg",
        type=key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="from_pretrained argument, e.g. gguf_file=model.gguf (repeatable)",
    )


def run(args: argparse.Namespace) -> None:
    from .options import check_model_kwargs
    from .outputs import local_inputs

    if args.test_data is not None and args.test_fraction is not None:
        raise ConfigError(
            "--test-fraction holds out part of --data, --test-data gives the test split; "
            "pass one of them"
        )
    inputs = local_inputs(args.data, args.test_data, args.model)
    out = check_results_folder(args.output, inputs, args.overwrite)
    save = _check_save(args, inputs)
    check_model_kwargs(dict(args.model_kwarg))
    pairs, rows = read_pairs(args, args.data)
    if pairs is not None:
        texts, labels = pairs, None
    else:
        args.task = args.task or "classification"
        texts, labels = read_examples(args, args.data, rows)
    test: dict = {}
    if args.test_data is not None:
        try:
            test_texts, test_labels = read_examples(args, args.test_data)
        except ConfigError as e:  # named as --test-data's (main reports "data file" as --data)
            raise ConfigError(f"--test-data={args.test_data!r}: {e}") from None
        test = {"test_inputs": test_texts, "test_labels": test_labels}
    # torch and transformers only now: every argument and column was checked
    from ..distributed.ranks import is_main
    from ..probe.sweep import probe_layers
    from .options import resolve_device

    options = {"l2": args.l2} if args.l2 else {}
    model_kwargs = dict(args.model_kwarg)
    where = resolve_device(getattr(args, "device", None))
    if where.type != "cpu":
        model_kwargs.setdefault("device_map", str(where))  # features computed there
    results = probe_layers(
        args.model,
        texts,
        labels,
        layers=args.layers or "all",
        pooling=args.pooling,
        task=args.task,
        control=args.control,
        seed=args.seed,
        test_fraction=args.test_fraction or 0.2,
        max_length=args.max_length,
        batch_size=args.batch_size,
        progress=not args.quiet,
        model_kwargs=model_kwargs,
        val_splits=args.val_splits,
        folds=args.folds,
        **test,
        **options,
    )
    if is_main():  # under torchrun every rank has the same results: rank 0 writes them
        print(results.table())
        write_results(results, out)
        if save is not None:
            save_probe(results, save, args)


def _check_save(args: argparse.Namespace, inputs: list[Path]) -> Path | None:
    """``--save``'s folder, refused before any work (as ``headkit train``'s output)."""
    if args.save is None:
        return None
    from ..checkpoint.paths import is_checkpoint
    from .outputs import check_output_folder

    if args.image_column or args.audio_column:
        option = "--image-column" if args.image_column else "--audio-column"
        raise ConfigError(
            f"--save={args.save!r} writes a checkpoint that headkit predict reads texts with; "
            f"with {option}, save the probe from Python (ProbeResults.to_headed)"
        )
    if Path(args.save).resolve() == Path(args.output).resolve():
        raise ConfigError(f"--save={args.save!r} is --output; give the checkpoint its own folder")
    return check_output_folder(
        args.save,
        inputs,
        args.overwrite,
        ours=is_checkpoint,
        what="a headkit checkpoint",
        option="--save",
    )


def save_probe(results: ProbeResults, folder: Path, args: argparse.Namespace) -> None:
    """The best probe as a checkpoint folder ``headkit predict`` / ``eval`` read: the head
    (named ``probe``, reading the label column), the tokenizer and ``headkit_cli.json``."""
    from ..backbone.sources import source_tokenizer
    from .checkpoints import save_trained

    model = results.to_headed()
    tokenizer = source_tokenizer(args.model, dict(args.model_kwarg))
    settings = {
        "text_column": args.text_column,
        "label_columns": {"probe": args.label_column},
        "max_length": args.max_length,
    }
    if results.task == "pairwise":  # headkit eval reads preference pairs with it
        settings = {"format": "pairs", "max_length": args.max_length}
    best = results.best()
    save_trained(model, tokenizer, folder, settings)
    print(f"wrote the probe of layer {best.layer} ({best.pooling}) to {folder}")


#: The columns of preference pairs (TRL's); ``prompt`` is optional.
PAIR_COLUMNS = ("chosen", "rejected")


def read_pairs(args: argparse.Namespace, source: str) -> tuple[list[dict] | None, list[dict]]:
    """(the preference rows of a data file, or None for other data; the rows as read):
    pairs for ``--task pairwise`` or, by default, a file with a ``chosen`` or ``rejected``
    column, conversations in JSON cells read as lists. Refused before torch is imported: a
    missing column, an empty side, an option that does not apply to pairs."""
    from .datafiles import columns_of, read_rows

    rows = read_rows(source, args.limit, args.encoding)
    present = columns_of(rows) if rows else []
    if args.task not in (None, "pairwise") or (
        args.task is None and not set(PAIR_COLUMNS) & set(present)
    ):
        return None, rows
    args.task = "pairwise"
    allowed = "preference pairs need the columns chosen and rejected (prompt optional)"
    for column in PAIR_COLUMNS:
        if column not in present:
            raise ConfigError(
                f"{source} has no {column!r} column (columns: {', '.join(present)}); {allowed}",
                field=column,
                value=None,
            )
    for i, row in enumerate(rows):
        for column in PAIR_COLUMNS:
            value = row.get(column)
            if value is None or (isinstance(value, str) and not value.strip()):
                raise ConfigError(
                    f"{column}={value!r} in {_row_of(source, i)} is empty; {allowed}, each a "
                    "non-empty text or conversation",
                    field=column,
                    value=value,
                )
    for option, given in (
        ("--test-data", args.test_data),
        ("--control", args.control),
        ("--image-column", args.image_column),
        ("--audio-column", args.audio_column),
    ):
        if given:
            raise ConfigError(
                f"{option} does not apply to preference pairs ({source} has chosen / rejected "
                "columns); the probe holds out --test-fraction of the pairs",
                field=option,
                value=given,
            )
    from .rewards import _cells  # conversations in a CSV's JSON cells (imports torch)

    return _cells(rows), rows


def read_examples(
    args: argparse.Namespace, source: str, rows: list[dict] | None = None
) -> tuple[list, list]:
    """(inputs, labels) of a data file by the task: texts (or images / audio by
    ``--image-column`` / ``--audio-column``) and classes, numbers or per-word labels; empty
    label cells are refused with their row numbers."""
    from .datafiles import as_list, as_number, read_rows, require_columns, require_labels

    rows = rows if rows is not None else read_rows(source, args.limit, args.encoding)
    option, tc, lc = "--text-column", args.text_column, args.label_column
    if args.image_column or args.audio_column:
        option = "--image-column" if args.image_column else "--audio-column"
        tc = args.image_column or args.audio_column
    require_columns(rows, {option: tc, "--label-column": lc}, source)
    require_labels(rows, {"--label-column": lc}, source)
    from ..data.encoding import as_class  # (imports torch: after the checks)

    if args.task == "token" and option == "--text-column":
        texts = [as_list(r[tc], tc, i) for i, r in enumerate(rows)]
        labels = [[as_class(v) for v in as_list(r[lc], lc, i)] for i, r in enumerate(rows)]
        return texts, labels
    if option == "--text-column":
        inputs = [str(r[tc]) for r in rows]
    else:  # images or audio: paths beside the data file, or datasets cells
        audio = option == "--audio-column"
        inputs = [_media_cell(r[tc], Path(source).parent, audio) for r in rows]
        if not audio:
            for i, cell in enumerate(inputs):
                _check_image_file(cell, f"{option} {tc}: {_row_of(source, i)}")
    if args.task == "regression":
        return inputs, [as_number(r[lc], lc, i) for i, r in enumerate(rows)]
    return inputs, [as_class(r[lc]) for r in rows]


def check_results_folder(output: str, inputs: list[Path], overwrite: bool) -> Path:
    """The output folder, refused before any work when it is an input or a file, or holds
    results already (without ``overwrite``)."""
    from .outputs import check_output_file

    out = Path(output)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--output={output!r} is a file; a folder is written there")
    for name in RESULT_FILES:
        if (out / name).exists() and not overwrite:
            raise ConfigError(
                f"--output={output!r} holds {name} already; pass --overwrite to replace it"
            )
        check_output_file(out / name, inputs, overwrite)
    for source in inputs:
        if source.exists() and out.exists() and os.path.samefile(out, source):
            raise ConfigError(f"--output={output!r} is the input {str(source)!r}; write elsewhere")
    return out


def _media_cell(value: object, base: Path, audio: bool) -> object:
    """An image or audio cell: a path (relative paths found beside the data file) or what a
    ``datasets`` Image / Audio column holds (an Audio cell's bytes decoded here, so that it
    is not taken for an image)."""
    if isinstance(value, str) and not Path(value).is_absolute() and not Path(value).exists():
        return str(base / value)
    if audio and isinstance(value, dict) and value.get("bytes") and "array" not in value:
        from ..data.media import read_audio

        samples, rate = read_audio(value["bytes"])
        return {"array": samples, "sampling_rate": rate}
    return value


def _row_of(source: str, i: int) -> str:
    """Where data row ``i`` (0-based) of a data file is, for an error message."""
    suffix = Path(source).suffix.lower()
    if suffix in (".csv", ".tsv"):
        return f"row {i + 1} of {source} (line {i + 2}, after the header)"
    if suffix == ".jsonl":
        return f"row {i + 1} of {source} (line {i + 1})"
    return f"row {i + 1} of {source}"


def _check_image_file(cell: object, where: str) -> None:
    """An image path must exist and hold an image (its header and, for PNG, its checksums:
    ``PIL.Image.verify``, nothing decoded): refused naming the path and the data file's row."""
    if not isinstance(cell, (str, os.PathLike)):
        return
    path = Path(cell)
    if not path.is_file():
        raise ConfigError(f"{where}: image file {str(path)!r} does not exist")
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            image.verify()
    except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as e:
        raise ConfigError(f"{where}: {str(path)!r} is not a readable image ({e})") from None


def write_results(results: ProbeResults, out: Path) -> None:
    """``out/probe_results.json`` and, where matplotlib is installed, ``.png``, each written
    under a fresh name and renamed into place."""
    from .outputs import fresh_file, write_text

    out.mkdir(parents=True, exist_ok=True)
    json_path, png_path = (out / name for name in RESULT_FILES)
    write_text(json_path, results.to_json() + "\n")
    written = [str(json_path)]
    try:
        with fresh_file(png_path, suffix=".png") as tmp:
            results.plot(tmp)
            os.replace(tmp, png_path)
        written.append(str(png_path))
    except ConfigError as e:  # matplotlib missing: the JSON is still there
        print(f"headkit: no plot ({e})", file=sys.stderr)
    print(f"wrote {' and '.join(written)}")
