"""Which pooling? A linear probe per (model, pooling strategy, layer) on rotten-tomatoes.

For the packaged all-MiniLM-L6-v2 encoder and SmolLM2-135M decoder, the frozen backbone runs
once per batch with every hidden layer kept; headkit's own pooling (one HeadedModel head per
layer, ``MLPHead.features``) pools each layer with every strategy. A logistic-regression
probe (standardised features, full-batch Adam, fixed seed) is trained per (model, strategy,
layer) on 80% of the training rows with each L2 in L2_GRID; the L2 with the best accuracy on
the other 20% is scored on held-out test rows. The learned "attention" pooling is trained
the same way on stored float16 token states together with its linear probe (one headkit
``MLPHead``), on every ``--attention-stride``-th layer and the last.

Writes docs/pooling_comparison.csv and docs/pooling_comparison.png. Everything is local.
Run: ``HF_HUB_OFFLINE=1 python examples/compare_pooling.py --threads 1`` (about 9 minutes on
2 busy CPU cores; ``--attention-epochs 0`` saves about 3). Results: docs/pooling.md.
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModel, AutoTokenizer

from headkit import HeadConfig, HeadedModel, MLPHead
from headkit.packaged import (
    SMOLLM2_GGUF,
    minilm_path,
    rotten_tomatoes,
    smollm2_path,
    train_test_split,
)

ROOT = Path(__file__).resolve().parent.parent
STATIC = ["first", "last", "mean", "max", "mean_sqrt_len", "weighted_mean"]  # no parameters
L2_GRID = (1e-3, 1e-2, 1e-1, 1.0)  # loss = mean BCE + l2 * |w|^2 on standardised features
VAL_FRACTION = 0.2


@dataclass
class ModelSpec:
    """One backbone of the comparison and its default sizes."""

    key: str
    title: str
    n_train: int
    n_test: int
    attention_stride: int


SPECS = {
    "minilm": ModelSpec("minilm", "all-MiniLM-L6-v2 (encoder, 6 layers)", 2000, 1000, 1),
    "smollm2": ModelSpec("smollm2", "SmolLM2-135M (decoder, 30 layers)", 1200, 600, 5),
}


def load_backbone(key: str) -> tuple[torch.nn.Module, AutoTokenizer]:
    """The packaged model (float32, eval mode) and its tokenizer."""
    if key == "minilm":
        path = str(minilm_path())
        return AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    path = str(smollm2_path())
    model = AutoModel.from_pretrained(path, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path, gguf_file=SMOLLM2_GGUF)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok


@dataclass
class Extracted:
    """Pooled features per strategy, (layers, texts, width), and raw token states."""

    pooled: dict[str, torch.Tensor]
    tokens: dict[int, list[torch.Tensor]]  # layer -> one (len_i, hidden) float16 per text


def extract(
    backbone: torch.nn.Module,
    tok: AutoTokenizer,
    texts: list[str],
    layers: list[int],
    attention_layers: list[int],
    max_length: int,
    batch_size: int,
) -> Extracted:
    """Run the frozen backbone once per batch and pool every layer with every strategy."""
    probe = HeadedModel(backbone, [])
    strategies = STATIC + (["pooler"] if probe.info.pooler is not None else [])
    heads = [
        HeadConfig(
            name=f"layer{layer}",
            layer_hook=layer,
            pred_for_sequence=True,
            pooling="+".join(strategies),
            loss_fct=None,
        )
        for layer in layers
    ]
    model = HeadedModel(backbone, heads).eval()
    widths = model.heads[f"layer{layers[0]}"].pooling.widths
    pooled = {s: torch.empty(len(layers), len(texts), w) for s, w in widths.items()}
    tokens: dict[int, list] = {layer: [None] * len(texts) for layer in attention_layers}
    lengths = [len(ids) for ids in tok(texts, truncation=True, max_length=max_length).input_ids]
    order = sorted(range(len(texts)), key=lambda i: lengths[i])  # less padding per batch
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            batch = tok(
                [texts[i] for i in idx],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
            mask = batch["attention_mask"]
            out = model(**batch, output_hidden_states=True)
            for li, layer in enumerate(layers):
                head = model.heads[f"layer{layer}"]
                states = out.hidden_states[layer]  # (batch, seq, hidden)
                parts = head.pooling.split(head.features(states, mask, model.info.pooler))
                for s, feats in parts.items():
                    pooled[s][li, idx] = feats
                if layer in tokens:
                    half = states.to(torch.float16)
                    if not bool(torch.isfinite(half[mask.bool()]).all()):
                        raise RuntimeError(f"layer {layer} overflows float16")
                    for row, i in enumerate(idx):
                        tokens[layer][i] = half[row][mask[row].bool()].clone()
    return Extracted(pooled, tokens)


# ---------------------------------------------------------------------- probes
def _standardise(fit: torch.Tensor, *others: torch.Tensor) -> list[torch.Tensor]:
    mu = fit.mean(-2, keepdim=True)
    sd = fit.std(-2, keepdim=True).clamp(min=1e-6)
    return [(x - mu) / sd for x in (fit, *others)]


def _train_logreg(
    x: torch.Tensor, y: torch.Tensor, l2: torch.Tensor, steps: int, lr: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent L2 logistic regressions on ``x`` (layers, N, D), one per ``l2`` (layers, K).

    Returns weights (layers, K, D) and biases (layers, K). The problems share nothing, so
    one Adam over all of them equals separate runs (Adam is per-parameter).
    """
    torch.manual_seed(seed)
    n_layers, _, d = x.shape
    k = l2.shape[1]
    w = torch.zeros(n_layers, k, d, requires_grad=True)
    b = torch.zeros(n_layers, k, requires_grad=True)
    opt = torch.optim.Adam([w, b], lr=lr)
    target = y.float()[None, :, None].expand(n_layers, -1, k)
    for _ in range(steps):
        opt.zero_grad()
        logits = torch.bmm(x, w.transpose(1, 2)) + b[:, None, :]  # (layers, N, K)
        loss = F.binary_cross_entropy_with_logits(logits, target, reduction="none").mean(1)
        (loss + l2 * (w * w).sum(-1)).sum().backward()
        opt.step()
    return w.detach(), b.detach()


def _accuracy(x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Accuracy (layers, K) of the probes ``w``, ``b`` on ``x`` (layers, N, D)."""
    logits = torch.bmm(x, w.transpose(1, 2)) + b[:, None, :]
    return ((logits > 0).long() == y[None, :, None]).float().mean(1)


def linear_probes(
    train: torch.Tensor,
    y_train: torch.Tensor,
    test: torch.Tensor,
    y_test: torch.Tensor,
    steps: int,
    lr: float,
    seed: int,
) -> tuple[list[float], list[float], list[float]]:
    """Probe every layer of ``train`` (layers, N, D): test accuracy, validation accuracy and
    chosen l2, per layer.

    Probes train on the first 1 - VAL_FRACTION of the training rows, one per l2 in L2_GRID;
    the one with the best accuracy on the remaining rows is scored on ``test``.
    """
    n_layers, n = train.shape[:2]
    n_fit = n - max(1, int(n * VAL_FRACTION))
    fit, val, held_out = _standardise(train[:, :n_fit], train[:, n_fit:], test)
    grid = torch.tensor(L2_GRID).expand(n_layers, -1)
    w, b = _train_logreg(fit, y_train[:n_fit], grid, steps, lr, seed)
    val_acc = _accuracy(val, y_train[n_fit:], w, b)  # (layers, K)
    # Best validation accuracy; ties go to the stronger penalty.
    best = (val_acc + torch.tensor(L2_GRID).log10() * 1e-6).argmax(1)
    test_acc = _accuracy(held_out, y_test, w, b)  # (layers, K)
    pick = best[:, None]
    return (
        test_acc.gather(1, pick)[:, 0].tolist(),
        val_acc.gather(1, pick)[:, 0].tolist(),
        [L2_GRID[i] for i in best],
    )


def _pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    states = pad_sequence(rows, batch_first=True)  # (batch, longest, hidden)
    lengths = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(states.shape[1])[None] < lengths[:, None]).long()
    return states, mask


def attention_probe(
    train: list[torch.Tensor],
    y_train: torch.Tensor,
    test: list[torch.Tensor],
    y_test: torch.Tensor,
    epochs: int,
    lr: float,
    seed: int,
    batch_size: int = 128,
) -> tuple[float, float, float]:
    """Learned attention pooling + linear probe in one headkit MLPHead: (test, val acc, l2).

    Token states (stored float16) are standardised per dimension with the fit rows' tokens;
    one head per l2 in L2_GRID trains on the same mini-batches (Adam), and the one with the
    best validation accuracy is scored on ``test``, as for the linear probes.
    """
    hidden = train[0].shape[-1]
    n_fit = len(train) - max(1, int(len(train) * VAL_FRACTION))
    tokens = torch.cat(train[:n_fit]).float()
    mu, sd = tokens.mean(0), tokens.std(0).clamp(min=1e-6)
    del tokens
    fit_rows = [(r.float() - mu) / sd for r in train[:n_fit]]
    y_fit = y_train[:n_fit].float()

    torch.manual_seed(seed)
    cfg = HeadConfig(
        name="attention_probe",
        in_size=hidden,
        num_outputs=1,
        pred_for_sequence=True,
        pooling="attention",
        output_bias=True,
        loss_fct="bce_with_logits",
    )
    heads = [MLPHead(cfg) for _ in L2_GRID]
    opt = torch.optim.Adam([p for h in heads for p in h.parameters()], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        perm = torch.randperm(n_fit, generator=gen).tolist()
        for start in range(0, n_fit, batch_size):
            idx = perm[start : start + batch_size]
            states, mask = _pad([fit_rows[i] for i in idx])
            opt.zero_grad()
            total = torch.zeros(())
            for head, l2 in zip(heads, L2_GRID):
                logits = head(states, mask)[:, 0]
                penalty = sum((p * p).sum() for n, p in head.named_parameters() if "weight" in n)
                total = (
                    total + F.binary_cross_entropy_with_logits(logits, y_fit[idx]) + l2 * penalty
                )
            total.backward()
            opt.step()

    @torch.no_grad()
    def acc(head: MLPHead, rows: list[torch.Tensor], y: torch.Tensor) -> float:
        states, mask = _pad([(r.float() - mu) / sd for r in rows])
        return float(((head(states, mask)[:, 0] > 0).long() == y).float().mean())

    val = [acc(h, train[n_fit:], y_train[n_fit:]) for h in heads]
    best = max(range(len(L2_GRID)), key=lambda i: (val[i], i))  # ties: stronger penalty
    return acc(heads[best], test, y_test), val[best], L2_GRID[best]


# ---------------------------------------------------------------------- report
def _resolve_layers(spec: str | None, n_layers: int) -> list[int]:
    total = n_layers + 1
    if not spec:
        return list(range(total))
    return sorted({int(s) % total for s in spec.split(",")})


def _row(model: str, strategy: str, layer: int, acc: float, val: float, l2: float) -> dict:
    return dict(model=model, strategy=strategy, layer=layer, accuracy=acc, val_accuracy=val, l2=l2)


def run_model(spec: ModelSpec, args: argparse.Namespace) -> tuple[list[dict], float]:
    """Probe one backbone; returns result rows and the majority-class test accuracy."""
    n_train = getattr(args, f"{spec.key}_train")
    n_test = getattr(args, f"{spec.key}_test")
    train_rows, test_rows = train_test_split(rotten_tomatoes(seed=args.seed), 0.2)
    train_rows, test_rows = train_rows[:n_train], test_rows[:n_test]
    y_train = torch.tensor([y for _, y in train_rows])
    y_test = torch.tensor([y for _, y in test_rows])
    majority = int(y_train.float().mean() >= 0.5)
    baseline = float((y_test == majority).float().mean())

    t0 = time.perf_counter()
    backbone, tok = load_backbone(spec.key)
    layers = _resolve_layers(args.layers, backbone.config.num_hidden_layers)
    stride = args.attention_stride or spec.attention_stride
    attn_layers = [x for x in layers if x % stride == 0 or x == layers[-1]]
    attn_layers = attn_layers if args.attention_epochs > 0 else []
    t1 = time.perf_counter()
    texts = [t for t, _ in train_rows] + [t for t, _ in test_rows]
    ext = extract(backbone, tok, texts, layers, attn_layers, args.max_length, args.batch_size)
    t2 = time.perf_counter()
    del backbone
    print(
        f"[{spec.key}] {n_train} train / {n_test} test texts; load {t1 - t0:.1f}s, "
        f"backbone + pooling {t2 - t1:.1f}s ({len(texts) / (t2 - t1):.1f} texts/s); "
        f"majority-class baseline {baseline:.3f}",
        flush=True,
    )
    results = []
    for strategy, feats in ext.pooled.items():
        accs, vals, l2s = linear_probes(
            feats[:, :n_train], y_train, feats[:, n_train:], y_test, args.steps, args.lr, args.seed
        )
        for layer, a, v, l2 in zip(layers, accs, vals, l2s):
            results.append(_row(spec.key, strategy, layer, a, v, l2))
    t3 = time.perf_counter()
    for layer in attn_layers:
        rows = ext.tokens[layer]
        a, v, l2 = attention_probe(
            rows[:n_train],
            y_train,
            rows[n_train:],
            y_test,
            args.attention_epochs,
            args.attention_lr,
            args.seed,
        )
        results.append(_row(spec.key, "attention", layer, a, v, l2))
    t4 = time.perf_counter()
    print(
        f"[{spec.key}] linear probes {t3 - t2:.1f}s, attention probes on layers "
        f"{attn_layers} {t4 - t3:.1f}s",
        flush=True,
    )
    return results, baseline


def summary_table(results: list[dict], baselines: dict[str, float]) -> str:
    """Markdown, per model and strategy: the layer with the best validation accuracy (ties:
    the shallower) and its test accuracy, the best test accuracy of any layer (optimistic:
    picked on the test rows), and the test accuracy at the last layer."""
    lines = [
        "| model | strategy | layer (picked on val) | test acc there | best test acc (layer) "
        "| test acc at last layer |",
        "|---|---|---|---|---|---|",
    ]
    for model in dict.fromkeys(r["model"] for r in results):
        rows = [r for r in results if r["model"] == model]
        last = max(r["layer"] for r in rows)
        ranked = []
        for s in dict.fromkeys(r["strategy"] for r in rows):
            mine = [r for r in rows if r["strategy"] == s]
            picked = max(mine, key=lambda r: (r["val_accuracy"], -r["layer"]))
            best = max(mine, key=lambda r: (r["accuracy"], -r["layer"]))
            at_last = next((r["accuracy"] for r in mine if r["layer"] == last), math.nan)
            ranked.append((picked["accuracy"], s, picked["layer"], best, at_last))
        for acc, s, layer, best, at_last in sorted(ranked, key=lambda t: -t[0]):
            lines.append(
                f"| {model} | {s} | {layer} | {acc:.3f} | {best['accuracy']:.3f} "
                f"({best['layer']}) | {at_last:.3f} |"
            )
        lines.append(f"| {model} | majority class | - | {baselines[model]:.3f} | - | - |")
    return "\n".join(lines)


def write_csv(results: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = ["model", "strategy", "layer", "accuracy", "val_accuracy", "l2"]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in results:
            writer.writerow(
                {
                    **r,
                    "accuracy": f"{r['accuracy']:.4f}",
                    "val_accuracy": f"{r['val_accuracy']:.4f}",
                    "l2": f"{r['l2']:g}",
                }
            )


def plot(results: list[dict], baselines: dict[str, float], path: Path) -> None:
    """Accuracy vs layer, one line per strategy, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in results))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.5), squeeze=False)
    colors = dict(zip(STATIC + ["pooler"], plt.get_cmap("tab10").colors))
    colors["attention"] = "black"
    for ax, model in zip(axes[0], models):
        rows = [r for r in results if r["model"] == model]
        for s in dict.fromkeys(r["strategy"] for r in rows):
            pts = sorted((r["layer"], r["accuracy"]) for r in rows if r["strategy"] == s)
            style = "o--" if s == "attention" else "o-"
            ax.plot(*zip(*pts), style, label=s, color=colors.get(s), markersize=3, lw=1.3)
        ax.axhline(baselines[model], color="gray", ls=":", label="majority class")
        ax.set_title(SPECS[model].title)
        ax.set_xlabel("layer (hidden_states index, 0 = embeddings)")
        ax.set_ylabel("held-out accuracy")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right", ncol=2)
    fig.suptitle("Linear probe on rotten-tomatoes: pooling strategy x layer", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=list(SPECS), default=list(SPECS))
    for spec in SPECS.values():
        ap.add_argument(f"--{spec.key}-train", type=int, default=spec.n_train)
        ap.add_argument(f"--{spec.key}-test", type=int, default=spec.n_test)
    ap.add_argument("--layers", help="comma-separated hidden_states indices (default: all)")
    ap.add_argument(
        "--attention-stride",
        type=int,
        default=0,
        help="learn attention pooling on every k-th layer and the last (0: per-model default "
        "1 for MiniLM, 5 for SmolLM2)",
    )
    ap.add_argument("--attention-epochs", type=int, default=10, help="0 skips attention")
    ap.add_argument("--attention-lr", type=float, default=1e-2)
    ap.add_argument("--steps", type=int, default=100, help="full-batch Adam steps per probe")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--csv", type=Path, default=ROOT / "docs" / "pooling_comparison.csv")
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "pooling_comparison.png")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the comparison; write the CSV and the plot; return the result rows."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start = time.perf_counter()
    results: list[dict] = []
    baselines: dict[str, float] = {}
    for key in args.models:
        rows, baselines[key] = run_model(SPECS[key], args)
        results.extend(rows)
    write_csv(results, args.csv)
    plot(results, baselines, args.png)
    print(summary_table(results, baselines))
    print(f"wrote {args.csv} and {args.png} in {time.perf_counter() - start:.0f}s", flush=True)
    return results


if __name__ == "__main__":
    main()
