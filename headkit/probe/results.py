"""What a layer sweep returns: one row per (pooling, layer), as a table, JSON or a plot."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch

    from ..model.headed import HeadedModel

#: What the plot's error bars are, as the plot says it.
ERROR_BARS = "95% bootstrap interval over held-out rows"


@dataclass
class ProbeRow:
    """One probe's held-out score and what to compare it with.

    ``score`` is the held-out metric (``accuracy`` or ``r2`` in JSON) of the probe refitted on
    every training example with ``refit_l2`` (the penalty the validation splits chose most
    often); ``val_score`` the validation score averaged over the splits (what ``best`` picks
    on); ``std`` the spread of the split probes' held-out scores (None for one split);
    ``ci95`` a 95% bootstrap interval of ``score`` over held-out rows; ``l2`` the penalty
    chosen per split. ``control`` / ``selectivity`` are None unless the sweep ran a control
    task. The refitted probe's held-out outputs: ``predictions`` (class indices, or values),
    ``probabilities`` (per class; None for regression) and ``metrics`` (per-class precision,
    recall, F1, macro/micro averages, the confusion matrix, AUROC and average precision for
    two classes; mse/mae/r2 for regression). ``weight`` (C, d) and ``bias`` (C,) are its
    Linear layer on the raw pooled features (``ProbeResults.to_headed``).
    """

    layer: int
    pooling: str
    score: float
    train_score: float
    val_score: float
    std: float | None
    ci95: tuple[float, float]
    baseline: float
    l2: list[float]
    control: float | None = None
    control_train: float | None = None
    control_std: float | None = None
    selectivity: float | None = None
    refit_l2: float | None = None
    predictions: list[Any] = field(default_factory=list, repr=False)
    probabilities: list[list[float]] | None = field(default=None, repr=False)
    metrics: dict[str, Any] = field(default_factory=dict, repr=False)
    weight: torch.Tensor | None = field(default=None, repr=False, compare=False)
    bias: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def set_outputs(
        self,
        outputs: torch.Tensor,
        labels: torch.Tensor,
        classes: list[Any] | None,
        target_scale: tuple[float, float] | None,
        weight: torch.Tensor,
        bias: torch.Tensor,
    ) -> None:
        """Record the refitted probe's held-out ``outputs`` (n, C) against ``labels`` (n,):
        predictions, probabilities and metrics (regression: values in the labels' units)."""
        import numpy as np
        import torch

        from ..metrics import confusion_report, ranking_report

        if classes is None:  # ridge: outputs and labels are standardised targets
            scale, shift = target_scale or (1.0, 0.0)
            self.weight, self.bias = weight * scale, bias * scale + shift
            pred = outputs[:, 0].double() * scale + shift
            truth = labels.double() * scale + shift
            err = pred - truth
            self.predictions = pred.tolist()
            self.metrics = {
                "r2": self.score,
                "mse": float((err * err).mean()),
                "mae": float(err.abs().mean()),
            }
            return
        self.weight, self.bias = weight, bias
        probs = torch.softmax(outputs.double(), -1)
        hat = outputs.argmax(-1)
        self.predictions = hat.tolist()
        self.probabilities = probs.tolist()
        c = len(classes)
        confusion = np.bincount((labels * c + hat).numpy(), minlength=c * c).reshape(c, c)
        self.metrics = confusion_report(confusion, classes)
        if c == 2:
            self.metrics.update(ranking_report(labels.numpy(), probs[:, 1].numpy()))

    def set_pair_outputs(self, margins: torch.Tensor, weight: torch.Tensor) -> None:
        """Record a pairwise probe's held-out ``margins`` (n,), ``r(chosen) - r(rejected)``
        per pair, and its reward weight (1, d) (bias 0: a reward's offset cancels in pairs)."""
        import torch

        self.weight, self.bias = weight, torch.zeros(1, dtype=weight.dtype)
        self.predictions = margins.tolist()
        self.metrics = {"pairwise_accuracy": self.score, "mean_margin": float(margins.mean())}

    def to_dict(self, metric: str) -> dict[str, Any]:
        """JSON keys: ``accuracy``/``r2``, ``train_<metric>``, ``val_<metric>``, ``std``,
        ``ci95``, ``baseline``, ``l2`` and, with a control task, ``control_<metric>``,
        ``control_train_<metric>``, ``control_std``, ``selectivity``."""
        out: dict[str, Any] = {
            "layer": self.layer,
            "pooling": self.pooling,
            metric: self.score,
            f"train_{metric}": self.train_score,
            f"val_{metric}": self.val_score,
            "std": self.std,
            "ci95": list(self.ci95),
            "baseline": self.baseline,
            "l2": self.l2,
            "refit_l2": self.refit_l2,
            "metrics": self.metrics,
        }
        if "mean_margin" in self.metrics:  # pairwise: the reward's mean held-out margin
            out["mean_margin"] = self.metrics["mean_margin"]
        if self.control is not None:
            out[f"control_{metric}"] = self.control
            out[f"control_train_{metric}"] = self.control_train
            out["control_std"] = self.control_std
            out["selectivity"] = self.selectivity
        return out


@dataclass
class ProbeResults:
    """Results of ``probe_layers``: rows by pooling then layer, and how they were obtained.

    ``metric`` is "accuracy" (classification, token), "r2" (regression) or
    "pairwise_accuracy" (preference pairs: the share of held-out pairs whose chosen side the
    reward scores higher; each row's ``metrics`` also hold ``mean_margin`` and its
    ``predictions`` are the margins ``r(chosen) - r(rejected)``); ``baseline`` the held-out
    score of the majority class (the training mean for r2, chance 0.5 for pairs); ``test_index``
    the positions (in the input order) of the held-out examples (in ``test_inputs`` when a
    test split was given); ``test_labels`` the held-out rows' labels (class indices into
    ``classes``, or values), in the order of every row's ``predictions``. ``val_splits`` is
    the number of validation splits (the folds, with ``settings["folds"]``); ``features``
    the pooled features themselves with ``probe_layers(keep_features=True)``.
    """

    task: str
    metric: str
    model: str
    num_layers: int
    rows: list[ProbeRow]
    baseline: float
    n_train: int
    n_test: int
    val_splits: int
    control: bool
    l2_grid: list[float]
    classes: list[Any] | None = None
    test_index: list[int] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    test_labels: list[Any] = field(default_factory=list, repr=False)
    source: tuple[Any, dict[str, Any]] | None = field(default=None, repr=False, compare=False)
    #: ``probe_layers(keep_features=True)``: {(pooling, layer): (examples, width) float32},
    #: the pooled features the probes were fitted on, one row per input in the input order
    #: (reuse them instead of a second backbone pass); None otherwise. Not saved by to_json.
    features: dict[tuple[str, int], Any] | None = field(default=None, repr=False, compare=False)

    @property
    def layers(self) -> list[int]:
        return sorted({r.layer for r in self.rows})

    @property
    def poolings(self) -> list[str]:
        return list(dict.fromkeys(r.pooling for r in self.rows))

    def row(self, layer: int, pooling: str | None = None) -> ProbeRow:
        """The row of ``layer`` (hidden-states index) and ``pooling`` (default: the first)."""
        pooling = pooling or self.poolings[0]
        for r in self.rows:
            if r.layer == layer and r.pooling == pooling:
                return r
        raise ConfigError(
            f"no probe for layer={layer}, pooling={pooling!r}; layers: {self.layers}, "
            f"poolings: {self.poolings}"
        )

    def scores(self, pooling: str | None = None) -> dict[int, float]:
        """{layer: held-out score} for one pooling (default: the first)."""
        pooling = pooling or self.poolings[0]
        return {r.layer: r.score for r in self.rows if r.pooling == pooling}

    def best(self) -> ProbeRow:
        """The row with the best *validation* score (ties: the shallower layer).

        Picking on the held-out score would be optimistic; the validation rows are part of
        the training split, so the held-out score of the pick stays an honest estimate.
        """
        return max(self.rows, key=lambda r: (r.val_score, -r.layer))

    # ------------------------------------------------------------------ export
    def to_dict(self) -> dict[str, Any]:
        """Everything but the weights: the settings, one dict per row (``ProbeRow.to_dict``)
        and ``test_predictions``, the best row's held-out outputs (``index``: positions in
        the inputs, ``labels``, ``predictions``, ``probabilities``)."""
        skip = ("rows", "source", "test_labels", "features")
        data = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        data["layers"] = self.layers
        data["poolings"] = self.poolings
        data["rows"] = [r.to_dict(self.metric) for r in self.rows]
        best = self.best()
        data["test_predictions"] = {
            "layer": best.layer,
            "pooling": best.pooling,
            "index": self.test_index if len(self.test_index) == len(self.test_labels) else None,
            "labels": self._named(self.test_labels),
            "predictions": self._named(best.predictions),
            "probabilities": best.probabilities,
        }
        return data

    def _named(self, values: list[Any]) -> list[Any]:
        """Class indices as the classes they stand for (values unchanged)."""
        if self.classes is None:
            return list(values)
        return [self.classes[i] for i in values]

    def to_json(self, path: str | PathLike | None = None) -> str:
        """The JSON text; also written to ``path`` when given."""
        text = json.dumps(_finite(self.to_dict()), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text

    def table(self) -> str:
        """A plain-text table: layer, score ± std, 95% interval, train score, control,
        selectivity and baseline."""
        m = self.metric
        extra = self._extra_columns()
        head = ["pooling", "layer", f"{m} ± std", "95% interval", *extra, f"train {m}"]
        if self.control:
            head += [f"control {m}", "selectivity"]
        head += ["baseline"]
        lines = [head]
        for r in self.rows:
            spread = f" ± {r.std:.3f}" if r.std is not None else ""
            cells = [r.pooling, str(r.layer), f"{r.score:.3f}{spread}"]
            cells += [f"[{r.ci95[0]:.3f}, {r.ci95[1]:.3f}]"]
            cells += [_cell(r.metrics.get(extra[k])) for k in extra]
            cells += [f"{r.train_score:.3f}"]
            if self.control:
                cells += [f"{r.control:.3f}", f"{r.selectivity:+.3f}"]
            cells += [f"{r.baseline:.3f}"]
            lines.append(cells)
        widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
        text = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines]
        text.insert(1, "  ".join("-" * w for w in widths))
        best = self.best()
        folds = self.settings.get("folds")
        if folds:
            how = f"mean over {folds} folds (folds)"
        else:
            splits = "validation split" if self.val_splits == 1 else "validation splits"
            how = f"mean over {self.val_splits} {splits} (val_splits)"
        text.append(
            f"best on validation ({how}): layer {best.layer} ({best.pooling}), held-out {m} "
            f"{best.score:.3f}; baseline {self.baseline:.3f} "
            f"({_baseline_name(m)}); each probe refitted "
            "on every training example"
        )
        if self.classes is not None:
            text.append(f"per class, layer {best.layer} ({best.pooling}):")
            text.append(self.class_table(best))
        return "\n".join(text)

    def _extra_columns(self) -> dict[str, str]:
        """{column: metrics key} shown beside the score: macro-F1, and AUROC for 2 classes."""
        if self.task == "pairwise":
            return {"mean margin": "mean_margin"}
        if self.classes is None:
            return {}
        columns = {"macro F1": "macro_f1"}
        if len(self.classes) == 2:
            columns["AUROC"] = "auroc"
        return columns

    def class_table(self, row: ProbeRow | None = None) -> str:
        """Per-class precision, recall, F1 and support of a row (default: the best), and
        its confusion matrix (rows: labels, columns: predictions)."""
        row = row or self.best()
        per = row.metrics.get("per_class", {})
        lines = [["class", "precision", "recall", "f1", "support"]]
        for name, m in per.items():
            cells = [f"{m['precision']:.3f}", f"{m['recall']:.3f}", f"{m['f1']:.3f}"]
            lines.append([name, *cells, str(m["support"])])
        widths = [max(len(r[i]) for r in lines) for i in range(5)]
        out = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines]
        matrix = row.metrics.get("confusion_matrix", [])
        out.append("confusion matrix (rows: labels, columns: predictions):")
        width = max([len(str(v)) for r in matrix for v in r] + [1])
        out += ["  " + " ".join(str(v).rjust(width) for v in r) for r in matrix]
        return "\n".join(out)

    # ------------------------------------------------------------------ deploy
    def to_headed(
        self,
        layer: int | None = None,
        pooling: str | None = None,
        *,
        model: Any = None,
        name: str = "probe",
    ) -> HeadedModel:
        """The probe of ``layer`` and ``pooling`` (default: ``best()``) as a ``HeadedModel``
        head: one Linear layer whose weights are the refitted probe's (standardisation folded
        in), reading the same layer and pooling, so its predictions on the held-out inputs
        are the probe's. ``model``: the backbone to attach it to (default: the sweep's own,
        loaded again from its path). Save it with ``save_pretrained``, export or serve it. A
        pairwise probe becomes a reward head (``loss_fct="bradley_terry"``, one output, bias 0)
        whose ``r(chosen) - r(rejected)`` is the probe's held-out margin."""
        import torch

        from ..config import HeadConfig

        row = (
            self.best()
            if layer is None and pooling is None
            else self.row(self.best().layer if layer is None else layer, pooling)
        )
        if row.weight is None or row.bias is None:
            raise ConfigError(
                f"the probe of layer {row.layer} ({row.pooling}) has no weights (a ProbeRow "
                "built by hand keeps none); run probe_layers to get a head"
            )
        fields_ = {"name": name, "layer_hook": row.layer, "num_outputs": row.weight.shape[0]}
        fields_["output_bias"] = True
        if self.task != "token":
            fields_.update(pred_for_sequence=True, pooling=row.pooling)
        if self.task == "pairwise":  # a reward head: r(chosen) - r(rejected) is the probe's
            fields_.update(loss_fct="bradley_terry")
        elif self.classes is None:
            fields_.update(is_regression=True, loss_fct="mse")
        else:
            fields_["extra"] = {"classes": _json_classes(self.classes)}
        cfg = HeadConfig(**fields_)
        headed = _attach(model if model is not None else self.source, cfg)
        linear = headed.heads[name].linears[0]
        with torch.no_grad():
            linear.weight.copy_(row.weight.to(linear.weight))
            linear.bias.copy_(row.bias.to(linear.bias))
        return headed.eval()

    def plot(
        self, path: str | PathLike | None = None, title: str | None = None, ax: Any = None
    ) -> Path | None:
        """Held-out score against layer: one line per pooling with 95% bootstrap error bars,
        the control task dashed (if run), the baseline dotted. Written as a PNG to ``path``;
        with ``ax`` (a matplotlib Axes) drawn there instead, e.g. one panel per model."""
        try:
            import matplotlib
        except ImportError:
            raise ConfigError(
                "plotting needs matplotlib: pip install matplotlib (or headkit[cli])"
            ) from None
        if ax is None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = None
        if ax is None:
            fig, ax = plt.subplots(figsize=(7, 4.5))
        colors = plt.get_cmap("tab10").colors
        for i, pooling in enumerate(self.poolings):
            rows = sorted((r for r in self.rows if r.pooling == pooling), key=lambda r: r.layer)
            xs = [r.layer for r in rows]
            ys = [r.score for r in rows]
            err = [[r.score - r.ci95[0] for r in rows], [r.ci95[1] - r.score for r in rows]]
            color = colors[i % len(colors)]
            ax.errorbar(
                xs, ys, yerr=err, fmt="o-", color=color, ms=3, lw=1.3, capsize=2, label=pooling
            )
            if self.control:
                ax.plot(
                    xs,
                    [r.control for r in rows],
                    "x--",
                    color=color,
                    lw=1,
                    ms=4,
                    label=f"{pooling}: control task",
                )
        ax.axhline(self.baseline, color="gray", ls=":", label="baseline")
        ax.set_xlabel("layer (hidden_states index, 0 = embeddings)")
        ax.set_ylabel(f"held-out {self.metric}\n(error bars: {ERROR_BARS})")
        if len(self.layers) <= 16:
            ax.set_xticks(self.layers)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(title or f"{self.task} probe per layer: {Path(self.model).name}", fontsize=10)
        if fig is None:
            return None
        fig.tight_layout()
        out = Path(path) if path is not None else Path("probe_results.png")
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=110)
        plt.close(fig)
        return out


def _baseline_name(metric: str) -> str:
    return {"accuracy": "majority class", "r2": "training mean"}.get(metric, "chance")


def _cell(value: Any) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3f}"


def _json_classes(classes: list[Any]) -> list[Any]:
    """Classes as JSON values (a checkpoint stores them): numbers and strings as they are."""
    return [c if isinstance(c, (str, int, float, bool)) else str(c) for c in classes]


def _attach(source: Any, cfg: Any) -> HeadedModel:
    """A HeadedModel with the head ``cfg`` on ``source``: a model object, or the sweep's
    (model, model_kwargs) — a path, hub id or ``packaged:`` name loaded with ``load_headed``
    (so a saved checkpoint references the backbone's folder)."""
    from ..backbone.sources import resolve_model
    from ..loading import load_headed
    from ..model.headed import HeadedModel

    if isinstance(source, tuple):
        model, kwargs = source
    else:
        model, kwargs = source, {}
    if isinstance(model, HeadedModel):
        model = model.backbone
    if isinstance(model, (str, PathLike)):
        path, kwargs = resolve_model(model, kwargs)
        return load_headed(path, head_configs=[cfg], **kwargs)
    if model is None:
        raise ConfigError("model=None: pass the backbone to attach the probe to (model=...)")
    return load_headed(model, head_configs=[cfg])


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
