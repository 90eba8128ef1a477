"""``headkit train CONFIG.yaml``: train heads from a YAML config; writes a checkpoint folder.

The config names the backbone, the heads (HeadConfig fields), the data files and columns,
the training settings and the output folder (keys: docs/cli.md). With a frozen backbone the
heads train on cached features (one backbone pass); otherwise plain AdamW epochs run through
the whole model. Importing this module imports argparse only; ``run`` imports the rest.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError
from .options import add_quiet

if TYPE_CHECKING:
    from ..features import CachedFeatures
    from ..model.headed import HeadedModel

HELP = "train heads from a YAML config; writes a checkpoint folder"
EXAMPLE = """example:
  headkit train configs/sentiment.yaml
config (paths relative to the config file; see docs/cli.md):
  model: packaged:minilm
  heads: [{name: sentiment, pred_for_sequence: true, pooling: mean, layer_hook: 4}]
  data: {train: train.csv, eval: test.csv, text_column: text,
         label_columns: {sentiment: label}}
  training: {epochs: 10, batch_size: 32, lr: 1.0e-3}
  output: runs/sentiment"""

_TOP = {"model", "model_kwargs", "heads", "data", "training", "output"}
_DATA = {"train": None, "eval": None, "text_column": "text", "label_columns": None, "limit": None}
_TRAINING = {
    "epochs": 10,
    "batch_size": 32,
    "lr": 1e-3,
    "max_length": 128,
    "seed": 0,
    "freeze_backbone": True,
    "use_cached_features": "auto",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG.yaml")
    p.add_argument("--output", help="checkpoint folder (overrides the config's output)")
    add_quiet(p)


def run(args: argparse.Namespace) -> None:
    from .evaluate import metrics_table

    config = load_train_config(args.config)
    if args.output:
        config["output"] = args.output
    result = run_train(config, progress=not args.quiet)
    losses = result["losses"]
    print(f"training loss: epoch 1 {losses[0]:.4f} -> epoch {len(losses)} {losses[-1]:.4f}")
    if "metrics" in result:
        print("held-out metrics (data.eval):")
        print(metrics_table(result["metrics"]))
    print(f"checkpoint written to {result['checkpoint']}")


# ---------------------------------------------------------------------- config
def load_train_config(path: str | Path) -> dict[str, Any]:
    """Read and check a training config; relative paths are relative to the config's folder."""
    from ..config import HeadConfig

    path = Path(path)
    try:
        import yaml
    except ImportError:
        raise ConfigError("headkit train needs pyyaml: pip install pyyaml") from None
    if not path.is_file():
        raise ConfigError(f"CONFIG={str(path)!r} does not exist; a YAML file (see docs/cli.md)")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the config must be a mapping with keys {sorted(_TOP)}")
    _known(raw, _TOP, str(path))
    for key in ("model", "heads", "data", "output"):
        if key not in raw:
            raise ConfigError(
                f"{path}: key {key!r} is missing (required: model, heads, data, output)"
            )
    data = _section(raw, "data", _DATA, path)
    training = _section(raw, "training", _TRAINING, path)
    labels = data["label_columns"]
    if not data["train"] or not isinstance(labels, dict) or not labels:
        raise ConfigError(
            f"{path}: data needs 'train' (a file) and 'label_columns' ({{target: column}})"
        )
    if training["use_cached_features"] not in ("auto", True, False):
        raise ConfigError(
            f"{path}: training.use_cached_features={training['use_cached_features']!r} is "
            "invalid; allowed: auto, true, false"
        )
    if training["use_cached_features"] is True and not training["freeze_backbone"]:
        raise ConfigError(
            f"{path}: training.use_cached_features=true needs training.freeze_backbone=true "
            "(cached features would go stale as the backbone trains)"
        )
    if not isinstance(raw["heads"], list) or not raw["heads"]:
        raise ConfigError(f"{path}: heads must be a non-empty list of HeadConfig field mappings")
    heads = [HeadConfig.from_dict(h) for h in raw["heads"]]
    for h in heads:
        if h.is_causal_lm:
            raise ConfigError(
                f"{path}: head {h.name!r} has is_causal_lm=true; headkit train trains "
                "classification, regression and token heads (use the Python API for LM heads)"
            )
    base = path.parent
    for key in ("train", "eval"):
        if data[key] and not str(data[key]).startswith("packaged:"):
            data[key] = str(base / data[key])
    return {
        "model": raw["model"],
        "model_kwargs": raw.get("model_kwargs") or {},
        "heads": heads,
        "data": data,
        "training": training,
        "output": str(base / raw["output"]),
    }


def _known(section: dict, allowed: set, where: str) -> None:
    unknown = sorted(set(section) - set(allowed))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; allowed: {', '.join(sorted(allowed))}"
        )


def _section(raw: dict, name: str, defaults: dict, path: Path) -> dict:
    given = raw.get(name) or {}
    if not isinstance(given, dict):
        raise ConfigError(f"{path}: {name} must be a mapping")
    _known(given, set(defaults), f"{path}: {name}")
    return {**defaults, **given}


# ---------------------------------------------------------------------- training
def run_train(config: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Train the heads of a loaded config, save the checkpoint; return losses and metrics."""
    import torch

    from ..backbone.sources import load_tokenizer, resolve_model
    from ..features import cache_features
    from ..loading import load_headed
    from .checkpoints import save_checkpoint
    from .datafiles import read_rows, require_columns
    from .evaluate import run_eval
    from .rows import encode_rows, with_classes

    data, training = config["data"], config["training"]
    cached, freeze = training["use_cached_features"], bool(training["freeze_backbone"])
    rows = read_rows(data["train"], data["limit"])
    wanted = {"data.text_column": data["text_column"]}
    wanted.update({f"data.label_columns.{t}": c for t, c in data["label_columns"].items()})
    require_columns(rows, wanted, data["train"])
    heads = with_classes(config["heads"], rows, data["label_columns"], "data.label_columns")
    path, kwargs = resolve_model(config["model"], config["model_kwargs"])
    torch.manual_seed(training["seed"])  # the heads' initial weights
    model = load_headed(path, head_configs=heads, freeze_base_model=freeze, **kwargs)
    tokenizer = load_tokenizer(config["model"], config["model_kwargs"])
    configs = list(model.head_configs.values())
    examples, _ = encode_rows(
        rows, tokenizer, configs, data["text_column"], data["label_columns"], training["max_length"]
    )
    if freeze and cached in (True, "auto"):
        feats = cache_features(
            model, examples, batch_size=training["batch_size"], progress=progress
        )
        losses = _train_cached(model, feats, training, progress)
    else:
        losses = _train_loop(model, tokenizer, examples, training, progress)
    settings = {k: data[k] for k in ("text_column", "label_columns")}
    settings["max_length"] = training["max_length"]
    out = save_checkpoint(model, tokenizer, config["output"], settings)
    result: dict[str, Any] = {"losses": losses, "checkpoint": str(out)}
    if data["eval"]:
        result["metrics"] = run_eval(
            out, data["eval"], batch_size=training["batch_size"], progress=progress, model=model
        )
    return result


def _train_cached(
    model: HeadedModel, feats: CachedFeatures, training: dict, progress: bool
) -> list[float]:
    """Epochs of ``train_heads_on_features`` under one progress bar, one optimizer throughout."""
    import torch
    from tqdm.auto import tqdm

    from ..features import train_heads_on_features

    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=float(training["lr"]))
    losses: list[float] = []
    bar = tqdm(range(training["epochs"]), desc="headkit: training heads", disable=not progress)
    for epoch in bar:
        losses += train_heads_on_features(
            model,
            feats,
            epochs=1,
            batch_size=training["batch_size"],
            optimizer=opt,
            seed=training["seed"] + epoch,
        )
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


def _train_loop(
    model: HeadedModel, tokenizer: Any, examples: list[dict], training: dict, progress: bool
) -> list[float]:
    """Plain AdamW epochs through the whole model (the backbone trains unless frozen)."""
    import torch
    from torch.utils.data import DataLoader
    from tqdm.auto import tqdm

    from ..data.collator import HeadedCollator

    torch.manual_seed(training["seed"])
    g = torch.Generator().manual_seed(training["seed"])
    loader = DataLoader(
        examples,
        batch_size=training["batch_size"],
        shuffle=True,
        generator=g,
        collate_fn=HeadedCollator(model, tokenizer),
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=float(training["lr"]))
    model.train()
    losses = []
    for epoch in range(training["epochs"]):
        total, n = 0.0, 0
        for batch in tqdm(
            loader, desc=f"epoch {epoch + 1}/{training['epochs']}", disable=not progress
        ):
            out = model(**batch)
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            opt.step()
            total, n = total + float(out.loss.detach()), n + 1
        losses.append(total / max(n, 1))
    model.eval()
    return losses
