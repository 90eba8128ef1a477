"""``headkit train`` / ``eval`` / ``predict``: heads from a YAML config and data files.

A checkpoint directory written by ``train`` holds the headkit checkpoint
(``head_configs.json`` + safetensors, the backbone referenced unless it was trained), the
tokenizer, and ``headkit_cli.json`` (text and label columns, max length), so ``eval`` and
``predict`` need nothing else. Class labels are mapped to indices in sorted order; the
classes travel in each head's ``extra["classes"]`` and predictions are written back as them.
See docs/cli.md for the config keys.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from ..backbone.sources import load_tokenizer, resolve_model
from ..config import HeadConfig
from ..data.collator import HeadedCollator
from ..data.encoding import IGNORE_INDEX, align_labels, as_class, encode_texts, encode_words
from ..errors import ConfigError
from ..features import cache_features, train_heads_on_features
from ..loading import load_headed
from ..metrics import evaluate_head_wise
from ..model.headed import HeadedModel
from .datafiles import as_list, as_number, read_rows, require_columns, write_rows

CLI_SETTINGS = "headkit_cli.json"
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
_BINARY = ("bce", "bce_with_logits")


# ---------------------------------------------------------------------- config
def load_train_config(path: str | Path) -> dict[str, Any]:
    """Read and check a training config; relative paths are relative to the config's folder."""
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
    if (
        not data["train"]
        or not isinstance(data["label_columns"], dict)
        or not data["label_columns"]
    ):
        raise ConfigError(
            f"{path}: data needs 'train' (a file) and 'label_columns' ({{target: column}})"
        )
    if training["use_cached_features"] not in ("auto", True, False):
        raise ConfigError(
            f"{path}: training.use_cached_features={training['use_cached_features']!r} is "
            "invalid; allowed: auto, true, false"
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


# ---------------------------------------------------------------------- data → examples
def _targets(configs: list[HeadConfig]) -> dict[str, dict[str, Any]]:
    """Per target: whether it is token-level and whether it holds classes."""
    out: dict[str, dict[str, Any]] = {}
    for c in configs:
        kind = {
            "token": not c.pred_for_sequence,
            "classes": not c.is_regression and c.loss_fct not in _BINARY,
        }
        if out.setdefault(c.target, kind) != kind:
            raise ConfigError(
                f"heads on target {c.target!r} disagree on token-level or class labels; "
                "give them different targets"
            )
    return out


def _classes_of(rows, column: str, token: bool) -> list:
    values = set()
    for i, r in enumerate(rows):
        cell = r[column]
        values.update(as_class(v) for v in (as_list(cell, column, i) if token else [cell]))
    try:
        return sorted(values)
    except TypeError:
        return sorted(values, key=repr)


def _label(cell, column, row, kind, classes) -> Any:
    def one(v):
        if not kind["classes"]:
            return as_number(v, column, row)
        c = as_class(v)
        if c not in classes:
            raise ConfigError(
                f"column {column!r}, row {row}: class {c!r} was not seen in training; "
                f"known classes: {classes}"
            )
        return classes.index(c)

    return [one(v) for v in as_list(cell, column, row)] if kind["token"] else one(cell)


def encode_rows(
    rows: list[dict],
    tokenizer: Any,
    configs: list[HeadConfig],
    text_column: str,
    label_columns: dict[str, str] | None,
    max_length: int,
) -> tuple[list[dict], list[list[int]] | None]:
    """Examples for a HeadedModel and, with token heads, each example's word index per token.

    ``label_columns`` maps targets to columns (None: no labels, for predict); classes come
    from each head's ``extra["classes"]``.
    """
    kinds = _targets(configs)
    words = any(k["token"] for k in kinds.values())
    if words:
        texts = [as_list(r[text_column], text_column, i) for i, r in enumerate(rows)]
        examples, word_index = encode_words(tokenizer, texts, max_length)
    else:
        examples, word_index = (
            encode_texts(tokenizer, [str(r[text_column]) for r in rows], max_length),
            None,
        )
    classes = {c.target: c.extra.get("classes") for c in configs}
    for target, column in (label_columns or {}).items():
        kind = kinds[target]
        for i, (r, ex) in enumerate(zip(rows, examples)):
            y = _label(r[column], column, i, kind, classes[target])
            if kind["token"]:
                if len(y) != len(texts[i]):
                    raise ConfigError(
                        f"column {column!r}, row {i}: {len(y)} labels for {len(texts[i])} words"
                    )
                y = align_labels(word_index[i], y, IGNORE_INDEX)
            ex[target] = y
    return examples, word_index


def _with_classes(configs, rows, label_columns, where: str) -> list[HeadConfig]:
    """Record each classification head's classes (sorted) and default num_outputs to them."""
    kinds = _targets(configs)
    unknown = sorted(set(label_columns) - set(kinds))
    if unknown:
        raise ConfigError(
            f"{where}: label_columns has target(s) {unknown} that no head reads; targets: "
            f"{sorted(kinds)}"
        )
    out = []
    for c in configs:
        if c.target not in label_columns:
            raise ConfigError(f"{where}: head {c.name!r} needs label_columns[{c.target!r}]")
        if kinds[c.target]["classes"]:
            classes = _classes_of(rows, label_columns[c.target], kinds[c.target]["token"])
            n = c.num_outputs or len(classes)
            if n < len(classes):
                raise ConfigError(
                    f"head {c.name!r}: num_outputs={n} but column {label_columns[c.target]!r} "
                    f"has {len(classes)} classes ({classes[:20]})"
                )
            c = c.replace(num_outputs=n, extra={**c.extra, "classes": classes})
        out.append(c)
    return out


# ---------------------------------------------------------------------- train
def run_train(config: dict[str, Any], progress: bool = True) -> dict[str, Any]:
    """Train the heads of a loaded config, save the checkpoint; return losses and metrics."""
    data, training = config["data"], config["training"]
    rows = read_rows(data["train"], data["limit"])
    wanted = {"data.text_column": data["text_column"]}
    wanted.update({f"data.label_columns.{t}": c for t, c in data["label_columns"].items()})
    require_columns(rows, wanted, data["train"])
    heads = _with_classes(config["heads"], rows, data["label_columns"], "data.label_columns")
    path, kwargs = resolve_model(config["model"], config["model_kwargs"])
    freeze = bool(training["freeze_backbone"])
    torch.manual_seed(training["seed"])  # the heads' initial weights
    model = load_headed(path, head_configs=heads, freeze_base_model=freeze, **kwargs)
    tokenizer = load_tokenizer(config["model"], config["model_kwargs"])
    args = (tokenizer, list(model.head_configs.values()), data["text_column"])
    examples, _ = encode_rows(rows, *args, data["label_columns"], training["max_length"])
    cached = training["use_cached_features"]
    if cached is True and not freeze:
        raise ConfigError(
            "training.use_cached_features=true needs training.freeze_backbone=true (cached "
            "features would go stale as the backbone trains)"
        )
    if freeze and cached in (True, "auto"):
        feats = cache_features(
            model, examples, batch_size=training["batch_size"], progress=progress
        )
        losses = _train_cached(model, feats, training, progress)
    else:
        losses = _train_loop(model, tokenizer, examples, training, progress)
    out = Path(config["output"])
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    settings = {k: data[k] for k in ("text_column", "label_columns")}
    settings["max_length"] = training["max_length"]
    (out / CLI_SETTINGS).write_text(json.dumps(settings, indent=2) + "\n")
    result: dict[str, Any] = {"losses": losses, "checkpoint": str(out)}
    if data["eval"]:
        result["metrics"] = run_eval(
            out, data["eval"], batch_size=training["batch_size"], progress=progress, model=model
        )
    return result


def _train_cached(model: HeadedModel, feats, training, progress) -> list[float]:
    """Epochs of ``train_heads_on_features`` under one progress bar, one optimizer throughout."""
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


def _train_loop(model: HeadedModel, tokenizer, examples, training, progress) -> list[float]:
    """Plain AdamW epochs through the whole model (the backbone trains unless frozen)."""
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


# ---------------------------------------------------------------------- eval / predict
def _open_checkpoint(checkpoint: str | Path, model: HeadedModel | None = None):
    from transformers import AutoTokenizer

    root = Path(checkpoint)
    model = model or HeadedModel.from_pretrained(root)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(root), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"CHECKPOINT={str(root)!r} holds no tokenizer ({e}); was it written by headkit train?"
        ) from None
    settings_path = root / CLI_SETTINGS
    settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    return model.eval(), tokenizer, settings


def run_eval(
    checkpoint: str | Path,
    data: str,
    text_column: str | None = None,
    label_columns: dict[str, str] | None = None,
    batch_size: int = 32,
    limit: int | None = None,
    progress: bool = True,
    model: HeadedModel | None = None,
) -> dict[str, dict[str, float]]:
    """Per-head metrics of a checkpoint on a data file (columns default to training's)."""
    model, tokenizer, settings = _open_checkpoint(checkpoint, model)
    text_column = text_column or settings.get("text_column", "text")
    label_columns = label_columns or settings.get("label_columns")
    if not label_columns:
        raise ConfigError(
            "--label-column is needed: the checkpoint does not name its label columns"
        )
    rows = read_rows(data, limit)
    wanted = {"--text-column": text_column}
    wanted.update({f"--label-column {t}": c for t, c in label_columns.items()})
    require_columns(rows, wanted, data)
    configs = list(model.head_configs.values())
    max_length = settings.get("max_length", 128)
    examples, _ = encode_rows(rows, tokenizer, configs, text_column, label_columns, max_length)
    return evaluate_head_wise(model, examples, batch_size=batch_size, progress=progress)


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
    model, tokenizer, settings = _open_checkpoint(checkpoint)
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
                    p = preds[name][i]
                    if not cfg.pred_for_sequence:
                        p = p[[j for j, w in enumerate(word_index[done + i]) if w >= 0]]
                    row.update(_readable(name, cfg, p))
            done += batch["input_ids"].shape[0]
    return write_rows(output, out_rows)


def _readable(name: str, cfg: HeadConfig, p: torch.Tensor) -> dict[str, Any]:
    """Output columns of one input: ``p`` is (num_outputs,) for a sequence head and
    (words, num_outputs) for a token head (one list entry per word)."""
    if cfg.is_regression:
        values = p[..., 0] if p.shape[-1] == 1 else p
        return {name: values.tolist()}
    if cfg.loss_fct in _BINARY:
        prob = p if cfg.loss_fct == "bce" else torch.sigmoid(p)
        prob = prob[..., 0] if prob.shape[-1] == 1 else prob
        return {name: (prob > 0.5).long().tolist(), f"{name}_prob": prob.tolist()}
    classes = cfg.extra.get("classes") or list(range(p.shape[-1]))
    top, index = torch.softmax(p.float(), -1).max(-1)
    names = [classes[i] if i < len(classes) else i for i in index.reshape(-1).tolist()]
    return {name: names[0] if p.dim() == 1 else names, f"{name}_prob": top.tolist()}
