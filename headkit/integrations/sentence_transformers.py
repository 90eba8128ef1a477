"""sentence-transformers in and out: a ``SentenceTransformer`` as backbone, a head as one.

In: ``HeadedModel(st, heads)`` and ``load_headed(st_or_folder, ...)`` use the model inside
the first Transformer module (``st[0].auto_model``); a folder with ``modules.json`` points
to its Transformer module's folder. ``model(**st.tokenize(texts))`` works because the input
stage drops the keys sentence-transformers adds (``inputs.TOKENIZER_EXTRAS``).

Out: ``to_sentence_transformer(model, head, tokenizer)`` builds Transformer → Pooling →
Dense modules whose ``encode`` returns the head's predictions, for a head on the last layer
whose pooling sentence-transformers has and whose activations are plain ``torch.nn``
modules. Every module is sentence-transformers' own, so the saved model loads with
``SentenceTransformer(path)`` offline and without ``trust_remote_code``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from torch import nn

from ..errors import ConfigError
from ..heads.activations import build_activation
from ..heads.base import Head

#: headkit pooling → sentence-transformers ``Pooling(pooling_mode=...)``.
ST_POOLING = {
    "first": "cls",
    "last": "lasttoken",
    "mean": "mean",
    "max": "max",
    "mean_sqrt_len": "mean_sqrt_len_tokens",
    "weighted_mean": "weightedmean",
}


def to_sentence_transformer(
    model: Any, head: str, tokenizer: Any, *, max_seq_length: int | None = None
) -> Any:
    """A ``SentenceTransformer`` whose ``encode`` returns ``model``'s predictions of ``head``.

    Transformer (a copy of the backbone and ``tokenizer``) → Pooling (the head's pooling) →
    one Dense per Linear of the head (``Head.dense_layers``: for an MLP head the hidden
    activation between, the output activation after the last; dropout is left out, as at
    inference). Raises ConfigError for a head it cannot express: a token head, a head on
    another layer than the last, a pooling that sentence-transformers lacks (pooler,
    attention, concatenations), a head kind that is no chain of Linear layers, or an
    activation that is not a plain ``torch.nn`` module.
    """
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    cfg, mode, layers = _exportable(model, head)
    with tempfile.TemporaryDirectory(prefix="headkit-st-") as tmp:
        model.backbone.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        transformer = Transformer(tmp, max_seq_length=max_seq_length)
    modules: list[nn.Module] = [transformer, Pooling(cfg.in_size, pooling_mode=mode)]
    for linear, activation in layers:
        modules.append(
            Dense(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                activation_function=activation,
                init_weight=linear.weight.detach().clone(),
                init_bias=None if linear.bias is None else linear.bias.detach().clone(),
            )
        )
    st = SentenceTransformer(modules=modules, device=str(model.device))
    return st.to(model.dtype)


def export_sentence_transformer(
    model: Any,
    directory: str | os.PathLike,
    *,
    head: str | None = None,
    tokenizer: Any = None,
    max_seq_length: int | None = None,
) -> Any:
    """The ``"sentence-transformers"`` exporter (``headkit.export``): ``head`` (default: the
    model's only head) as a SentenceTransformer (``to_sentence_transformer``) saved in
    ``directory``; returns the SentenceTransformer."""
    if head is None:
        names = list(model.head_configs)
        if len(names) != 1:
            raise ConfigError(
                f"head=None is ambiguous for a model with heads {names}; name one",
                field="head",
                value=None,
            )
        head = names[0]
    if not tokenizer:
        raise ConfigError(
            "tokenizer=None: a SentenceTransformer needs the tokenizer; pass tokenizer=",
            field="tokenizer",
            value=tokenizer,
        )
    st = to_sentence_transformer(model, head, tokenizer, max_seq_length=max_seq_length)
    st.save(os.fspath(directory))
    return st


def _exportable(model: Any, head: str) -> tuple[Any, str, list[tuple[nn.Linear, nn.Module]]]:
    """(config, sentence-transformers pooling mode, [(Linear, activation after it)])."""
    if head not in model.head_configs:
        raise ConfigError(
            f"to_sentence_transformer: head={head!r} is not a head of this model; heads: "
            f"{list(model.heads)}"
        )
    cfg = model.head_configs[head]
    where = f"to_sentence_transformer: head {head!r}"
    if not cfg.pred_for_sequence:
        raise ConfigError(f"{where} is a token head; only sequence heads (pred_for_sequence=True)")
    if model.hooked_layers()[head] != model.info.num_layers:
        raise ConfigError(
            f"{where} reads layer_hook={cfg.layer_hook}; sentence-transformers pools the last "
            "hidden state, so only a head on layer_hook=-1 can be exported"
        )
    strategies = cfg.pooling_strategies
    if len(strategies) != 1 or strategies[0] not in ST_POOLING:
        raise ConfigError(
            f"{where} pools with {cfg.pooling!r}; sentence-transformers has "
            f"{', '.join(sorted(ST_POOLING))} (one strategy)"
        )
    module = model.heads[head]
    dense = module.dense_layers() if isinstance(module, Head) else None
    if not dense:
        raise ConfigError(
            f"{where} is a {type(module).__name__}, which is not a chain of Linear layers "
            "(Head.dense_layers() gives none); only such heads (e.g. 'mlp') can be exported"
        )
    layers = [(lin, _plain(act, where)) for lin, act in dense]
    return cfg, ST_POOLING[strategies[0]], layers


def _plain(name: str, where: str) -> nn.Module:
    """The activation as a ``torch.nn`` module that a default constructor rebuilds (what
    sentence-transformers' Dense saves: the class path only)."""
    act = build_activation(name)
    cls = type(act)
    if not cls.__module__.startswith("torch.nn") or any(True for _ in act.parameters()):
        raise ConfigError(f"{where}: activation {name!r} is not a plain torch.nn module")
    try:
        rebuilt = cls()
    except TypeError:
        rebuilt = None
    if rebuilt is None or rebuilt.extra_repr() != act.extra_repr():
        raise ConfigError(
            f"{where}: activation {name!r} ({act!r}) has arguments that sentence-transformers' "
            "Dense does not save; use an activation without arguments (e.g. 'gelu', 'tanh')"
        )
    return act
