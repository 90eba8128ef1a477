"""A head as a plain transformers classifier: a folder ``AutoModelForSequenceClassification``
or ``AutoModelForTokenClassification`` loads (offline, ``trust_remote_code=False``) and whose
logits are the head's predictions.

Only heads such a class computes exactly are exported; each is checked before anything is
built, and the written folder is loaded back and compared with the head on right-padded
batches (within ``atol``, at real tokens for token heads) before it is moved into place:

- decoders (GPT-2, Llama, ...): one bias-free Linear sequence head on the last layer with
  "last" pooling → ``*ForSequenceClassification``, which finds the last token as the
  right-most id that is not ``pad_token_id`` (set in the exported config). So the pad id must
  never be a real token: where pad == eos (a text ending in eos) that fails, and it is refused;
- BERT-style encoders: one Linear on "pooler" (BERT's dense + tanh over [CLS]) on the last
  layer → ``BertForSequenceClassification`` (its dropout is off at inference); RoBERTa-,
  DistilBERT- and ELECTRA-style encoders: their own classifier head, a two-Linear MLP on the
  first token (tanh, relu, gelu between), when the head is exactly that;
- one Linear token head on the last layer → ``*ForTokenClassification``.

Anything else is refused with a ConfigError naming each thing that does not map (the layer,
the pooling, the bias, the activation, the number of heads) and pointing to ONNX or
sentence-transformers. ``id2label`` comes from the head's classes (``extra["classes"]``, as
``headkit train`` records them) or ``labels=``. The exported tokenizer pads on the right,
as the classifiers expect (they number positions without reading the mask).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..backbone.adapters import has_adapters
from ..checkpoint.card import EXPORT_CARD, export_card, pipeline_tag, write_export_card
from ..errors import ConfigError, HeadkitError
from ..heads.base import Head
from ..model.headed import HeadedModel
from .exporting import (
    check_atol,
    check_export_target,
    export_folder,
    files_sha256,
    max_difference,
    recorded_tokenizer,
    sample_batches,
    write_json,
)

SIDECAR = "headkit_transformers.json"
#: model_type → (pooling, activations between the Linears) of the encoder's own
#: ``*ForSequenceClassification`` head.
ENCODER_CLASSIFIERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "bert": ("pooler", ()),
    "roberta": ("first", ("tanh",)),
    "xlm-roberta": ("first", ("tanh",)),
    "camembert": ("first", ("tanh",)),
    "distilbert": ("first", ("relu",)),
    "electra": ("first", ("gelu",)),
}
_ALTERNATIVES = (
    "export it with format='onnx' (any head), or as a sentence-transformers model "
    "(headkit.to_sentence_transformer) for a sequence head on the last layer"
)


@dataclass
class TransformersExport:
    """What ``export_transformers`` wrote: the folder, the head, the transformers class and the
    Auto class that loads it, and the largest difference from the head's predictions."""

    directory: Path
    head: str
    model_class: str
    auto_class: str
    max_abs_diff: float
    description: dict[str, Any] = field(repr=False, default_factory=dict)


def _card(
    model: HeadedModel, head: str, plan: _Plan, cls: str, diff: float, atol: float, where: Any
) -> str:
    """The export's model card: a plain transformers classifier, loaded by its Auto class
    and by pipelines."""
    tag = pipeline_tag(model.head_configs[head], model.info.modality) or "text-classification"
    usage = [
        f"from transformers import {plan.auto}, pipeline",
        "",
        f'model = {plan.auto}.from_pretrained("path/to/this/folder")',
        f'classify = pipeline({tag!r}, model="path/to/this/folder")',
    ]
    facts = [
        f"Head {head!r} of a headkit model, exported as a plain {cls} "
        f'(format="transformers"); its predictions were checked against the head\'s: largest '
        f"difference {diff:.3g} (allowed {atol:g}).",
    ]
    return export_card(model, [head], "transformers", Path(where), usage, facts)


@dataclass
class _Plan:
    auto: str  # "AutoModelForSequenceClassification" or "AutoModelForTokenClassification"
    linears: list[nn.Linear]
    pad_token_id: int | None


def export_transformers(
    model: HeadedModel,
    directory: str | os.PathLike,
    *,
    head: str | None = None,
    tokenizer: Any = None,
    labels: list[str] | None = None,
    pad_token_id: int | None = None,
    atol: float = 1e-4,
    overwrite: bool = False,
) -> TransformersExport:
    """Write ``head`` (default: the model's only head) as a plain transformers classifier in
    ``directory`` (see the module docstring). ``tokenizer`` (default: the one recorded beside
    the backbone's source, if any; False: none) is saved beside it; ``pad_token_id`` (default:
    the tokenizer's, else the backbone config's) is what decoders find the last token by.
    ``directory`` must be new, empty or an earlier transformers export (replaced only with
    ``overwrite=True``; see ``exporting.export_folder``)."""
    check_atol(atol)
    name = _one_head(model, head)
    if tokenizer is None:
        tokenizer = recorded_tokenizer(model)
    plan = _plan(model, name, tokenizer, pad_token_id)
    task_model = _build(model, name, plan, labels)
    was_training = model.training
    model.eval()
    try:
        what = "transformers export"
        with export_folder(directory, SIDECAR, overwrite=overwrite, what=what) as tmp:
            task_model.save_pretrained(tmp, safe_serialization=True)
            if tokenizer:
                _right_padded(tokenizer, plan.pad_token_id).save_pretrained(tmp)
            diff = _verify(model, name, tmp, plan, atol)
            description = {
                "format": "headkit-transformers",
                "format_version": 1,
                "head": name,
                "model_class": type(task_model).__name__,
                "auto_class": plan.auto,
                "pad_token_id": plan.pad_token_id,
                "verified": {"atol": atol, "max_abs_diff": diff, "padding": "right"},
            }
            description["files"] = sorted([*(p.name for p in tmp.iterdir()), SIDECAR])
            card = _card(model, name, plan, type(task_model).__name__, diff, atol, directory)
            sha = write_export_card(tmp, Path(directory), Path(directory, SIDECAR), card)
            if sha is not None:
                description[EXPORT_CARD] = sha
            description["files_sha256"] = files_sha256(tmp, SIDECAR)
            write_json(tmp / SIDECAR, description)
    finally:
        model.train(was_training)
    return TransformersExport(
        Path(directory), name, type(task_model).__name__, plan.auto, diff, description
    )


def _one_head(model: HeadedModel, head: str | None) -> str:
    if head is not None:
        if head not in model.head_configs:
            raise ConfigError(
                f"export(format='transformers'): head={head!r} is not a head of this model; "
                f"heads: {list(model.head_configs)}"
            )
        return head
    if len(model.head_configs) != 1:
        raise ConfigError(
            f"export(format='transformers'): the model has {len(model.head_configs)} heads "
            f"({', '.join(model.head_configs)}) and a transformers classifier holds one: pass "
            f"head=NAME to export one of them, or {_ALTERNATIVES}"
        )
    return next(iter(model.head_configs))


def _plan(model: HeadedModel, name: str, tokenizer: Any, pad_token_id: int | None) -> _Plan:
    """Check that a transformers class computes the head exactly; a ConfigError listing every
    reason it does not."""
    cfg, info, module = model.head_configs[name], model.info, model.heads[name]
    backbone = model.backbone
    model_type = getattr(backbone.config, "model_type", "?")
    problems: list[str] = []
    dense = module.dense_layers() if isinstance(module, Head) else None
    if cfg.is_causal_lm:
        problems.append("it is a causal-LM head (the backbone's own *ForCausalLM is that)")
    if not dense:
        problems.append(f"it is a {type(module).__name__}, not a chain of Linear layers")
        dense = []
    if model.hooked_layers()[name] != info.num_layers or not info.tie_last:
        problems.append(
            f"it reads layer_hook={cfg.layer_hook}; the classifiers read the last layer (-1)"
        )
    if info.not_text:
        problems.append(f"the backbone is {info.not_text} model; the classifiers read text models")
    if has_adapters(backbone):
        problems.append("the backbone carries LoRA adapters: call model.merge_and_unload() first")
    if getattr(backbone.config, "quantization_config", None) is not None:
        problems.append("the backbone is quantised")
    activations = [act for _, act in dense]
    if activations and activations[-1] not in ("linear", "identity"):
        problems.append(
            f"its output_activation is {activations[-1]!r}; the classifiers output logits "
            "('linear')"
        )
    if cfg.pred_for_sequence:
        auto = "AutoModelForSequenceClassification"
        _sequence_problems(cfg, info.is_decoder, model_type, activations, dense, problems)
    else:
        auto = "AutoModelForTokenClassification"
        if len(dense) > 1:
            problems.append(f"it has {len(dense)} Linear layers; the token classifiers have one")
    pad = None
    if cfg.pred_for_sequence and info.is_decoder:
        pad = _decoder_pad(backbone.config, tokenizer, pad_token_id, problems)
    if problems:
        raise ConfigError(
            f"head {name!r} cannot be exported as a plain transformers classifier "
            f"({auto} on {type(backbone).__name__}): "
            + "; ".join(problems)
            + f". {_ALTERNATIVES[0].upper()}{_ALTERNATIVES[1:]}"
        )
    return _Plan(auto, [lin for lin, _ in dense], pad)


def _sequence_problems(
    cfg: Any,
    decoder: bool,
    model_type: str,
    activations: list[str],
    dense: list,
    problems: list[str],
) -> None:
    """What keeps a sequence head from being its backbone's ``*ForSequenceClassification``."""
    if decoder:
        pooling, between = "last", ()
        if dense and dense[-1][0].bias is not None:
            problems.append(
                "its Linear has a bias (output_bias=True); the decoders' classifier (score) "
                "has none"
            )
    elif model_type in ENCODER_CLASSIFIERS:
        pooling, between = ENCODER_CLASSIFIERS[model_type]
    else:
        problems.append(
            f"no encoder classifier of model_type {model_type!r} is known to match a head "
            f"(known: {', '.join(ENCODER_CLASSIFIERS)})"
        )
        return
    if cfg.pooling != pooling:
        problems.append(f"it pools with {cfg.pooling!r}; this classifier takes pooling={pooling!r}")
    if dense and tuple(activations[:-1]) != between:
        want = f"{len(between) + 1} Linear layer(s)"
        if between:
            want += f" with {between[0]!r} between them (hidden_size = the backbone's width)"
        problems.append(
            f"it is {len(dense)} Linear layer(s) with {activations[:-1] or 'no'} activations "
            f"between them; this classifier is {want}"
        )
    elif between and dense and dense[0][0].out_features != dense[0][0].in_features:
        problems.append(
            f"its hidden_size is {dense[0][0].out_features}; this classifier's is the "
            f"backbone's width {dense[0][0].in_features}"
        )


def _decoder_pad(config: Any, tokenizer: Any, given: int | None, problems: list[str]) -> Any:
    """The pad id decoders find the last token by, or a reason it cannot be trusted."""
    tok_pad = getattr(tokenizer, "pad_token_id", None) if tokenizer else None
    pad = given if given is not None else tok_pad if tok_pad is not None else config.pad_token_id
    eos = config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos]) - {None}
    if tokenizer and getattr(tokenizer, "eos_token_id", None) is not None:
        eos_ids.add(tokenizer.eos_token_id)
    if pad is None:
        problems.append(
            "there is no pad_token_id: the decoders' classifier finds the last token as the "
            "right-most id that is not the pad id; pass pad_token_id=, an id the tokenizer "
            "pads with and never produces for text"
        )
    elif pad in eos_ids:
        problems.append(
            f"pad_token_id={pad} is also the eos id: the decoders' classifier finds the last "
            "token as the right-most id that is not the pad id, so a text ending in eos would "
            "be classified at the wrong token; give the tokenizer a pad token of its own "
            "(tokenizer.add_special_tokens({'pad_token': '<pad>'}) and "
            "model.resize_token_embeddings(len(tokenizer))) or pass pad_token_id="
        )
    elif tok_pad is not None and tok_pad != pad:
        problems.append(
            f"pad_token_id={pad} but the tokenizer pads with {tok_pad}: the ids would disagree "
            "with the mask"
        )
    return pad


def _build(model: HeadedModel, name: str, plan: _Plan, labels: list[str] | None) -> nn.Module:
    """The transformers classifier holding the backbone's weights and the head's Linears."""
    import transformers

    cfg = model.head_configs[name]
    config = copy.deepcopy(model.backbone.config)
    names = _label_names(cfg, labels)
    config.num_labels = cfg.num_outputs
    config.id2label = dict(enumerate(names))
    config.label2id = {v: k for k, v in config.id2label.items()}
    config.problem_type = {
        "classification": "single_label_classification",
        "binary": "multi_label_classification",
        "regression": "regression",
    }.get(cfg.task)
    if plan.pad_token_id is not None:
        config.pad_token_id = plan.pad_token_id
    auto = getattr(transformers, plan.auto)
    task = auto.from_config(config, dtype=model.dtype, trust_remote_code=False).eval()
    prefix = task.base_model_prefix
    state = model.backbone.state_dict()
    missing, unexpected = task.base_model.load_state_dict(state, strict=False)
    unexpected = [k for k in unexpected if not k.startswith("pooler.")]  # token classifiers
    theirs = [
        m
        for n, m in task.named_modules()
        if isinstance(m, nn.Linear) and not n.startswith(f"{prefix}.")
    ]
    if missing or unexpected or len(theirs) != len(plan.linears):
        raise HeadkitError(
            f"{type(task).__name__} does not take the backbone's weights and the head's "
            f"{len(plan.linears)} Linear layer(s) (missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, its classifier Linears: {len(theirs)}); {_ALTERNATIVES}"
        )
    with torch.no_grad():
        for ours, hf in zip(plan.linears, theirs):
            if ours.bias is not None and hf.bias is None:
                raise HeadkitError(
                    f"{type(task).__name__}'s classifier has no bias but the head's Linear "
                    f"does; {_ALTERNATIVES}"
                )
            hf.weight.copy_(ours.weight)
            if hf.bias is not None:
                hf.bias.copy_(ours.bias if ours.bias is not None else torch.zeros_like(hf.bias))
    return task.to(model.device)


def _label_names(cfg: Any, labels: list[str] | None) -> list[str]:
    given = labels if labels is not None else cfg.extra.get("classes")
    given = [str(c) for c in given] if isinstance(given, (list, tuple)) else []
    if len(given) > cfg.num_outputs:
        raise ConfigError(
            f"labels: {len(given)} names for head {cfg.name!r} of {cfg.num_outputs} outputs"
        )
    return given + [f"LABEL_{i}" for i in range(len(given), cfg.num_outputs)]


def _right_padded(tokenizer: Any, pad: int | None) -> Any:
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "right"
    if pad is not None and getattr(tok, "pad_token_id", None) is None:
        tok.pad_token = tok.convert_ids_to_tokens(pad)
    return tok


def _verify(model: HeadedModel, name: str, folder: Path, plan: _Plan, atol: float) -> float:
    """Load the folder as a user would and compare its logits with the head's predictions."""
    import transformers

    auto = getattr(transformers, plan.auto)
    loaded = (
        auto.from_pretrained(
            str(folder), trust_remote_code=False, local_files_only=True, dtype=model.dtype
        )
        .to(model.device)
        .eval()
    )
    config = model.backbone.config
    vocab = model.get_input_embeddings().num_embeddings
    pad = plan.pad_token_id if plan.pad_token_id is not None else config.pad_token_id
    types = (
        getattr(config, "type_vocab_size", 0)
        if "token_type_ids" in model.info.forward_params
        else 0
    )
    limit = model.info.positions.max_length if model.info.positions else None
    per_token = not model.head_configs[name].pred_for_sequence
    worst = 0.0
    for batch in sample_batches(
        vocab, limit, model.device, avoid=pad, token_types=types or 0, sides=("right",)
    ):
        with torch.no_grad():
            ours = model(**batch).preds_by_head[name]
            theirs = loaded(**batch).logits
        diff = max_difference(ours, theirs, batch["attention_mask"], per_token)
        worst = max(worst, diff)
        if not diff <= atol:
            raise HeadkitError(
                f"the exported {type(loaded).__name__} disagrees with head {name!r}: max "
                f"|difference| {diff:.3g} > atol={atol:g} on a batch of shape "
                f"{tuple(batch['input_ids'].shape)}; nothing was written: {_ALTERNATIVES}"
            )
    return worst


def _check_target(directory: Path, overwrite: bool, **options: Any) -> None:
    """``headkit.export``'s check before anything is loaded or built: ``atol``, and the folder
    (``exporting.check_export_target``)."""
    check_atol(options.get("atol", 1e-4))
    check_export_target(directory, SIDECAR, overwrite, "transformers export")


export_transformers.check_target = _check_target  # type: ignore[attr-defined]
