"""transformer-heads' helpers, for notebooks written against it (see docs/migrating.md).

``get_model_params``, ``print_trainable_parameters``, ``get_top_n_preds``,
``evaluate_head_wise``, ``get_some_preds``, ``compare_all_params``,
``get_multi_head_transformer``, ``load_tokenizer`` and ``DataCollatorWithPadding`` keep
transformer-heads' signatures and results, with one difference that matters: headkit's
sequence heads predict ``(batch, num_outputs)``, not ``(batch, seq, num_outputs)``, so the
helpers read ``preds[0]`` for them where transformer-heads read ``preds[0, -1]``.
``headkit.compat`` gathers them with the loaders under one import path.
"""

from __future__ import annotations

import functools
import json
import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoConfig, PreTrainedModel

from ..checkpoint import restore
from ..errors import BatchError, ConfigError
from ..generation.generate import HeadedGenerateOutput
from ..metrics import evaluation_batches
from ..model.headed import HeadedModel

#: transformer-heads' name of ``HeadedModel.generate``'s output (``.logprobs`` is
#: ``.token_logprobs``).
HeadedModelGenerateOutput = HeadedGenerateOutput


def get_model_params(model_path: str | os.PathLike) -> dict[str, Any]:
    """The model's config as a dict, plus ``model_class`` (the transformers class named by
    its ``architectures``) and ``hidden_size`` / ``vocab_size`` under those names.

    As transformer-heads' helper: ``params = get_model_params(path)`` then
    ``load_headed(params["model_class"], path, head_configs=[...])``.
    """
    config = AutoConfig.from_pretrained(str(model_path), trust_remote_code=False)
    params = config.to_dict()
    archs = params.get("architectures") or []
    model_class = getattr(transformers, archs[0], None) if archs else None
    if model_class is None:
        raise ConfigError(
            f"get_model_params: the config of {str(model_path)!r} names architectures={archs!r}, "
            "none of which is a transformers class; load the model with AutoModel instead"
        )
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params["model_class"] = model_class
    params["hidden_size"] = getattr(text, "hidden_size", params.get("hidden_size"))
    params["vocab_size"] = getattr(text, "vocab_size", params.get("vocab_size"))
    return params


def print_trainable_parameters(model: torch.nn.Module, use_4bit: bool = False) -> None:
    """Print all / trainable parameter counts and the counts by dtype, exactly as
    transformer-heads does (its three lines, the dtype counts as the defaultdicts they are).
    ``use_4bit`` halves the trainable count, as it does for packed 4-bit weights."""
    trainable = total = 0
    by_dtype: dict[torch.dtype, int] = defaultdict(int)
    trainable_by_dtype: dict[torch.dtype, int] = defaultdict(int)
    for _, param in model.named_parameters():
        n = param.numel()
        if n == 0 and hasattr(param, "ds_numel"):  # DeepSpeed ZeRO-3: the full size
            n = param.ds_numel
        total += n
        by_dtype[param.dtype] += n
        if param.requires_grad:
            trainable += n
            trainable_by_dtype[param.dtype] += n
    if use_4bit:
        trainable /= 2
    share = 100 * trainable / total if total else 0.0
    print(f"all params: {total} || trainable params: {trainable} || trainable%: {share}")
    print("params by dtype:", by_dtype)  # its defaultdicts, printed as they are
    print("trainable params by dtype:", trainable_by_dtype)


@torch.inference_mode()
def get_top_n_preds(n: int, model: Any, text: str, tokenizer: Any) -> dict[str, list[Any]]:
    """The ``n`` highest-scoring outputs of each head for ``text`` (transformer-heads' helper).

    Token heads are read at the last position, sequence heads at their one prediction.
    Causal-LM heads (and heads with one output per vocabulary entry) give decoded tokens,
    other heads their top ``n`` output indices.
    """
    inputs = tokenizer(text, return_tensors="pt").to(model.device)
    out = model(**inputs)
    vocab = getattr(model.info, "vocab_size", None)
    result: dict[str, list[Any]] = {}
    for name, preds in out.preds_by_head.items():
        cfg = model.head_configs[name]
        scores = preds[0] if cfg.pred_for_sequence else preds[0, -1]
        best = torch.topk(scores.float(), min(n, scores.shape[-1])).indices.tolist()
        if cfg.is_causal_lm or (vocab is not None and cfg.num_outputs == vocab):
            result[name] = [tokenizer.decode(i) for i in best]
        else:
            result[name] = best
    return result


def evaluate_head_wise(
    model: Any,
    ds: Iterable[Any],
    collator: Any = None,
    batch_size: int = 8,
    epochs: float = 1,
) -> tuple[float, dict[str, float]]:
    """transformer-heads' ``evaluate_head_wise``: ``(mean loss, {head: mean loss})``, each the
    mean over batches of ``loss`` / ``loss_by_head`` (heads without labels left out), on the
    batches ``collator`` makes of ``ds`` (default ``HeadedCollator(model)``; a ``datasets``
    dataset is read in torch format). ``epochs`` < 1 evaluates the first
    ``ceil(epochs × batches)`` batches (transformer-heads ran one more). In eval mode, no
    gradients. ``headkit.evaluate_head_wise`` gives per-head metrics instead.
    """
    if hasattr(ds, "with_format"):
        ds = ds.with_format(type="torch")
    totals: list[float] = []
    by_head: dict[str, list[float]] = defaultdict(list)
    for _, out in evaluation_batches(model, ds, collator, batch_size, epochs):
        for name, loss in out.loss_by_head.items():
            by_head[name].append(float(loss))
        if out.loss is not None:
            totals.append(float(out.loss))
    mean = float(np.mean(totals)) if totals else float("nan")
    return mean, {name: float(np.mean(values)) for name, values in by_head.items()}


@torch.inference_mode()
def get_some_preds(
    model: Any, ds: Any, tokenizer: Any, n: int = 5, classification: bool = True
) -> tuple[list[str], dict[str, list[Any]], dict[str, list[Any]]]:
    """The first ``n`` examples of ``ds``, one at a time: ``(decoded inputs, {head:
    predictions}, {head: labels})`` (transformer-heads' helper, which returned n + 1).

    ``classification=True``: each prediction is the argmax class and each label an int;
    otherwise the raw outputs and labels as lists. Sequence heads are read at their one
    prediction, token heads at the last position; a head without labels in ``ds`` gets
    None as its labels. Plain dicts: a misspelt head name is a KeyError, not an empty list.
    """
    from ..data.collator import HeadedCollator

    if not isinstance(n, int) or n < 1:
        raise BatchError(f"get_some_preds: n={n!r} is invalid; a positive integer")
    collate = HeadedCollator(model, tokenizer, labels_key=None)
    configs = dict(model.head_configs)
    inputs: list[str] = []
    preds: dict[str, list[Any]] = {name: [] for name in configs}
    truths: dict[str, list[Any]] = {name: [] for name in configs}
    for _, (batch, out) in zip(range(n), _one_by_one(model, ds, collate)):
        inputs.append(tokenizer.decode(batch["input_ids"][0].tolist()))
        for name, cfg in configs.items():
            p = out.preds_by_head[name]
            p = p[0] if cfg.pred_for_sequence else p[0, -1]
            y = batch.get(cfg.target)
            y = None if y is None else y[0]
            if classification:
                preds[name].append(int(p.argmax()))
                truths[name].append(None if y is None else int(y.reshape(-1)[0]))
            else:
                preds[name].append(p.tolist())
                truths[name].append(None if y is None else y.tolist())
    return inputs, preds, truths


def _one_by_one(model: Any, ds: Any, collate: Any) -> Iterable[tuple[dict, Any]]:
    return evaluation_batches(model, ds, collate, batch_size=1, progress=False)


def compare_all_params(model1: torch.nn.Module, model2: torch.nn.Module) -> list[str]:
    """Compare the parameters of two models by the names transformer-heads gives them
    (shapes, dtypes, values); print each difference as transformer-heads does and return the
    lines (empty: the same).

    Names are read as transformer-heads wrote them (``th_parameter_names``): peft's
    ``base_model.model.`` prefix dropped, and a HeadedModel's ``backbone.*`` under the
    backbone's ``base_model_prefix`` (``model.*``, ``transformer.*``), its heads' Linears as
    ``heads.<name>.lins.<i>`` and a one-Linear ``lm_head`` as ``lm_head``, so a HeadedModel
    compares with the ``*ForCausalLM`` it was built from, and with a transformer-heads model.
    Parameters are paired by name; a name only one model has is a "name mismatch" line.
    """
    lines: list[str] = []
    params1, params2 = th_parameter_names(model1), th_parameter_names(model2)
    for name1, param1 in params1.items():
        param2 = params2.get(name1)
        if param2 is None:
            lines.append(f"name mismatch {name1} (not in model2)")
        elif param1.shape != param2.shape:
            lines.append(f"shape mismatch {name1} {tuple(param1.shape)} {tuple(param2.shape)}")
        elif param1.dtype != param2.dtype:
            lines.append(f"dtype mismatch {name1} {param1.dtype} {param2.dtype}")
        elif not torch.allclose(param1, param2.to(param1.device)):
            diff = (param1.detach() - param2.detach().to(param1.device)).abs()
            lines.append(
                f"values not even close {name1} (mean diff {float(diff.mean())}, max diff "
                f"{float(diff.max())})"
            )
        elif not torch.equal(param1, param2.to(param1.device)):
            lines.append(f"values not equal {name1}")
    lines += [f"name mismatch {n} (not in model1)" for n in params2 if n not in params1]
    if len(params1) != len(params2):
        lines.append(f"parameter count mismatch {len(params1)} {len(params2)}")
    for line in lines:
        print(line)
    return lines


def th_parameter_names(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """``model``'s parameters under the names transformer-heads gives them (see
    ``compare_all_params``); a model that is no HeadedModel keeps its own names (without
    peft's ``base_model.model.`` prefix). A tied weight is listed under each of its names
    (GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``)."""
    peft_prefix = "base_model.model."
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not isinstance(inner, HeadedModel):
        # tied weights under each name (a tied lm_head is a parameter of its own there)
        named = model.named_parameters(remove_duplicate=False)
        return {n.removeprefix(peft_prefix): p for n, p in named}
    prefix = getattr(inner.backbone, "base_model_prefix", "") or "model"
    backbone = inner.backbone.named_parameters(remove_duplicate=False)
    out = {f"{prefix}.{n}": p for n, p in backbone}
    lm_head = {}
    for name, head in inner.heads.items():
        linears = {id(m): i for i, m in enumerate(getattr(head, "linears", []))}
        for module_name, module in head.named_modules():
            for pname, p in module.named_parameters(recurse=False):
                index = linears.get(id(module))
                if index is None:
                    out[f"heads.{name}.{module_name}.{pname}".replace("..", ".")] = p
                elif name == "lm_head" and len(linears) == 1:
                    lm_head[f"lm_head.{pname}"] = p
                else:
                    out[f"heads.{name}.lins.{index}.{pname}"] = p
    return {**out, **lm_head}


@functools.cache
def get_multi_head_transformer(base_model_class: type) -> type:
    """A HeadedModel class whose ``from_pretrained(path, **kwargs)`` loads a checkpoint
    (headkit's or transformer-heads') with ``base_model_class`` checked against its backbone
    and used to load a transformer-heads backbone. headkit needs no class per architecture:
    ``HeadedModel(model, head_configs)`` takes any ``PreTrainedModel``."""
    if not isinstance(base_model_class, type) or not issubclass(base_model_class, PreTrainedModel):
        raise ConfigError(
            f"get_multi_head_transformer({base_model_class!r}): a transformers PreTrainedModel "
            "class is expected (e.g. LlamaForCausalLM)"
        )

    def from_pretrained(cls: type, checkpoint_dir: str | os.PathLike, **kwargs: Any) -> Any:
        return restore(checkpoint_dir, model_cls=cls, model_class=base_model_class, **kwargs)

    name = f"{base_model_class.__name__}WithHeads"
    doc = f"HeadedModel loading checkpoints onto {base_model_class.__name__} backbones."
    attrs = {"from_pretrained": classmethod(from_pretrained), "__doc__": doc}
    return type(name, (HeadedModel,), {"base_model_class": base_model_class, **attrs})


def load_tokenizer(model_path: str | os.PathLike) -> Any:
    """The tokenizer of an adapter checkpoint's base model (its ``adapter_config.json``), with
    pad = eos when it has no pad token (transformer-heads' helper)."""
    from transformers import AutoTokenizer

    config = os.path.join(os.fspath(model_path), "adapter_config.json")
    if not os.path.isfile(config):
        raise FileNotFoundError(
            f"{config} is missing: not an adapter checkpoint; load the tokenizer with "
            "AutoTokenizer.from_pretrained"
        )
    with open(config, encoding="utf-8") as f:
        base = json.load(f)["base_model_name_or_path"]
    near = os.path.join(os.path.dirname(os.path.abspath(os.fspath(model_path))), base)
    base = base if os.path.isdir(base) or not os.path.isdir(near) else near
    tokenizer = AutoTokenizer.from_pretrained(base, trust_remote_code=False)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@dataclass
class DataCollatorWithPadding:
    """transformer-heads' collator: the features named in ``feature_name_to_padding_value``
    are right-padded with their value, every other feature is stacked; targets stay at the
    top level of the batch (``HeadedCollator`` pads by the heads' label rules instead)."""

    feature_name_to_padding_value: dict[str, int | float]

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = {
            key: pad_sequence(
                [torch.as_tensor(f[key]) for f in features], batch_first=True, padding_value=value
            )
            for key, value in self.feature_name_to_padding_value.items()
        }
        for key in features[0]:
            if key not in batch:
                batch[key] = torch.stack([torch.as_tensor(f[key]) for f in features])
        return batch
