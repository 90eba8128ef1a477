"""The ``headkit`` command line: ``probe``, ``train``, ``eval``, ``predict`` and ``demo``.

Runs as ``headkit ...`` (console script) or ``python -m headkit ...``. Each command's
``--help`` ends with an example. A bad argument exits with status 2 and one line that names
the argument, its value and what is allowed (a missing column lists the columns present).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..errors import ConfigError, HeadkitError

_EXAMPLES = {
    "probe": """example:
  headkit probe --model packaged:minilm --data reviews.csv --text-column text \\
      --label-column label --layers all --pooling mean,first --control --seeds 3 \\
      --output runs/probe
  headkit probe --model ./my-bert --data pos.jsonl --task token --layers -4: --output runs/pos
writes DIR/probe_results.json (held-out "accuracy" or "r2" per layer) and DIR/probe_results.png""",
    "train": """example:
  headkit train configs/sentiment.yaml
config (paths relative to the config file; see docs/cli.md):
  model: packaged:minilm
  heads: [{name: sentiment, pred_for_sequence: true, pooling: mean, layer_hook: 4}]
  data: {train: train.csv, eval: test.csv, text_column: text,
         label_columns: {sentiment: label}}
  training: {epochs: 10, batch_size: 32, lr: 1.0e-3}
  output: runs/sentiment""",
    "eval": """example:
  headkit eval runs/sentiment --data test.csv
  headkit eval runs/sentiment --data test.parquet --text-column review \\
      --label-column sentiment=stars""",
    "predict": """example:
  headkit predict runs/sentiment --data new.csv --output predictions.csv
writes the text and one column per head: the class and <head>_prob for classifiers,
the value for regressors (JSONL when --output ends in .jsonl)""",
    "demo": """example:
  headkit demo                     # about a minute on 2 CPU cores
  headkit demo --examples 4000 --output runs/demo""",
}


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (argparse prints the whole usage first)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: an integer >= 1")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: a number in (0, 1)")
    return value


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}; allowed: comma-separated numbers > 0 (e.g. 1e-3,1e-2,0.1)"
        )
    return values


def _key_value(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; allowed: KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _layers(text: str) -> str:
    from ..probe.sweep import parse_layers

    try:
        parse_layers(text, 10**6)  # the syntax now; the range once the model is loaded
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}; allowed: 'all', comma-separated hidden_states indices "
            "('0,3,6'; 0 = embeddings, -1 = last) or slices ('-4:', '1:5')"
        ) from None
    return text


def _poolings(text: str) -> str:
    from ..probe.sweep import parse_poolings

    try:
        parse_poolings(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="headkit",
        description="Attach, train, save, load and probe heads on Hugging Face transformers.",
        epilog="example:\n  headkit demo\n  headkit probe --model packaged:minilm --data "
        "packaged:rotten_tomatoes --limit 500 --output runs/probe\n"
        "run 'headkit COMMAND --help' for a command's options and an example",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            description=help,
            epilog=_EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    _add_probe(command("probe", "one linear probe per layer: score vs depth, error bars, control"))
    _add_heads(command)
    p = command("demo", "probe the packaged MiniLM on the packaged reviews, then train a head")
    p.add_argument("--examples", type=_positive, default=2000, help="reviews used (default 2000)")
    p.add_argument("--seeds", type=_positive, default=3, help="default 3")
    p.add_argument("--output", default="runs/demo", help="default: runs/demo")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=_run_demo)
    return parser


_DATA_HELP = "CSV, JSONL, JSON, Parquet, a saved dataset folder or packaged:rotten_tomatoes"


def _add_probe(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--model", required=True, help="path, hub id, packaged:minilm or packaged:smollm2")
    add("--data", required=True, help=_DATA_HELP)
    add("--text-column", default="text", help="default: text (token task: the words)")
    add("--label-column", default="label", help="default: label (token task: one per word)")
    add("--task", default="classification", choices=("classification", "regression", "token"))
    add("--layers", default="all", type=_layers, help="all, 0,3,6 or -4: (0 = embeddings)")
    add("--pooling", type=_poolings, help="mean (default), or several: mean,first,last,max")
    add("--control", action="store_true", help="also probe a control task: selectivity")
    add("--seeds", type=_positive, default=3, help="validation splits to average (default 3)")
    add("--seed", type=int, default=0, help="seed of the held-out split (default 0)")
    add("--test-fraction", type=_fraction, default=0.2, help="held-out share (default 0.2)")
    add("--l2", type=_floats, help="L2 penalties chosen from on validation (default 1e-4..1)")
    add("--output", required=True, help="folder for probe_results.json and .png")
    _common(p)
    add(
        "--model-kwarg",
        type=_key_value,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="from_pretrained argument, e.g. gguf_file=model.gguf (repeatable)",
    )
    p.set_defaults(run=_run_probe)


def _add_heads(command: Any) -> None:
    p = command("train", "train heads from a YAML config; writes a checkpoint folder")
    p.add_argument("config", metavar="CONFIG.yaml")
    p.add_argument("--output", help="checkpoint folder (overrides the config's output)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(run=_run_train)

    p = command("eval", "per-head metrics of a checkpoint on a data file")
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("--data", required=True, help=_DATA_HELP)
    p.add_argument("--text-column", help="default: the one used in training")
    p.add_argument(
        "--label-column",
        type=_key_value,
        action="append",
        metavar="TARGET=COLUMN",
        help="default: the ones used in training (repeatable)",
    )
    p.add_argument("--output", help="also write the metrics to this JSON file")
    _common(p)
    p.set_defaults(run=_run_eval)

    p = command("predict", "write every head's predictions for a data file")
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("--data", required=True, help=_DATA_HELP)
    p.add_argument("--output", required=True, help="predictions file: .csv, .tsv or .jsonl")
    p.add_argument("--text-column", help="default: the one used in training")
    _common(p)
    p.set_defaults(run=_run_predict)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=_positive, default=32, help="default 32")
    p.add_argument(
        "--max-length", type=_positive, default=128, help="tokens per text (default 128)"
    )
    p.add_argument("--limit", type=_positive, help="read at most this many rows")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


#: Library messages that start with a parameter name are reported as the option's error.
_OPTIONS = {
    "layers=": "--layers",
    "pooling=": "--pooling",
    "task=": "--task",
    "seeds=": "--seeds",
    "model=": "--model",
    "data=": "--data",
    "data file": "--data",
    "CONFIG=": "CONFIG",
    "CHECKPOINT=": "CHECKPOINT",
}


def main(argv: list[str] | None = None) -> int:
    """Run a command; return its exit status (2 for bad arguments or inputs)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except HeadkitError as e:
        message = " ".join(str(e).split())
        option = next(
            (o for k, o in _OPTIONS.items() if message.startswith(k) and _has(args, o)), None
        )
        prefix = f"argument {option}: " if option else ""
        print(f"headkit {args.command}: error: {prefix}{message}", file=sys.stderr)
        return 2
    return 0


def _has(args: argparse.Namespace, option: str) -> bool:
    """Whether this command has ``option`` (so an error can be reported as that argument's)."""
    return hasattr(args, option.lstrip("-").replace("-", "_").lower())


# ---------------------------------------------------------------------- commands
def _run_probe(args: argparse.Namespace) -> None:
    from ..data.encoding import as_class
    from ..probe.sweep import probe_layers
    from .datafiles import as_list, as_number, read_rows, require_columns

    rows = read_rows(args.data, args.limit)
    wanted = {"--text-column": args.text_column, "--label-column": args.label_column}
    require_columns(rows, wanted, args.data)
    tc, lc = args.text_column, args.label_column
    if args.task == "token":
        texts = [as_list(r[tc], tc, i) for i, r in enumerate(rows)]
        labels = [[as_class(v) for v in as_list(r[lc], lc, i)] for i, r in enumerate(rows)]
    else:
        texts = [str(r[tc]) for r in rows]
        if args.task == "classification":
            labels = [as_class(r[lc]) for r in rows]
        else:
            labels = [as_number(r[lc], lc, i) for i, r in enumerate(rows)]
    options = {"l2": args.l2} if args.l2 else {}
    results = probe_layers(
        args.model,
        texts,
        labels,
        layers=args.layers,
        pooling=args.pooling,
        task=args.task,
        control=args.control,
        seeds=args.seeds,
        seed=args.seed,
        test_fraction=args.test_fraction,
        max_length=args.max_length,
        batch_size=args.batch_size,
        progress=not args.quiet,
        model_kwargs=dict(args.model_kwarg),
        **options,
    )
    print(results.table())
    _write_results(results, Path(args.output))


def _write_results(results: Any, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results.to_json(out / "probe_results.json")
    written = [str(out / "probe_results.json")]
    try:
        written.append(str(results.plot(out / "probe_results.png")))
    except ConfigError as e:  # matplotlib missing: the JSON is still there
        print(f"headkit: no plot ({e})", file=sys.stderr)
    print(f"wrote {' and '.join(written)}")


def _run_train(args: argparse.Namespace) -> None:
    from .heads import load_train_config, run_train

    config = load_train_config(args.config)
    if args.output:
        config["output"] = args.output
    result = run_train(config, progress=not args.quiet)
    losses = result["losses"]
    print(f"training loss: epoch 1 {losses[0]:.4f} -> epoch {len(losses)} {losses[-1]:.4f}")
    if "metrics" in result:
        print("held-out metrics (data.eval):")
        print(_metrics_table(result["metrics"]))
    print(f"checkpoint written to {result['checkpoint']}")


def _run_eval(args: argparse.Namespace) -> None:
    from .heads import run_eval

    labels = dict(args.label_column) if args.label_column else None
    metrics = run_eval(
        args.checkpoint,
        args.data,
        text_column=args.text_column,
        label_columns=labels,
        batch_size=args.batch_size,
        limit=args.limit,
        progress=not args.quiet,
    )
    print(_metrics_table(metrics))
    if args.output:
        Path(args.output).write_text(json.dumps(metrics, indent=2) + "\n")
        print(f"wrote {args.output}")


def _run_predict(args: argparse.Namespace) -> None:
    from .heads import run_predict

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


def _metrics_table(metrics: dict[str, dict[str, float]]) -> str:
    lines = []
    for head, values in metrics.items():
        cells = "  ".join(f"{k} {v:.4f}" for k, v in values.items())
        lines.append(f"  {head:<20} {cells}")
    return "\n".join(lines) if lines else "  (no head had labels in the data)"


def _run_demo(args: argparse.Namespace) -> None:
    from .demo import run_demo

    run_demo(args.examples, args.seeds, Path(args.output), progress=not args.quiet)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
