"""What a layer sweep returns: one row per (pooling, layer), as a table, JSON or a plot."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from os import PathLike
from pathlib import Path
from typing import Any

from ..errors import ConfigError

#: What the plot's error bars are, as the plot says it.
ERROR_BARS = "95% bootstrap interval over held-out rows"


@dataclass
class ProbeRow:
    """One probe's held-out score and what to compare it with.

    ``score`` is the held-out metric averaged over validation splits (``accuracy`` or ``r2`` in
    JSON), ``std`` its standard deviation over them (None for one split), ``ci95`` a 95%
    bootstrap interval of ``score`` over held-out rows. ``control`` / ``selectivity`` are None
    unless the sweep ran a control task; ``l2`` is the penalty chosen on validation, per split.
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
        }
        if self.control is not None:
            out[f"control_{metric}"] = self.control
            out[f"control_train_{metric}"] = self.control_train
            out["control_std"] = self.control_std
            out["selectivity"] = self.selectivity
        return out


@dataclass
class ProbeResults:
    """Results of ``probe_layers``: rows by pooling then layer, and how they were obtained.

    ``metric`` is "accuracy" (classification, token) or "r2" (regression); ``baseline`` the
    held-out score of the majority class (or of the training mean for r2); ``test_index``
    the positions (in the input order) of the held-out examples (in ``test_inputs`` when a
    test split was given).
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
        data = {k: v for k, v in asdict(self).items() if k != "rows"}
        data["layers"] = self.layers
        data["poolings"] = self.poolings
        data["rows"] = [r.to_dict(self.metric) for r in self.rows]
        return data

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
        head = ["pooling", "layer", f"{m} ± std", "95% interval", f"train {m}"]
        if self.control:
            head += [f"control {m}", "selectivity"]
        head += ["baseline"]
        lines = [head]
        for r in self.rows:
            spread = f" ± {r.std:.3f}" if r.std is not None else ""
            cells = [r.pooling, str(r.layer), f"{r.score:.3f}{spread}"]
            cells += [f"[{r.ci95[0]:.3f}, {r.ci95[1]:.3f}]", f"{r.train_score:.3f}"]
            if self.control:
                cells += [f"{r.control:.3f}", f"{r.selectivity:+.3f}"]
            cells += [f"{r.baseline:.3f}"]
            lines.append(cells)
        widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
        text = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines]
        text.insert(1, "  ".join("-" * w for w in widths))
        best = self.best()
        splits = "validation split" if self.val_splits == 1 else "validation splits"
        text.append(
            f"best on validation: layer {best.layer} ({best.pooling}), held-out {m} "
            f"{best.score:.3f}; baseline {self.baseline:.3f} "
            f"({'majority class' if m == 'accuracy' else 'training mean'}); "
            f"scores averaged over {self.val_splits} {splits} (val_splits)"
        )
        return "\n".join(text)

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


def _finite(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
