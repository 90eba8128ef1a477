"""Stepwise supervision for process reward models (PRMs), in TRL's format.

An example is ``{"prompt": str, "completions": [step, ...], "labels": [bool, ...]}``: one label
per reasoning step. It is tokenised as TRL's ``PRMTrainer.tokenize_row`` does: the prompt
without special tokens (the tokenizer's bos, if it has one, in front), each step followed by
the separator (``step_separator``, default "\\n"), the step's label on the separator's last
token and -100 everywhere else; ``max_completion_length`` cuts the completion and
``max_length`` the whole. A token head (``pred_for_sequence=False``) with two outputs and
``cross_entropy`` is then TRL's ``AutoModelForTokenClassification(num_labels=2)`` PRM; its
score of a step is the probability of class 1 at the step's last token (``step_scores``), and
while generating, at each separator the model emits (``step_end_scores``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

import torch

from ..errors import BatchError, ConfigError
from ..losses.objective import IGNORE_INDEX, label_rule
from .examples import map_examples

#: TRL PRMConfig's default separator between steps.
STEP_SEPARATOR = "\n"


def is_stepwise_data(columns: Sequence[str]) -> bool:
    """Whether a dataset with these columns is TRL's stepwise supervision."""
    return {"completions", "labels"} <= set(columns) and "input_ids" not in columns


def step_head(head_configs: Mapping[str, Any], head: str | None = None) -> str:
    """The PRM head: ``head``, else the one token head (not a causal LM) with a loss."""
    if head is not None:
        if head not in head_configs:
            raise ConfigError(f"head={head!r} is not a head of this model: {list(head_configs)}")
        return head
    found = [
        n
        for n, c in head_configs.items()
        if c.loss_fct is not None and label_rule(c).layout == "token" and not c.is_causal_lm
    ]
    if len(found) != 1:
        raise ConfigError(
            f"stepwise data trains one token head (pred_for_sequence=False, a loss); the model "
            f"has {len(found)}: {found}; pass head= to choose"
        )
    return found[0]


def tokenize_steps(
    example: Mapping[str, Any],
    tokenizer: Any,
    step_separator: str = STEP_SEPARATOR,
    max_length: int | None = None,
    max_completion_length: int | None = None,
    train_on_last_step_only: bool = False,
    is_eval: bool = False,
) -> dict[str, list[int]]:
    """``{"input_ids", "labels"}`` of one stepwise example, exactly as TRL's
    ``PRMTrainer.tokenize_row``."""
    for key in ("prompt", "completions", "labels"):
        if key not in example:
            raise BatchError(f"stepwise data: an example has no {key!r} (keys: {sorted(example)})")
    steps, step_labels = list(example["completions"]), list(example["labels"])
    if len(steps) != len(step_labels):
        raise BatchError(
            f"stepwise data: {len(steps)} completions but {len(step_labels)} labels; one label "
            "per step"
        )
    prompt_ids = tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
    step_ids = [tokenizer(s, add_special_tokens=False)["input_ids"] for s in steps]
    if train_on_last_step_only and not is_eval:
        labels = [IGNORE_INDEX] * (len(step_labels) - 1) + [int(step_labels[-1])]
    else:
        labels = [int(x) for x in step_labels]
    separator = tokenizer.encode(step_separator, add_special_tokens=False)
    step_ids = [s + separator for s in step_ids]
    per_token = [[IGNORE_INDEX] * (len(s) - 1) + [y] for s, y in zip(step_ids, labels)]
    completion = list(chain(*step_ids))
    completion_labels = list(chain(*per_token))
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id] + prompt_ids
    if max_completion_length is not None:
        completion = completion[:max_completion_length]
        completion_labels = completion_labels[:max_completion_length]
    input_ids = prompt_ids + completion
    out_labels = [IGNORE_INDEX] * len(prompt_ids) + completion_labels
    if max_length is not None:
        input_ids, out_labels = input_ids[:max_length], out_labels[:max_length]
    return {"input_ids": input_ids, "labels": out_labels}


def tokenize_stepwise(
    data: Any,
    tokenizer: Any,
    target: str = "labels",
    *,
    is_eval: bool = False,
    **options: Any,
) -> Any:
    """Stepwise data (a ``datasets.Dataset``, a streamed ``IterableDataset``, a list of dicts)
    → ``input_ids`` and the step
    labels under ``target`` (the PRM head's target); ``options``: ``tokenize_steps``'s."""

    def encode(example: Mapping[str, Any]) -> dict[str, Any]:
        out = tokenize_steps(example, tokenizer, is_eval=is_eval, **options)
        return {"input_ids": out["input_ids"], target: out["labels"]}

    return map_examples(data, encode, desc="Tokenizing steps")


def _probabilities(preds: torch.Tensor) -> torch.Tensor:
    """(…, n) head outputs → P(step is correct): softmax's class 1 for two or more outputs,
    the sigmoid of one output."""
    preds = preds.float()
    if preds.shape[-1] == 1:
        return torch.sigmoid(preds[..., 0])
    return torch.softmax(preds, dim=-1)[..., 1]


def step_scores(
    model: Any,
    tokenizer: Any,
    prompt: str,
    completions: Sequence[str],
    *,
    head: str | None = None,
    step_separator: str = STEP_SEPARATOR,
) -> list[float]:
    """The PRM head's score of each step of ``completions`` after ``prompt``: the example is
    tokenised as for training (``tokenize_steps``) and the head read at each step's last
    token (P(class 1) for a two-output head, the sigmoid of a one-output head)."""
    name = step_head(model.head_configs, head)
    example = {"prompt": prompt, "completions": list(completions), "labels": [0] * len(completions)}
    enc = tokenize_steps(example, tokenizer, step_separator)
    ids = torch.tensor([enc["input_ids"]], device=model.device)
    ends = [i for i, y in enumerate(enc["labels"]) if y != IGNORE_INDEX]
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    scores = _probabilities(out.preds_by_head[name][0, ends])
    return [float(s) for s in scores]


def step_end_scores(
    output: Any,
    separator_ids: Sequence[int],
    head: str,
) -> list[list[tuple[int, float]]]:
    """From ``HeadedModel.generate``'s output (``head_outputs_at="token"``, the default): per
    row, ``(t, score)`` for each generated token t that completes ``separator_ids`` (the ids
    of the step separator, ``tokenizer.encode(sep, add_special_tokens=False)``) before the
    row's end. The score is the PRM head's at that token, exactly what a forward over
    ``output.sequences`` gives there, and what training labelled: the separator's last token."""
    sep = [int(i) for i in separator_ids]
    if not sep:
        raise ConfigError("step_end_scores: separator_ids is empty; the separator's token ids")
    values = (output.head_outputs or {}).get(head)
    if values is None or values.dim() != 3:
        raise ConfigError(
            f"step_end_scores: generate's output has no per-token values of head {head!r} "
            "(a token head, read with head_outputs_at='token')"
        )
    generated_mask = output.generated_mask
    n = values.shape[1]
    generated = output.sequences[:, -n:]
    probs = _probabilities(values)
    rows: list[list[tuple[int, float]]] = []
    for r in range(generated.shape[0]):
        ids = generated[r].tolist()
        real = int(generated_mask[r].sum())
        found = []
        for t in range(len(sep) - 1, real):
            if ids[t - len(sep) + 1 : t + 1] == sep:
                found.append((t, float(probs[r, t])))
        rows.append(found)
    return rows
