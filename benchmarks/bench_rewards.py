"""Reward models with headkit next to TRL: held-out accuracy and train step time. (issue 32)

Two tasks, each trained twice from identical weights (the TRL model's backbone and score
Linear copied into a HeadedModel), with the same data, order, optimizer and budget; TRL's
``RewardConfig`` / ``PRMConfig`` are the ``args`` of both trainers (so dropout is off in both,
as TRL does):

  orm  ``RewardTrainer`` on ``BertForSequenceClassification(num_labels=1)`` against
       ``HeadedTrainer`` with one ``bradley_terry`` head (BERT's pooler + a Linear with bias)
       on preference pairs made from the packaged rotten-tomatoes snippets: chosen = a fresh
       (positive) review, rejected = a rotten one. Figure: held-out pairwise accuracy.
  prm  ``PRMTrainer`` (trl.experimental) on ``BertForTokenClassification(num_labels=2)``
       against ``HeadedTrainer`` with a token head (2 classes, a Linear with bias) on
       generated arithmetic chains with planted wrong steps ("7 + 5 = 13"), TRL's stepwise
       format, step separator "[SEP]" (BERT's tokenizer drops "\\n"). Figure: held-out step
       accuracy (argmax at each step's end, TRL's ``compute_accuracy``).

The model is the packaged all-MiniLM-L6-v2 (6 layers, hidden 384), fine-tuned whole. The
train step (``Trainer.training_step``: forward, loss, backward, on one batch both trainers'
collators made) is timed with ``_harness.measure``: the two sides alternated step by step
after warm-up, median of each, rerun when other processes used more than 0.2 cores; the
ratio of the CPU time of the two sides is reported too (steadier than wall time when other
processes load the machine). Goals: headkit − TRL accuracy >= -0.02, headkit / TRL step time
<= 1.0.

Run (writes benchmarks/results/rewards.json; ``--quick``: a random 2-layer BERT with the
MiniLM tokenizer, a few pairs and steps, a smoke test):
  HF_HUB_OFFLINE=1 PYTHONPATH=. python benchmarks/bench_rewards.py
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import tempfile
from pathlib import Path

from _harness import Goal, add_measure_args, ensure_bench_env, settings_of
from _report import bench_result, figure, publish

HERE = Path(__file__).resolve().parent
NAME = "rewards"
ACCURACY_GOAL = Goal(">=", -0.02)
SPEED_GOAL = Goal("<=", 1.0)
SEPARATOR = "[SEP]"
#: (train examples, held-out examples, train steps, batch) per run kind
SIZES = {True: (32, 32, 4, 4), False: (512, 400, 64, 8)}


# ---------------------------------------------------------------------- data
def preference_pairs(n_train: int, n_test: int, seed: int = 0):
    """Chosen = a fresh review, rejected = a rotten one (disjoint train and test)."""
    from datasets import Dataset

    from headkit.packaged import rotten_tomatoes

    rows = rotten_tomatoes(seed=seed)
    fresh = [t for t, y in rows if y == 1]
    rotten = [t for t, y in rows if y == 0]
    pairs = [{"chosen": c, "rejected": r} for c, r in zip(fresh, rotten)]
    n = n_train + n_test
    return Dataset.from_list(pairs[:n_train]), Dataset.from_list(pairs[n_train:n])


def arithmetic_chains(n: int, seed: int):
    """Stepwise supervision: chains of 3-4 additions/subtractions carrying the result on;
    about a third of the steps have a wrong result (off by 1-3), labelled False."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        value = rng.randint(1, 20)
        steps, labels = [], []
        for _ in range(rng.randint(3, 4)):
            other = rng.randint(1, 9)
            op = rng.choice("+-")
            right = value + other if op == "+" else value - other
            ok = rng.random() > 0.35
            shown = right if ok else right + rng.choice([-3, -2, -1, 1, 2, 3])
            steps.append(f"{value} {op} {other} = {shown}")
            labels.append(ok)
            value = shown
        rows.append({"prompt": "Compute step by step.", "completions": steps, "labels": labels})
    return Dataset.from_list(rows)


# ---------------------------------------------------------------------- models
def _bases(quick: bool):
    """(tokenizer, a function that builds the TRL model for ``auto``, num_labels)."""
    from transformers import AutoTokenizer, BertConfig

    from headkit.packaged import minilm_path

    tok = AutoTokenizer.from_pretrained(minilm_path())
    tok.eos_token = SEPARATOR  # TRL's RewardTrainer appends the eos; BERT's tokenizer has none

    def build(auto, num_labels: int):
        import torch

        torch.manual_seed(0)
        if quick:
            config = BertConfig(
                vocab_size=tok.vocab_size,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                num_labels=num_labels,
            )
            return auto.from_config(config)
        return auto.from_pretrained(minilm_path(), num_labels=num_labels)

    return tok, build


def twins(task: str, build):
    """The TRL model and a HeadedModel with the same weights."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    from headkit import HeadConfig, HeadedModel

    if task == "orm":
        ref = build(AutoModelForSequenceClassification, 1)
        head = HeadConfig(
            "reward",
            pred_for_sequence=True,
            loss_fct="bradley_terry",
            pooling="pooler",
            output_bias=True,
        )
    else:
        ref = build(AutoModelForTokenClassification, 2)
        head = HeadConfig("prm", num_outputs=2, output_bias=True)
    ours = HeadedModel(copy.deepcopy(ref.bert), [head], freeze_base_model=False)
    with torch.no_grad():
        linear = ours.heads[head.name].output_projection()
        linear.weight.copy_(ref.classifier.weight)
        linear.bias.copy_(ref.classifier.bias)
    return ref, ours


# ---------------------------------------------------------------------- one task
def run_task(task: str, st, tok, build, out_dir: str) -> dict:
    import torch
    from trl import RewardConfig, RewardTrainer
    from trl.experimental.prm import PRMConfig, PRMTrainer

    from headkit import HeadedTrainer
    from headkit.metrics import HeadwiseMetrics

    n_train, n_test, steps, batch = SIZES[st.quick]
    if task == "orm":
        train, test = preference_pairs(n_train, n_test)
        config_cls, trainer_cls, extra = RewardConfig, RewardTrainer, {}
    else:
        train, test = arithmetic_chains(n_train, 0), arithmetic_chains(n_test, 1)
        config_cls, trainer_cls, extra = PRMConfig, PRMTrainer, {"step_separator": SEPARATOR}
    ref, ours = twins(task, build)
    args = dict(
        output_dir=out_dir,
        per_device_train_batch_size=batch,
        per_device_eval_batch_size=32,
        max_steps=steps,
        learning_rate=5e-5 if not st.quick else 1e-3,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=True,
        disable_tqdm=True,
        logging_strategy="no",
        **extra,
    )
    theirs_t = trainer_cls(
        ref, config_cls(**args), train_dataset=train, eval_dataset=test, processing_class=tok
    )
    ours_t = HeadedTrainer(
        ours,
        config_cls(**args),
        train_dataset=train,
        eval_dataset=test,
        processing_class=tok,
        compute_metrics=HeadwiseMetrics(ours),
    )
    # one batch each (the same ids: both collators batch TRL's way), timed train steps
    hb = next(iter(ours_t.get_train_dataloader()))
    rb = next(iter(theirs_t.get_train_dataloader()))
    same_batch = bool(torch.equal(hb["input_ids"], rb["input_ids"]))
    ref.train()
    ours.train()
    for t in (ours_t, theirs_t):  # what Trainer's loop sets before its first training_step
        t.current_gradient_accumulation_steps = 1

    def step(trainer, model, inputs):
        def fn():
            model.zero_grad(set_to_none=True)
            return trainer.training_step(model, dict(inputs))

        return fn

    first_loss = (float(step(ours_t, ours, hb)()), float(step(theirs_t, ref, rb)()))
    timing = st.measure({"headkit": step(ours_t, ours, hb), "trl": step(theirs_t, ref, rb)})
    ours.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)
    ours_t.train()
    theirs_t.train()
    mine, theirs = ours_t.evaluate(), theirs_t.evaluate()
    key = "eval_reward_pairwise_accuracy" if task == "orm" else "eval_prm_accuracy"
    return {
        "accuracy": {"headkit": mine[key], "trl": theirs["eval_accuracy"]},
        "accuracy_diff": mine[key] - theirs["eval_accuracy"],
        "step_ratio": timing.ratio("headkit", "trl"),
        "step_cpu_ratio": timing.cpu_ratio("headkit", "trl"),
        "first_step_loss": {"headkit": first_loss[0], "trl": first_loss[1]},
        "same_first_batch": same_batch,
        "rows_per_batch": int(hb["input_ids"].shape[0]),
        "train_examples": len(train),
        "held_out_examples": len(test),
        "train_steps": steps,
        "timing": timing.summary(),
    }


def main(argv: list[str] | None = None) -> dict:
    """Measure; return (and write to --out) the result with its figures."""
    import torch

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_measure_args(ap)
    ap.add_argument("--out", type=Path, default=HERE / "results" / f"{NAME}.json")
    args = ap.parse_args(argv)
    st = settings_of(args)
    torch.set_num_threads(st.threads)
    tok, build = _bases(st.quick)
    details = {}
    with tempfile.TemporaryDirectory(prefix="bench-rewards-") as tmp:
        for task in ("orm", "prm"):
            details[task] = run_task(task, st, tok, build, tmp)
    figures = []
    for task, r in details.items():
        what = "pairwise" if task == "orm" else "step"
        figures += [
            figure(f"{task}: headkit held-out {what} accuracy", r["accuracy"]["headkit"], "acc"),
            figure(f"{task}: TRL held-out {what} accuracy", r["accuracy"]["trl"], "acc"),
            figure(f"{task}: headkit - TRL accuracy", r["accuracy_diff"], "acc", ACCURACY_GOAL),
            figure(f"{task}: headkit / TRL train step", r["step_ratio"], "ratio", SPEED_GOAL),
            figure(f"{task}: headkit / TRL train step, CPU time", r["step_cpu_ratio"], "ratio"),
        ]
    n_train, n_test, steps, batch = SIZES[st.quick]
    settings = {
        **st.as_dict(),
        "model": "random BERT, 2 layers, hidden 32" if st.quick else "packaged all-MiniLM-L6-v2",
        "train_examples": n_train,
        "held_out_examples": n_test,
        "train_steps": steps,
        "batch_examples": batch,
        "trainers": "HeadedTrainer vs trl RewardTrainer / experimental PRMTrainer, TRL configs",
    }
    result = bench_result(NAME, figures, settings, details, threads=st.threads)
    return publish(result, args.out)


if __name__ == "__main__":
    ensure_bench_env()
    main()
