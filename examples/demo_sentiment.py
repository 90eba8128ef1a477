"""Demo: train sentiment heads on the packaged all-MiniLM-L6-v2 with real review snippets.

The backbone stays frozen, so its features are computed once (``cache_features``) and the
heads train on them for many epochs; then the held-out accuracy of each head is printed next
to the majority-class baseline. Everything is local: the model and the rotten-tomatoes data
ship as PyPI packages. Run: ``HF_HUB_OFFLINE=1 python examples/demo_sentiment.py`` (about a
minute on 2 CPU cores). The same with the command line, plus a layer sweep: ``headkit demo``
(what ``make demo`` runs).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import AutoTokenizer

from headkit import HeadConfig, HeadedModel, load_headed
from headkit.features import cache_features, predict_on_features, train_heads_on_features
from headkit.packaged import minilm_path, rotten_tomatoes, train_test_split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=2400, help="rows of data used (of 12,808)")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    train, test = train_test_split(rotten_tomatoes(limit=args.examples, seed=args.seed), 0.25)
    path = minilm_path()
    tok = AutoTokenizer.from_pretrained(path)
    heads = [
        HeadConfig(
            "sentiment_mean",
            num_outputs=2,
            pred_for_sequence=True,
            pooling="mean",
            target="sentiment",
        ),
        HeadConfig(
            "sentiment_cls",
            num_outputs=2,
            pred_for_sequence=True,
            pooling="cls",
            target="sentiment",
        ),
        HeadConfig(
            "sentiment_mlp_l4",
            layer_hook=4,
            num_outputs=2,
            pred_for_sequence=True,
            pooling="mean+max",
            num_layers=2,
            hidden_size=128,
            dropout=0.1,
            target="sentiment",
        ),
    ]
    model = load_headed(path, head_configs=heads)  # backbone frozen, heads trainable

    def collate(rows):
        batch = tok(
            [t for t, _ in rows], padding=True, truncation=True, max_length=64, return_tensors="pt"
        )
        batch["sentiment"] = torch.tensor([y for _, y in rows])
        return dict(batch)

    print(f"data: {len(train)} train / {len(test)} held-out review snippets (rotten tomatoes)")
    feats_train = cache_features(model, train, batch_size=64, collate_fn=collate)
    feats_test = cache_features(model, test, batch_size=64, collate_fn=collate)
    losses = train_heads_on_features(
        model, feats_train, epochs=args.epochs, batch_size=64, lr=2e-3, seed=args.seed
    )
    print(
        f"training loss (sum of 3 heads): epoch 1 {losses[0]:.3f} "
        f"-> epoch {len(losses)} {losses[-1]:.3f}"
    )

    labels = feats_test.labels["sentiment"]
    majority = int(torch.tensor([y for _, y in train]).float().mean() >= 0.5)
    baseline = float((labels == majority).float().mean())
    preds = predict_on_features(model, feats_test)
    print(f"\nheld-out accuracy ({len(test)} snippets)")
    print(f"  {'majority-class baseline':<28} {baseline:.3f}")
    for name, p in preds.items():
        acc = float((p.argmax(-1) == labels).float().mean())
        print(f"  {name:<28} {acc:.3f}")

    # a checkpoint holds only the heads (the frozen backbone is referenced) and reloads exactly
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        again = HeadedModel.from_pretrained(d).eval()
        batch = collate(test[:8])
        a = model.eval()(**{k: v for k, v in batch.items() if k != "sentiment"})
        b = again(**{k: v for k, v in batch.items() if k != "sentiment"})
        same = all(torch.equal(a.preds_by_head[k], b.preds_by_head[k]) for k in a.preds_by_head)
        print(f"\ncheckpoint reloads with identical predictions: {same}")
    print(f"total time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
