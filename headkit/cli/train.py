"""``headkit train CONFIG.yaml``: train heads from a YAML config; writes a checkpoint folder.

The config names the backbone, the heads (HeadConfig fields), the data files and columns,
the training settings and the output folder (keys: docs/cli.md; the schema and the safe YAML
loader: ``train_config.py``). ``validation_fraction`` of the training rows is held out; after
each epoch the validation loss is measured, training stops once it has not improved for
``patience`` epochs, and the best epoch's weights are kept (``fitting.py``). With a frozen
backbone the heads train on cached features (one backbone pass); otherwise AdamW epochs run
through the whole model. The output folder is checked before anything is loaded. Importing
this module imports argparse only; ``run`` imports the rest.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .options import add_encoding, add_overwrite, add_quiet

HELP = "train heads from a YAML config; writes a checkpoint folder"
EXAMPLE = """example:
  headkit train configs/sentiment.yaml --output runs/sentiment
config (paths relative to the config file; see docs/cli.md):
  model: packaged:minilm
  heads: [{name: sentiment, pred_for_sequence: true, pooling: mean, layer_hook: 4}]
  data: {train: train.csv, eval: test.csv, text_column: text,
         label_columns: {sentiment: label}}
  training: {batch_size: 32}    # epochs and lr: by freeze_backbone; early stopping
  output: runs/sentiment        # or --output"""

#: ``epochs`` (a ceiling: early stopping usually ends sooner) and ``lr`` when the config
#: leaves them out, by whether the backbone is frozen (heads only) or trains too.
DEFAULTS = {True: {"epochs": 100, "lr": 3e-3}, False: {"epochs": 10, "lr": 5e-5}}


class LossStillFallingWarning(UserWarning):
    """Training reached its last epoch with the training loss still falling."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG.yaml")
    p.add_argument("--output", help="checkpoint folder (replaces the config's output)")
    add_overwrite(p, "a headkit checkpoint already in the output folder")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an interrupted run from the training state in the output folder "
        "(written after every epoch)",
    )
    add_encoding(p)
    add_quiet(p)


def run(args: argparse.Namespace) -> None:
    from .evaluate import metrics_table

    # the heads are checked with the data, before torch is imported (run_train)
    config = load_train_config(
        args.config, output=args.output, encoding=args.encoding, build_heads=False
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LossStillFallingWarning)  # printed below, one line
        result = run_train(
            config,
            progress=not args.quiet,
            overwrite=args.overwrite,
            device=args.device,
            resume=args.resume,
        )
    losses = result["losses"]
    if result.get("resumed_after"):
        print(f"resumed after epoch {result['resumed_after']}")
    print(f"training loss: epoch 1 {losses[0]:.4f} -> epoch {len(losses)} {losses[-1]:.4f}")
    if result["best_epoch"] is not None:
        how = "stopped early" if result["stopped_early"] else "ran every epoch"
        print(
            f"validation loss: best {result['val_losses'][result['best_epoch'] - 1]:.4f} at "
            f"epoch {result['best_epoch']} ({how}; its weights are kept)"
        )
    if result["warning"]:
        print(f"headkit train: warning: {result['warning']}", file=sys.stderr)
    for name, got in result.get("calibration", {}).items():
        cut = f", threshold {got.threshold:.3f}" if got.threshold is not None else ""
        print(
            f"calibrated {name} on validation: temperature {got.temperature:.3f}{cut} "
            f"(NLL {got.nll_before:.4f} -> {got.nll_after:.4f})"
        )
    if result.get("dropped"):
        print(f"dropped {result['dropped']} pairs longer than training.max_length (as TRL does)")
    if "metrics" in result:
        print("held-out metrics (data.eval):")
        print(metrics_table(result["metrics"]))
    print(f"checkpoint written to {result['checkpoint']}")


# ---------------------------------------------------------------------- config
def load_train_config(
    path: str | Path,
    output: str | None = None,
    encoding: str | None = None,
    build_heads: bool = True,
) -> dict[str, Any]:
    """Read and check a training config; relative paths are relative to the config's folder.

    ``output`` (``--output``, relative to the working folder) replaces the config's
    ``output``; ``encoding`` (``--encoding``) its ``data.encoding``. ``training.epochs`` and
    ``training.lr`` left out (or ``auto``) become ``DEFAULTS[freeze_backbone]``.
    ``build_heads=False`` leaves the heads as dicts (``HeadConfig`` imports torch):
    ``run_train`` builds them after the data's columns are checked.
    """
    from .train_config import load_yaml, parse_config

    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"CONFIG={str(path)!r} does not exist; a YAML file (see docs/cli.md)",
            field="CONFIG",
            value=str(path),
        )
    parsed = parse_config(load_yaml(path), str(path))
    training = parsed.training.model_dump()
    for key, value in DEFAULTS[training["freeze_backbone"]].items():
        if training[key] is None:
            training[key] = value
    if training["use_cached_features"] is True and not training["freeze_backbone"]:
        raise ConfigError(
            f"{path}: training.use_cached_features=true needs training.freeze_backbone=true "
            "(cached features would go stale as the backbone trains)"
        )
    _check_training(training, parsed.heads, path)
    for h in parsed.heads:
        if h.get("is_causal_lm") is True:
            raise ConfigError(
                f"{path}: head {h.get('name')!r} has is_causal_lm=true; headkit train trains "
                "classification, regression and token heads (use the Python API for LM heads)"
            )
    heads = head_configs(parsed.heads) if build_heads else [dict(h) for h in parsed.heads]
    base = path.parent
    data = parsed.data.model_dump()
    for key in ("train", "eval"):
        if data[key] and not str(data[key]).startswith("packaged:"):
            data[key] = str(base / data[key])
    if encoding is not None:
        data["encoding"] = encoding
    if output is None and parsed.output is None:
        raise ConfigError(f"{path}: no output folder; set output: in the config or pass --output")
    return {
        "model": parsed.model,
        "model_kwargs": parsed.model_kwargs.model_dump(exclude_unset=True),
        "heads": heads,
        "data": data,
        "training": training,
        "output": str(output) if output is not None else str(base / parsed.output),
        "config": str(path),
    }


def head_configs(heads: list[Any]) -> list[Any]:
    """The config's heads as ``HeadConfig`` objects (checked; dicts are converted)."""
    from ..config import HeadConfig

    return [h if isinstance(h, HeadConfig) else HeadConfig.from_dict(h) for h in heads]


def _check_training(training: dict[str, Any], heads: list, path: Path) -> None:
    """The training settings that depend on each other or on the heads."""
    if training["bf16"] and training["fp16"]:
        raise ConfigError(
            f"{path}: training.bf16=true and training.fp16=true; allowed: one of them, or neither"
        )
    if training["warmup_ratio"] and training["warmup_steps"]:
        raise ConfigError(
            f"{path}: training.warmup_ratio={training['warmup_ratio']!r} and "
            f"training.warmup_steps={training['warmup_steps']!r}; allowed: one of them"
        )
    allowed = _metric_names(heads)
    if training["metric_for_best_model"] not in allowed:
        raise ConfigError(
            f"{path}: training.metric_for_best_model={training['metric_for_best_model']!r} is "
            f"invalid; allowed: {', '.join(allowed)}"
        )


def _ours(folder: Path) -> bool:
    """A folder ``headkit train`` wrote: a checkpoint, or the training state and logs of a
    run that did not finish."""
    from .train_config import LOG_FOLDER, STATE_FOLDER

    names = {p.name for p in folder.iterdir()}
    if names and names <= {STATE_FOLDER, LOG_FOLDER}:
        return True
    from ..checkpoint.paths import is_checkpoint  # imports torch: asked only of a folder of files

    return is_checkpoint(folder)


def _metric_names(heads: list[Any]) -> list[str]:
    """What ``training.metric_for_best_model`` may name for these heads (dicts or
    HeadConfigs; read without importing torch)."""
    names = {"loss"}
    for h in heads:
        get = h.get if isinstance(h, dict) else (lambda k, d=None, h=h: getattr(h, k, d))
        if get("loss_fct", "cross_entropy") is None:
            continue
        found = ["mse", "mae", "r2"] if get("is_regression", False) else ["accuracy", "macro_f1"]
        names.update(found)
        names.update(f"{get('name')}_{m}" for m in [*found, "loss"])
    return sorted(names)


def check_output(config: dict[str, Any], overwrite: bool) -> Path:
    """Refuse the output folder before any work: an input, a file, a folder holding files
    that are not a headkit checkpoint (named), or a checkpoint without ``overwrite``."""
    from .outputs import check_output_folder, local_inputs

    data = config["data"]
    inputs = local_inputs(config.get("config"), data["train"], data["eval"], config["model"])
    return check_output_folder(
        config["output"],
        inputs,
        overwrite,
        ours=_ours,  # a checkpoint, or an unfinished run's training state
        what="a headkit checkpoint",
    )


# ---------------------------------------------------------------------- training
def run_train(
    config: dict[str, Any],
    progress: bool = True,
    overwrite: bool = False,
    device: str | None = None,
    resume: bool = False,
    features: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train the heads of a loaded config, save the checkpoint; return the per-epoch training
    and validation losses, the epoch kept, the checkpoint and held-out metrics. ``resume``:
    continue from the training state an interrupted run left in the output folder.
    ``features``: {head: (rows, width)} pooled features of every row of ``data.train``
    already computed by the same backbone (a probe sweep's, as ``headkit demo`` passes):
    the heads train on them without a backbone pass (``fitting.fit_heads``)."""
    from .datafiles import read_rows, require_columns, require_labels
    from .train_config import STATE_FOLDER

    if resume and not (Path(config["output"]) / STATE_FOLDER / "state.json").is_file():
        raise ConfigError(
            f"--resume: {config['output']!r} holds no training state ({STATE_FOLDER}/); "
            "start the run without --resume"
        )
    check_output(config, overwrite or resume)
    data, training = config["data"], config["training"]
    rows = read_rows(data["train"], data["limit"], data["encoding"])
    if data["label_columns"]:  # a table of texts and labels: checked before torch is imported
        labelled = {f"data.label_columns.{t}": c for t, c in data["label_columns"].items()}
        columns = {"data.text_column": data["text_column"], **labelled}
        require_columns(rows, columns, data["train"])
        require_labels(rows, labelled, data["train"])
    config = {**config, "heads": head_configs(config["heads"])}
    # torch and transformers only now: the config, the output and the columns were checked
    import torch

    from ..backbone.sources import resolve_model, source_tokenizer
    from ..loading import load_headed
    from .checkpoints import record_metrics, save_trained
    from .evaluate import run_eval
    from .fitting import TrainingState, fit_heads
    from .options import resolve_device
    from .rewards import collator_for, data_format, encode_reward_rows
    from .rows import encode_rows, with_classes

    heads = config["heads"]
    kind = data_format({h.name: h for h in heads}, list(rows[0]))  # reward data?
    if kind is None:
        if not data["label_columns"]:
            raise ConfigError(
                f"{config.get('config', 'the config')}: key 'data.label_columns' is missing; a "
                "non-empty mapping {head target: column} (or reward data: docs/rewards.md)"
            )
        heads = with_classes(heads, rows, data["label_columns"], "data.label_columns")
    path, kwargs = resolve_model(config["model"], config["model_kwargs"])
    torch.manual_seed(training["seed"])  # the heads' initial weights
    freeze = training["freeze_backbone"]
    model = load_headed(path, head_configs=heads, freeze_base_model=freeze, **kwargs)
    model.to(resolve_device(device))  # --device: the batches follow the model
    tokenizer = source_tokenizer(config["model"], config["model_kwargs"])
    configs = list(model.head_configs.values())
    dropped = 0
    if kind is None:
        examples, _ = encode_rows(
            rows,
            tokenizer,
            configs,
            data["text_column"],
            data["label_columns"],
            training["max_length"],
        )
    else:
        examples, dropped = encode_reward_rows(
            rows,
            tokenizer,
            model.head_configs,
            kind,
            training["max_length"],
            data["step_separator"],
        )
    collator = collator_for(model, tokenizer, kind)
    if kind is None:
        _balanced_weights(model, examples)
    fit = fit_heads(
        model,
        tokenizer,
        examples,
        training,
        progress,
        collator,
        output=config["output"],
        resume=resume,
        features=features,
    )
    calibration = _calibrate(model, tokenizer, examples, training) if kind is None else {}
    settings = {k: data[k] for k in ("text_column", "label_columns") if data[k] is not None}
    settings["max_length"] = training["max_length"]
    settings["data"] = {"train": data["train"], "eval": data["eval"]}  # for the model card
    if kind is not None:
        settings.update(format=kind, step_separator=data["step_separator"])
    out = save_trained(model, tokenizer, config["output"], settings)
    TrainingState(out / STATE_FOLDER, model, None).remove()  # the checkpoint supersedes it
    result: dict[str, Any] = {
        "resumed_after": fit.resumed_after,
        "val_metrics": fit.val_metrics,
        "calibration": calibration,
        "losses": fit.losses,
        "val_losses": fit.val_losses,
        "best_epoch": fit.best_epoch,
        "stopped_early": fit.stopped_early,
        "warning": _still_falling(fit, training),
        "checkpoint": str(out),
        "dropped": dropped,
    }
    if result["warning"]:
        warnings.warn(result["warning"], LossStillFallingWarning, stacklevel=2)
    if data["eval"]:
        result["metrics"] = run_eval(
            out,
            data["eval"],
            batch_size=training["batch_size"],
            progress=progress,
            model=model,
            encoding=data["encoding"],
        )
        record_metrics(out, result["metrics"])  # the card's evaluation and model-index
    return result


def _balanced_weights(model: Any, examples: list[dict]) -> None:
    """Heads with ``class_weights: balanced`` get the weights of the training labels."""
    for name, cfg in list(model.head_configs.items()):
        if cfg.class_weights != "balanced":
            continue
        labels = []
        for ex in examples:
            y = ex.get(cfg.target)
            labels.extend(y if isinstance(y, list) else [y])
        resolved = cfg.with_class_weights(labels)
        model.head_configs[name] = resolved
        model.heads[name].config = resolved


def _calibrate(model: Any, tokenizer: Any, examples: list[dict], training: dict) -> dict:
    """Temperatures (and, with ``training.threshold``, thresholds) fitted on the validation
    split, written into the heads' configs; {} without a validation split or with
    ``training.calibrate: false``."""
    from ..calibration import calibrate
    from ..data.collator import HeadedCollator
    from .fitting import validation_split

    if not training["calibrate"]:
        return {}
    _, val_rows = validation_split(len(examples), training["validation_fraction"], training["seed"])
    if not val_rows:
        return {}
    val_set = [examples[i] for i in val_rows]
    collator = HeadedCollator(model, tokenizer)
    return calibrate(
        model,
        val_set,
        threshold=training["threshold"],
        collator=collator,
        batch_size=training["batch_size"],
    )


def _still_falling(fit: Any, training: dict[str, Any]) -> str | None:
    """A warning when every epoch ran and the last one still lowered the training loss by
    more than 0.1% (None otherwise)."""
    losses = fit.losses
    if fit.stopped_early or len(losses) < 2 or not losses[-1] < losses[-2] * (1 - 1e-3):
        return None
    return (
        f"the training loss was still falling at the last epoch ({losses[-2]:.4g} -> "
        f"{losses[-1]:.4g} in epoch {len(losses)} of training.epochs={training['epochs']}); "
        "more epochs (or a larger training.lr) may train the heads further"
    )
