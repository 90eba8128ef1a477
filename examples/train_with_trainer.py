"""Train two heads on the packaged all-MiniLM-L6-v2 with Hugging Face Trainer.

A sentiment head (fresh/rotten, real review snippets) and a toy regression head (the
snippet's length in words, standardised) share the frozen encoder; their losses combine with learned
uncertainty weights. ``HeadedTrainer`` logs each head's eval loss and metrics
(``eval_sentiment_accuracy``, ``eval_words_r2``, ...), checkpoints in headkit's format and
returns predictions by head. Under ``torchrun --nproc_per_node=N`` (or ``accelerate launch``)
the same script trains with DDP. Everything is local. Run:
``python examples/train_with_trainer.py`` (a few minutes on 2 CPU cores: every step runs the
encoder; with a frozen backbone and many epochs, ``headkit.features`` caches its outputs).
"""

from __future__ import annotations

import argparse
import tempfile

import numpy as np
from transformers import AutoTokenizer, TrainingArguments

from headkit import HeadConfig, HeadedModel, HeadedTrainer, HeadwiseMetrics, load_headed
from headkit.packaged import minilm_path, rotten_tomatoes, train_test_split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=480, help="rows of data used (of 12,808)")
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(minilm_path())
    train, test = train_test_split(rotten_tomatoes(limit=args.examples, seed=args.seed), 0.25)
    n_words = np.array([len(text.split()) for text, _ in train], dtype=np.float64)

    def encode(rows: list[tuple[str, int]]) -> list[dict]:
        enc = tok([text for text, _ in rows], truncation=True, max_length=64)
        return [
            {
                "input_ids": enc["input_ids"][i],
                "attention_mask": enc["attention_mask"][i],
                "sentiment": label,
                # standardised with the training split's mean and std
                "words": (len(text.split()) - n_words.mean()) / n_words.std(),
            }
            for i, (text, label) in enumerate(rows)
        ]

    heads = [
        HeadConfig("sentiment", num_outputs=2, pred_for_sequence=True, pooling="mean"),
        HeadConfig(
            "words",
            pred_for_sequence=True,
            pooling="mean",
            is_regression=True,
            loss_fct="mse",
            output_bias=True,
        ),
    ]
    model = load_headed(minilm_path(), head_configs=heads)  # frozen backbone, trainable heads
    model.set_loss_weighting("uncertainty")

    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out,
            num_train_epochs=args.epochs,
            per_device_train_batch_size=32,
            per_device_eval_batch_size=64,
            learning_rate=1e-2,
            eval_strategy="epoch",
            save_strategy="epoch",
            logging_steps=10,
            report_to=[],
            use_cpu=True,
            seed=args.seed,
            disable_tqdm=True,
        )
        trainer = HeadedTrainer(
            model=model,
            args=targs,
            train_dataset=encode(train),
            eval_dataset=encode(test),
            processing_class=tok,
            compute_metrics=HeadwiseMetrics(model),
        )
        trainer.train()
        pred = trainer.predict(encode(test))
        labels = pred.label_ids["sentiment"]
        majority = max(np.mean(labels == 0), np.mean(labels == 1))
        acc, r2 = pred.metrics["test_sentiment_accuracy"], pred.metrics["test_words_r2"]
        print(f"sentiment accuracy {acc:.3f} (majority class {majority:.3f}), words r2 {r2:.3f}")

        trainer.save_model(f"{out}/final")  # a headkit checkpoint: the backbone is referenced
        again = HeadedModel.from_pretrained(f"{out}/final")
        print("reloaded heads:", sorted(again.head_configs))


if __name__ == "__main__":
    main()
