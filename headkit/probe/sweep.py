"""Layer sweeps: where in a network is a property encoded?

``probe_layers`` runs the frozen backbone once per batch, only as deep as the deepest chosen
layer (``cache_features`` with one feature head per layer and pooling), then trains one
linear probe per (layer, pooling) on the cached features — all of them together, batched
(``headkit.probe.fit``) — and scores each on a held-out split:

- held-out split: ``test_fraction`` of the examples, drawn with ``seed`` (stratified by
  class for classification);
- validation: ``folds``-fold cross-validation (5 by default; stratified), or ``val_splits``
  random splits each holding back ``val_fraction`` of the training examples, choose the L2
  penalty; ``val_score`` (what ``best()`` picks the layer on) is their mean validation score;
- each probe is then refitted on every training example with the L2 chosen most often: its
  held-out score is ``score`` (``ci95`` a bootstrap interval over held-out rows), its outputs
  the per-example ``predictions`` / ``probabilities`` and ``metrics``, its weights (folded onto
  the raw features) what ``ProbeResults.to_headed`` builds a head from; ``std`` is the spread
  of the split probes' held-out scores;
- features are standardised per layer with the training split's statistics;
- control task (Hewitt & Liang, 2019): each distinct input text (sequence tasks) or word type
  (token tasks) gets a fixed random label drawn from the training labels; probes are trained
  on it the same way and ``selectivity = score - control score``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..backbone.sources import describe, load_model, source_tokenizer, tokenizer_source
from ..config import HeadConfig
from ..data.media import encode_media, input_kind, load_processor
from ..distributed import ranks
from ..errors import ConfigError
from ..features import cache_features
from ..features.shards import balanced_order
from ..model.headed import HeadedModel
from .data import (
    TASKS,
    ProbeRows,
    control_labels,
    media_rows,
    parse_layers,
    parse_poolings,
    prepare_rows,
    split_rows,
)
from .fit import (
    DEFAULT_L2,
    bootstrap_interval,
    check_penalties,
    fit_and_score,
    fit_threads,
    score_items,
    standardisation,
)
from .pairs import check_pairs, is_pair_rows, mirrored, pair_margins, pair_rows, reward_weight
from .results import ProbeResults, ProbeRow

#: Bytes of features and probe activations handled at once (problems are chunked to fit).
_CHUNK_BYTES = 512 * 2**20


def probe_layers(
    model: str | os.PathLike | PreTrainedModel | HeadedModel,
    inputs: Sequence[Any] | None = None,
    labels: Sequence[Any] | None = None,
    *,
    texts: Sequence[Any] | None = None,
    test_inputs: Sequence[Any] | None = None,
    test_labels: Sequence[Any] | None = None,
    layers: str | int | Sequence[int] = "all",
    pooling: str | Sequence[str] | None = None,
    task: str = "classification",
    tokenizer: Any = None,
    processor: Any = None,
    control: bool = False,
    val_splits: int | None = None,
    folds: int | None = None,
    seed: int = 0,
    test_fraction: float = 0.2,
    val_fraction: float = 0.2,
    l2: Sequence[float] = DEFAULT_L2,
    max_length: int = 128,
    batch_size: int = 32,
    max_iter: int = 200,
    tol: float = 3e-4,
    bootstrap: int = 1000,
    model_kwargs: dict[str, Any] | None = None,
    progress: bool = True,
    keep_features: bool = False,
) -> ProbeResults:
    """Train a linear probe on every chosen layer (and pooling) and score it held out.

    ``model``: a path or hub id (``model_kwargs`` go to ``from_pretrained``),
    ``packaged:minilm``/``packaged:smollm2``, a ``PreTrainedModel`` or a ``HeadedModel``.
    ``inputs`` (``texts=``, its older name): texts, images (PIL images, arrays, paths,
    ``datasets`` Image cells) or audio (1-D arrays at the processor's rate, WAV paths,
    ``datasets`` Audio cells); ``tokenizer`` / ``processor`` default to the model's own.
    ``task``: "classification", "regression", "token" (``inputs`` lists of words, ``labels``
    one class per word, on its first sub-token) or "pairwise": ``inputs`` preference rows as
    TRL writes them (``{"chosen", "rejected"}``, optional ``"prompt"``; chosen by default
    when the rows are such mappings and no labels are given), each probe a linear reward
    fitted with the Bradley–Terry loss and scored by held-out ``pairwise_accuracy`` (module
    docstring of ``headkit.probe.pairs``). ``test_inputs``/``test_labels``: score on this
    given split instead of holding out ``test_fraction`` (validation still comes from
    ``inputs``; ``n_test`` counts the given rows). ``layers`` index ``hidden_states`` as HF
    does (``parse_layers``); ``pooling`` may name several (``parse_poolings``). The L2 penalty
    and the best layer are chosen on validation: ``folds``-fold cross-validation (default 5
    folds when neither is given), or ``val_splits`` random validation splits of
    ``val_fraction``; then each probe is refitted on every training example and scored held
    out. ``seed`` draws every split; classification splits are stratified (module docstring).
    The backbone is left as it was. Under torchrun or ``accelerate launch`` the backbone passes
    are split over the ranks and every rank returns the results one process would.
    ``keep_features=True`` keeps the pooled features in ``results.features`` (sequence tasks;
    one row per input, in the input order), so that a head trained next on one of these
    layers needs no second backbone pass (``headkit demo`` does this).
    """
    if task == "pairwise" or (
        texts is None and labels is None and inputs is not None and is_pair_rows(list(inputs))
    ):
        refused = {
            "labels": (
                labels,
                "each pair is its own label (chosen over rejected); give the rows alone",
            ),
            "control": (
                control,
                "a pair has no class to draw a control label from; leave it False",
            ),
            "test_inputs": (
                test_inputs if test_inputs is not None else test_labels,
                "the probe holds out test_fraction of the pairs",
            ),
        }
        for name, (value, why) in refused.items():
            if value is not None and value is not False:
                raise ConfigError(
                    f"{name} does not apply to preference pairs (task='pairwise'): {why}",
                    field=name,
                    value=value if isinstance(value, bool) else type(value).__name__,
                )
        return _probe_pairs(
            model,
            list(inputs if inputs is not None else texts or []),
            layers=layers,
            pooling=pooling,
            tokenizer=tokenizer,
            val_splits=val_splits,
            folds=folds,
            seed=seed,
            test_fraction=test_fraction,
            val_fraction=val_fraction,
            l2=l2,
            max_length=max_length,
            batch_size=batch_size,
            max_iter=max_iter,
            tol=tol,
            bootstrap=bootstrap,
            model_kwargs=model_kwargs,
            progress=progress,
        )
    inputs, labels, given = _inputs_and_test_split(inputs, texts, labels, test_inputs, test_labels)
    val_splits, folds = _validation(val_splits, folds)
    _check_args(
        task, pooling, val_splits, test_fraction, val_fraction, l2, bootstrap, inputs, labels
    )
    poolings = [] if task == "token" else parse_poolings(pooling or "mean")
    n_examples = len(inputs) - (given or 0)
    settings = _settings(
        seed, val_fraction, max_length, bootstrap, n_examples, given, test_fraction
    )
    settings["folds"] = folds
    if keep_features is not False and (keep_features is not True or task == "token"):
        raise ConfigError(
            f"keep_features={keep_features!r} is invalid for task={task!r}; allowed: True or "
            "False for classification and regression (one pooled row per input), False for "
            "'token'",
            field="keep_features",
            value=keep_features,
        )
    rank, world = ranks.current()  # under torchrun: the backbone passes split over the ranks
    progress = progress and rank == 0
    lap = _Laps()
    kind = input_kind(inputs)
    backbone, tokenizer = _backbone_and_tokenizer(model, tokenizer, model_kwargs, kind, processor)
    num_layers = _num_layers(backbone)
    chosen = parse_layers(layers, num_layers)
    lap("load")
    rows = _rows(tokenizer, inputs, labels, task, max_length, kind)
    lap("tokenize")
    features = _features(backbone, rows, chosen, poolings, batch_size, progress, world)
    lap("features")
    test_from = None if given is None else n_examples  # examples from here on: the given split
    split = split_rows(rows, test_fraction, val_fraction, val_splits, seed, test_from, folds)
    with fit_threads():  # small matrices: one thread, never oversubscribed (fit.py)
        y, penalties, scores = _score(
            features, rows, split, control, seed, l2, max_iter, tol, bootstrap, progress
        )
    lap("probes")
    baseline = _baseline(y[0], split, rows.classes is None)
    return ProbeResults(
        task=task,
        metric="r2" if task == "regression" else "accuracy",
        model=describe(model),
        num_layers=num_layers,
        rows=_result_rows(
            scores,
            chosen,
            poolings or ["token"],
            baseline,
            val_splits,
            control,
            rows,
            split["test"],
        ),
        baseline=baseline,
        n_train=int(split["train"].sum()),
        n_test=int(split["test"].sum()),
        val_splits=val_splits,
        control=control,
        l2_grid=penalties.tolist(),
        classes=rows.classes,
        test_index=sorted({i - (test_from or 0) for i in rows.example[split["test"]].tolist()}),
        settings=settings,
        timings=lap.times,
        source=(model, dict(model_kwargs or {})),
        test_labels=_held_labels(rows, split["test"]),
        features=features if keep_features else None,
    )


def _probe_pairs(model: Any, inputs: list, **o: Any) -> ProbeResults:
    """``probe_layers`` on preference pairs: one linear reward per (layer, pooling), fitted as
    logistic regression on mirrored feature differences (``headkit.probe.pairs``), the L2 and
    the layer chosen on validation pairs, scored by held-out pairwise accuracy."""
    check_pairs(inputs)
    val_splits, folds = _validation(o["val_splits"], o["folds"])
    tf, vf, l2, boot = o["test_fraction"], o["val_fraction"], o["l2"], o["bootstrap"]
    _check_args("pairwise", o["pooling"], val_splits, tf, vf, l2, boot, inputs, inputs)
    poolings = parse_poolings(o["pooling"] or "mean")
    rank, world = ranks.current()
    progress = o["progress"] and rank == 0
    lap = _Laps()
    backbone, tokenizer = _backbone_and_tokenizer(model, o["tokenizer"], o["model_kwargs"])
    num_layers = _num_layers(backbone)
    chosen = parse_layers(o["layers"], num_layers)
    lap("load")
    sides, kept, dropped = pair_rows(tokenizer, inputs, o["max_length"])
    lap("tokenize")
    features = _features(backbone, sides, chosen, poolings, o["batch_size"], progress, world)
    lap("features")
    n = len(kept)
    diffs, rows = mirrored(features, n)  # (2P, d) per key: f(c) - f(r), then its negation
    del features
    split = split_rows(rows, tf, vf, val_splits, o["seed"], None, folds)
    with fit_threads():
        _, penalties, scores = _score(
            diffs, rows, split, False, o["seed"], l2, o["max_iter"], o["tol"], boot, progress
        )
    lap("probes")
    held = split["test"][:n]  # (P,): the held-out pairs (their mirrors are held out too)
    out = []
    for p in poolings:
        for k in chosen:
            s = scores[(p, k)]
            weight = reward_weight(s["weight"])  # (1, d) on the raw pooled features
            margins = pair_margins(diffs[(p, k)][:n][held], weight)  # (n_test,)
            items = (margins > 0).float()[None, None, None]  # (1, 1, 1, n_test)
            ci = bootstrap_interval(items, items[0, 0], False, boot, o["seed"])[0, 0]
            row = ProbeRow(
                layer=k,
                pooling=p,
                score=float(items.mean()),
                train_score=float(s["refit_train"][0]),
                val_score=float(s["val"][:, 0].mean()),
                std=float(s["test"][:, 0].std()) if val_splits > 1 else None,
                ci95=(float(ci[0]), float(ci[1])),
                baseline=0.5,
                l2=[float(v) for v in s["l2"][:, 0]],
                refit_l2=float(s["refit_l2"][0]),
            )
            row.set_pair_outputs(margins, weight)
            out.append(row)
    settings = _settings(o["seed"], vf, o["max_length"], boot, len(inputs), None, tf)
    settings.update(folds=folds, pairs_dropped=dropped)
    n_test = int(held.sum())
    return ProbeResults(
        task="pairwise",
        metric="pairwise_accuracy",
        model=describe(model),
        num_layers=num_layers,
        rows=out,
        baseline=0.5,
        n_train=n - n_test,
        n_test=n_test,
        val_splits=val_splits,
        control=False,
        l2_grid=penalties.tolist(),
        test_index=[kept[i] for i in torch.nonzero(held)[:, 0].tolist()],
        settings=settings,
        timings=lap.times,
        source=(model, dict(o["model_kwargs"] or {})),
        test_labels=[1] * n_test,  # the chosen side is preferred
    )


def _held_labels(rows: ProbeRows, test: torch.Tensor) -> list[Any]:
    """The held-out rows' labels: class indices, or values in the labels' own units."""
    y = rows.y[test]
    if rows.target_scale is None:
        return y.tolist()
    scale, shift = rows.target_scale
    return (y.double() * scale + shift).tolist()


def _score(
    features: dict,
    rows: Any,
    split: dict[str, torch.Tensor],
    control: bool,
    seed: int,
    l2: Sequence[float],
    max_iter: int,
    tol: float,
    bootstrap: int,
    progress: bool,
    select: str = "accuracy",
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(labels of each variant, the L2 grid, the probes' scores): the task's labels, then the
    control task's, fitted together."""
    variants = [rows.y] + ([control_labels(rows, split["train"], seed)] if control else [])
    y = torch.stack(variants)  # (V, R): the task's labels, then the control task's
    num_classes = len(rows.classes) if rows.classes is not None else None
    penalties = torch.tensor([float(v) for v in l2])
    scores = _train_probes(
        features,
        y,
        split=split,
        l2=penalties,
        num_classes=num_classes,
        max_iter=max_iter,
        tol=tol,
        resamples=bootstrap,
        seed=seed,
        progress=progress,
        select=select,
    )
    return y, penalties, scores


#: Folds of cross-validation when neither ``folds`` nor ``val_splits`` is given.
DEFAULT_FOLDS = 5


def _validation(val_splits: Any, folds: Any) -> tuple[int, int | None]:
    """(validation splits, folds or None): ``folds`` k-fold cross-validation, or
    ``val_splits`` random splits; neither: ``DEFAULT_FOLDS`` folds."""
    if val_splits is not None and folds is not None:
        raise ConfigError(
            f"val_splits={val_splits!r} and folds={folds!r} were both given; pass one: folds "
            "(k-fold cross-validation) or val_splits (random validation splits)"
        )
    if val_splits is None and folds is None:
        folds = DEFAULT_FOLDS
    if folds is not None:
        if not isinstance(folds, int) or isinstance(folds, bool) or folds < 2:
            raise ConfigError(f"folds={folds!r} is invalid; an integer >= 2 (k-fold validation)")
        return folds, folds
    return val_splits, None


def _settings(
    seed: int,
    val_fraction: float,
    max_length: int,
    bootstrap: int,
    n_examples: int,
    given: int | None,
    test_fraction: float,
) -> dict[str, Any]:
    """The sweep's settings as ``ProbeResults.settings`` records them."""
    settings = {"seed": seed, "val_fraction": val_fraction}
    settings.update(max_length=max_length, bootstrap=bootstrap, n_examples=n_examples)
    if given is None:
        settings["test_fraction"] = test_fraction
    else:
        settings["n_test_examples"] = given
    return settings


def _inputs_and_test_split(
    inputs: Any, texts: Any, labels: Any, test_inputs: Any, test_labels: Any
) -> tuple[list, list, int | None]:
    """(inputs, labels, size of the given test split or None): ``texts=`` is ``inputs``' older
    name; a given test split is appended to the inputs and marked by its size."""
    if texts is not None:
        if inputs is not None:
            raise ConfigError("pass inputs or texts (its older name), not both")
        inputs = texts
    if inputs is None or labels is None:
        raise ConfigError("probe_layers needs inputs (texts, or words for task='token') and labels")
    inputs, labels = list(inputs), list(labels)
    if (test_inputs is None) != (test_labels is None):
        given = "test_inputs" if test_labels is None else "test_labels"
        missing = "test_labels" if test_labels is None else "test_inputs"
        raise ConfigError(f"{given} was given without {missing}; pass both or neither")
    if test_inputs is None:
        return inputs, labels, None
    test_inputs, test_labels = list(test_inputs), list(test_labels)
    if len(test_inputs) != len(test_labels):
        raise ConfigError(
            f"got {len(test_inputs)} test_inputs but {len(test_labels)} test_labels; one label "
            "per test input"
        )
    if not test_inputs:
        raise ConfigError("test_inputs is empty; give at least one test example, or none at all")
    return inputs + test_inputs, labels + test_labels, len(test_inputs)


class _Laps:
    """Wall time of consecutive steps: ``lap("name")`` records the time since the last lap."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self.last = time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = now - self.last
        self.last = now


def _check_args(
    task, pooling, val_splits, test_fraction, val_fraction, l2, bootstrap, texts, labels
):
    if task not in TASKS:
        raise ConfigError(
            f"task={task!r} is invalid; allowed: {', '.join(TASKS)}", field="task", value=task
        )
    if task == "token" and pooling is not None:
        raise ConfigError(
            f"pooling={pooling!r} does not apply to task='token'; leave it unset",
            field="pooling",
            value=pooling,
        )
    if not isinstance(val_splits, int) or isinstance(val_splits, bool) or val_splits < 1:
        raise ConfigError(
            f"val_splits={val_splits!r} is invalid; an integer >= 1 (how many validation splits)",
            field="val_splits",
            value=val_splits,
        )
    for name, v in (("test_fraction", test_fraction), ("val_fraction", val_fraction)):
        if not isinstance(v, (int, float)) or not 0 < v < 1:
            raise ConfigError(f"{name}={v!r} is invalid; a fraction strictly between 0 and 1")
    check_penalties(l2)
    if not isinstance(bootstrap, int) or bootstrap < 10:
        raise ConfigError(f"bootstrap={bootstrap!r} is invalid; an integer >= 10 (resamples)")
    if len(texts) != len(labels):
        raise ConfigError(f"got {len(texts)} inputs but {len(labels)} labels; one label per input")


def _rows(encoder: Any, inputs: list, labels: list, task: str, max_length: int, kind: str) -> Any:
    """The sweep's rows: texts tokenized, or images and audio through the processor (each
    input's path, else its index, names it for the control task)."""
    if kind == "text":
        return prepare_rows(encoder, inputs, labels, task, max_length)
    keys = [str(x) if isinstance(x, (str, os.PathLike)) else f"#{i}" for i, x in enumerate(inputs)]
    return media_rows(encode_media(encoder, inputs, kind), keys, labels, task)


def _backbone_and_tokenizer(
    model: Any, tokenizer: Any, model_kwargs: Any, kind: str = "text", processor: Any = None
) -> tuple[Any, Any]:
    """(the backbone, what encodes the inputs: the tokenizer for texts, the processor for
    images and audio), each loaded from the model's folder unless given."""
    if isinstance(model, HeadedModel):
        model = model.backbone
    if kind != "text":
        source = model if isinstance(model, (str, os.PathLike)) else tokenizer_source(model)
        backbone = load_model(model, model_kwargs) if source is model else model
        if processor is None and source is None:
            raise ConfigError(
                f"processor=None, and {type(model).__name__} was not loaded from a local "
                f"folder to read one from; pass processor= for {kind} inputs"
            )
        return backbone, processor or load_processor(source, kind)
    if isinstance(model, (str, os.PathLike)):
        backbone = load_model(model, model_kwargs)
        return backbone, tokenizer or source_tokenizer(model, model_kwargs)
    if not isinstance(model, PreTrainedModel):
        raise ConfigError(
            f"model={type(model).__name__} is invalid; a path, hub id, 'packaged:minilm', a "
            "PreTrainedModel or a HeadedModel",
            field="model",
            value=type(model).__name__,
        )
    if tokenizer is None:
        source = tokenizer_source(model)
        if source is None:
            raise ConfigError(
                f"tokenizer=None, and {type(model).__name__} was not loaded from a local folder "
                "to read one from; pass tokenizer="
            )
        tokenizer = source_tokenizer(source)
    return model, tokenizer


@contextmanager
def _left_as_it_was(backbone: PreTrainedModel) -> Iterator[None]:
    """Restore every parameter's requires_grad and every module's train/eval mode on exit
    (HeadedModel freezes the backbone and puts it in eval mode)."""
    flags = [p.requires_grad for p in backbone.parameters()]
    modes = [m.training for m in backbone.modules()]
    try:
        yield
    finally:
        for p, flag in zip(backbone.parameters(), flags):
            p.requires_grad_(flag)
        for m, mode in zip(backbone.modules(), modes):
            m.training = mode


def _num_layers(backbone: PreTrainedModel) -> int:
    """Number of blocks as headkit finds them (layer -1 resolves to it)."""
    with _left_as_it_was(backbone):
        probe = HeadedModel(backbone, [HeadConfig("depth", loss_fct=None)])
        return probe.hooked_layers()["depth"]


def _features(backbone, rows: ProbeRows, layers, poolings, batch_size, progress, world) -> dict:
    """{(pooling or "token", layer): (R, width) float32} from one cached backbone pass (on
    ``world`` ranks: each runs its share of the batches, and every rank gets them all)."""
    if rows.position is None:
        heads = {
            (p, k): HeadConfig(
                f"layer{k}_{p}", layer_hook=k, pred_for_sequence=True, pooling=p, loss_fct=None
            )
            for p in poolings
            for k in layers
        }
    else:
        heads = {("token", k): HeadConfig(f"layer{k}", layer_hook=k, loss_fct=None) for k in layers}
    lengths = torch.tensor([_length(e) for e in rows.examples])
    # similar lengths per batch (less padding); each rank's share holds batches of all lengths
    order = balanced_order(lengths, batch_size, world)
    with _left_as_it_was(backbone):
        headed = HeadedModel(backbone, list(heads.values()))
        cached = cache_features(
            headed,
            [rows.examples[i] for i in order.tolist()],
            batch_size=batch_size,
            progress=progress,
        )
    if rows.position is None:
        where = torch.empty_like(order)
        where[order] = torch.arange(len(order))  # cache row of each example
        rows_index = where[rows.example]
    else:
        starts = torch.zeros(len(order), dtype=torch.long)
        starts[order] = torch.cumsum(lengths[order], 0) - lengths[order]
        rows_index = starts[rows.example] + rows.position  # cache token of each labelled word
    return {key: cached.features(cfg.name)[rows_index].float() for key, cfg in heads.items()}


def _length(example: dict) -> int:
    """Tokens (or audio samples) of an example: batches of similar lengths pad less."""
    for key in ("input_ids", "input_values"):
        if key in example:
            return len(example[key])
    return 0


def _train_probes(
    features,
    y,
    *,
    split,
    l2,
    num_classes,
    max_iter,
    tol,
    resamples,
    seed,
    progress,
    select="accuracy",
) -> dict:
    """Fit every problem, chunked by width and memory; per key: the split probes' scores,
    the refitted probe (weights folded onto the raw features, its held-out outputs and
    score) and a 95% interval of that score."""
    train, test, fit = split["train"], split["test"], split["fit"]
    n_rows = int(train.sum())
    by_width: dict[int, list] = {}
    for key, x in features.items():
        by_width.setdefault(x.shape[1], []).append(key)
    outputs = (fit.shape[0] + 1) * y.shape[0] * l2.numel() * (num_classes or 1)
    chunks = []
    for width, keys in by_width.items():
        per_problem = 4 * (len(train) * (width + 1) * 3 + n_rows * outputs * 4)
        size = max(1, _CHUNK_BYTES // per_problem)
        chunks += [keys[i : i + size] for i in range(0, len(keys), size)]
    bar = tqdm(total=len(chunks) * max_iter, desc="headkit: training probes", disable=not progress)
    out = {}
    regression = num_classes is None
    try:
        for i, keys in enumerate(chunks):
            x = torch.stack([features[k] for k in keys])  # (B, R, d)
            mu, scale = standardisation(x[:, train])
            x_train = (x[:, train] - mu) * scale
            x_test = (x[:, test] - mu) * scale
            got = fit_and_score(
                x_train,
                y[:, train],
                x_test,
                y[:, test],
                fit,
                l2,
                num_classes,
                max_iter,
                tol,
                bar,
                refit=True,
                select=select,
            )
            weight, bias = _fold(got.refit, mu, scale)  # (B, C, d, V), (B, V, C): raw features
            raw_test = x[:, test]
            del x, x_train, x_test
            held = _outputs(raw_test, weight, bias)  # (B, n_test, V, C)
            if regression:
                items = (held[..., 0] - _lead_values(y[:, test])) ** 2  # (B, n_test, V)
            else:
                items = (held.argmax(-1) == y[:, test].T[None]).float()
            items = items.permute(0, 2, 1)[:, None].contiguous()  # (B, 1, V, n_test)
            ci = bootstrap_interval(items, y[:, test], regression, resamples, seed)
            score = score_items(items, y[:, test], regression)[:, 0]  # (B, V)
            for j, key in enumerate(keys):
                out[key] = {
                    "test": got.test[j],
                    "train": got.train[j],
                    "val": got.val[j],
                    "val_loss": got.val_loss[j],
                    "l2": got.l2[j],
                    "ci95": ci[j],
                    "score": score[j],
                    "refit_train": got.refit.train[j],
                    "refit_l2": got.refit.l2[j],
                    "weight": weight[j, ..., 0].contiguous(),  # (C, d): the task's probe
                    "bias": bias[j, 0].contiguous(),  # (C,)
                    "held": held[j, :, 0],  # (n_test, C): its held-out outputs
                }
            bar.n = (i + 1) * max_iter
            bar.refresh()
    finally:
        bar.close()
    return out


def _fold(refit: Any, mu: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The refitted probes on the raw features: ``((x - mu) * scale) @ W + b`` equals
    ``x @ (scale * W) + (b - (mu * scale) @ W)``. Returns weight (B, C, d, V) — the layout of
    ``nn.Linear.weight`` per variant — and bias (B, V, C)."""
    w = refit.weight * scale[:, 0, :, None, None]  # (B, d, V, C)
    b = refit.bias - torch.einsum("bd,bdvc->bvc", (mu * scale)[:, 0], refit.weight)
    return w.permute(0, 3, 1, 2), b


def _outputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Each probe's outputs on raw features x (B, n, d), computed as ``nn.Linear`` computes
    them (``F.linear``), so that the head ``to_headed`` builds gives the same: (B, n, V, C)."""
    return torch.stack(
        [
            torch.stack(
                [F.linear(x[b], weight[b, ..., v], bias[b, v]) for v in range(weight.shape[-1])],
                1,
            )
            for b in range(x.shape[0])
        ]
    )


def _lead_values(y: torch.Tensor) -> torch.Tensor:
    """(V, n) values → (1, n, V) to broadcast against (B, n, V)."""
    return y.float().T[None]


def _baseline(y: torch.Tensor, split, regression: bool) -> float:
    """Held-out score of the majority training class, or R^2 of the training mean."""
    y_train, y_test = y[split["train"]], y[split["test"]]
    if regression:
        mean = y_train.double().mean()
        yt = y_test.double()
        ss_tot = ((yt - yt.mean()) ** 2).sum().clamp(min=1e-30)
        return float(1 - ((yt - mean) ** 2).sum() / ss_tot)
    majority = torch.bincount(y_train).argmax()
    return float((y_test == majority).float().mean())


def _result_rows(
    scores, layers, poolings, baseline, val_splits, control, rows, test
) -> list[ProbeRow]:
    y_test = rows.y[test]
    rows_out = []
    for p in poolings:
        for k in layers:
            s = scores[(p, k)]
            test_split = s["test"]  # (S, V): each split's probe
            held = s["held"]  # (n_test, C): the refitted probe's outputs
            row = ProbeRow(
                layer=k,
                pooling=p,
                score=float(s["score"][0]),
                train_score=float(s["refit_train"][0]),
                val_score=float(s["val"][:, 0].mean()),
                std=float(test_split[:, 0].std()) if val_splits > 1 else None,
                ci95=(float(s["ci95"][0, 0]), float(s["ci95"][0, 1])),
                baseline=baseline,
                l2=[float(v) for v in s["l2"][:, 0]],
                refit_l2=float(s["refit_l2"][0]),
            )
            row.set_outputs(held, y_test, rows.classes, rows.target_scale, s["weight"], s["bias"])
            if control:
                row.control = float(s["score"][1])
                row.control_train = float(s["refit_train"][1])
                row.control_std = float(test_split[:, 1].std()) if val_splits > 1 else None
                row.selectivity = row.score - row.control
            rows_out.append(row)
    return rows_out


__all__ = ["TASKS", "parse_layers", "parse_poolings", "probe_layers"]
