"""What do probe sweeps and early exit cost on vision and speech models?

Setting: random models built from configs, 2 threads, one process:
  ViT       12 layers, hidden 256, 4 heads, 64x64 images in 8x8 patches (65 positions),
            512 random images with a weak planted colour label (not separable: the probes
            converge as on real data), processed by ViT's image processor (its PIL backend)
  wav2vec2  wav2vec2-base's sizes (12 layers, hidden 768, 12 heads, its feature encoder of 7
            convolutions of 512 channels, 320 samples a frame), layer-norm features, 1-second
            clips at 16 kHz

Figures, each a ratio of medians timed by the suite's harness (``_harness``: warm-up, the
sides alternated A B, B A, ..., rerun when other processes loaded the machine):
  sweep ÷ forward  ``probe_layers(vit, images, labels)`` with its defaults (every hidden
                   state, mean pooling, L2 chosen on a validation split, a bootstrap
                   interval; the images preprocessed by the model's processor) ÷ the
                   processor and one plain forward pass of the ViT over the same images, in
                   the same batches (goal <= 1.2); ``--repeats`` timed pairs
  early exit       forward (eval, no grad) of a HeadedModel with a sequence probe on layer 2 ÷
                   the same probe on the last layer, for the ViT (a batch of 32 images) and
                   wav2vec2 (a batch of 4 clips), 10 timed steps each (goal <= 0.25: the
                   blocks after layer 2 never run; what runs before the blocks, such as
                   wav2vec2's convolutions, does: the feature encoder alone ÷ the last-layer
                   probe is reported beside it, the floor of any probe)

Run (writes benchmarks/results/modalities.json; ``--quick``: tiny sizes, a smoke test):
  HF_HUB_OFFLINE=1 python benchmarks/bench_modalities.py
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from _harness import Goal, add_measure_args, ensure_bench_env, settings_of
from _report import bench_result, figure, publish
from PIL import Image
from transformers import ViTConfig, ViTImageProcessorPil, ViTModel, Wav2Vec2Config, Wav2Vec2Model

from headkit import HeadConfig, HeadedModel, probe_layers

HERE = Path(__file__).resolve().parent
NAME = "modalities"
SWEEP_GOAL = Goal("<=", 1.2)
EXIT_GOAL = Goal("<=", 0.25)


@dataclass(frozen=True)
class Shape:
    layers: int = 12
    hidden: int = 256
    image: int = 64
    patch: int = 8
    images: int = 512
    batch: int = 32
    seconds: float = 1.0
    clips: int = 4
    speech_hidden: int = 768
    conv: tuple[int, ...] = (512,) * 7
    stride: tuple[int, ...] = (5, 2, 2, 2, 2, 2, 2)
    kernel: tuple[int, ...] = (10, 3, 3, 3, 3, 2, 2)


QUICK = Shape(
    layers=3,
    hidden=32,
    image=32,
    images=24,
    batch=8,
    seconds=0.1,
    clips=2,
    speech_hidden=32,
    conv=(16, 16),
    stride=(5, 2),
    kernel=(10, 3),
)


def vit(s: Shape) -> ViTModel:
    torch.manual_seed(0)
    cfg = ViTConfig(
        num_hidden_layers=s.layers,
        hidden_size=s.hidden,
        num_attention_heads=max(1, s.hidden // 64),
        intermediate_size=4 * s.hidden,
        image_size=s.image,
        patch_size=s.patch,
    )
    return ViTModel(cfg, add_pooling_layer=False).eval()


def wav2vec2(s: Shape) -> Wav2Vec2Model:
    torch.manual_seed(0)
    cfg = Wav2Vec2Config(
        num_hidden_layers=s.layers,
        hidden_size=s.speech_hidden,
        num_attention_heads=max(1, s.speech_hidden // 64),
        intermediate_size=4 * s.speech_hidden,
        conv_dim=s.conv,
        conv_stride=s.stride,
        conv_kernel=s.kernel,
        feat_extract_norm="layer",
        do_stable_layer_norm=True,
    )
    return Wav2Vec2Model(cfg).eval()


def planted_images(s: Shape) -> tuple[list[Image.Image], list[int]]:
    """Noisy images, a little redder (0) or a little bluer (1)."""
    rng = np.random.default_rng(0)
    images, labels = [], []
    for i in range(s.images):
        pixels = rng.integers(0, 236, (s.image + 8, s.image + 8, 3))
        pixels[..., 2 if i % 2 else 0] += rng.integers(0, 20)
        images.append(Image.fromarray(pixels.astype(np.uint8)))
        labels.append(i % 2)
    return images, labels


def early_exit_sides(backbone, batch: dict) -> dict:
    """Forward of a sequence probe on layer 2 and one on the last layer, no grad."""
    sides = {}
    for name, layer in (("layer2", 2), ("last", -1)):
        head = HeadConfig("probe", layer_hook=layer, pred_for_sequence=True, pooling="mean")
        model = HeadedModel(backbone, [head]).eval()

        def run(model=model):
            with torch.inference_mode():
                return model(**batch)

        sides[name] = run
    return sides


def main(argv: list[str] | None = None) -> dict:
    """Measure; return (and write to --out) the result with its figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_measure_args(ap)
    ap.add_argument("--out", type=Path, default=HERE / "results" / f"{NAME}.json")
    ap.add_argument("--repeats", type=int, default=None, help="timed sweeps (3; quick 2)")
    args = ap.parse_args(argv)
    st = settings_of(args)
    shape = QUICK if st.quick else Shape()
    repeats = args.repeats or (2 if st.quick else 3)
    torch.set_num_threads(st.threads)
    model = vit(shape)
    processor = ViTImageProcessorPil(size={"height": shape.image, "width": shape.image})
    images, labels = planted_images(shape)

    def sweep():
        return probe_layers(model, images, labels, processor=processor, progress=False)

    def forward():
        with torch.inference_mode():
            for i in range(0, len(images), shape.batch):
                pixels = processor(images=images[i : i + shape.batch], return_tensors="pt")
                model(**pixels)

    check = sweep()
    t_sweep = st.measure(
        {"sweep": sweep, "forward": forward}, warmup=0 if st.quick else 1, steps=repeats
    )
    g = torch.Generator().manual_seed(1)
    pixels = {"pixel_values": torch.randn(shape.batch, 3, shape.image, shape.image, generator=g)}
    steps = None if st.quick else 10
    t_vit = st.measure(early_exit_sides(model, pixels), steps=steps)
    samples = int(shape.seconds * 16_000)
    audio = {"input_values": torch.randn(shape.clips, samples, generator=g)}
    speech = wav2vec2(shape)
    sides = early_exit_sides(speech, audio)

    def feature_encoder():  # what runs before the blocks, whatever the probe
        with torch.inference_mode():
            return speech.feature_projection(speech.feature_extractor(**audio).transpose(1, 2))

    t_w2v = st.measure({**sides, "encoder": feature_encoder}, steps=steps)
    figures = [
        figure(
            "ViT probe sweep (every layer) ÷ one forward pass",
            t_sweep.ratio("sweep", "forward"),
            "ratio",
            SWEEP_GOAL,
        ),
        figure(
            "ViT forward, probe on layer 2 ÷ probe on the last layer",
            t_vit.ratio("layer2", "last"),
            "ratio",
            EXIT_GOAL,
        ),
        figure(
            "wav2vec2 forward, probe on layer 2 ÷ probe on the last layer",
            t_w2v.ratio("layer2", "last"),
            "ratio",
            EXIT_GOAL,
        ),
        figure(
            "wav2vec2 forward, its feature encoder alone ÷ probe on the last layer",
            t_w2v.ratio("encoder", "last"),
            "ratio",
        ),
        figure(
            "ViT probe sweep, CPU time ÷ one forward pass",
            t_sweep.cpu_ratio("sweep", "forward"),
            "ratio",
        ),
    ]
    details = {
        "sweep": {**t_sweep.summary(), "loads": t_sweep.loads, "timings": check.timings},
        "sweep_best": {"layer": check.best().layer, "score": check.best().score},
        "vit_early_exit": {**t_vit.summary(), "loads": t_vit.loads},
        "wav2vec2_early_exit": {**t_w2v.summary(), "loads": t_w2v.loads},
    }
    setting = {**st.as_dict(), "model": asdict(shape), "repeats": repeats}
    result = bench_result(NAME, figures, setting, details, threads=st.threads)
    return publish(result, args.out)


if __name__ == "__main__":
    ensure_bench_env()
    main()
