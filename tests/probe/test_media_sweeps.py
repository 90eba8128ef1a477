"""Probe sweeps over images and audio: probe_layers and ``headkit probe --image-column /
--audio-column`` read PIL images, arrays, PNG and WAV files (written here) and datasets
columns through the model folder's own processor."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import build_tiny
from tiny_media import (
    image_processor,
    planted_audio,
    planted_images,
    speech_feature_extractor,
    write_png,
    write_wav,
)

from headkit import CheckpointError, ConfigError, probe_layers
from headkit.cli.datafiles import write_rows
from headkit.cli.main import main
from headkit.data.media import input_kind, read_audio

pytestmark = pytest.mark.usefixtures("single_thread")

FAST = {"bootstrap": 50, "progress": False, "layers": "0,2,-1"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny ViT with its image processor and a tiny wav2vec2 with its feature extractor,
    each saved as a model folder."""
    root = tmp_path_factory.mktemp("models")
    build_tiny("vit", 3).save_pretrained(root / "vit")
    image_processor().save_pretrained(root / "vit")
    build_tiny("wav2vec2", 3).save_pretrained(root / "wav2vec2")
    speech_feature_extractor().save_pretrained(root / "wav2vec2")
    return {"vit": root / "vit", "wav2vec2": root / "wav2vec2"}


def test_an_image_sweep_from_pil_images_or_png_files(folders, tmp_path) -> None:
    images, colours = planted_images(24)
    results = probe_layers(folders["vit"], images, colours, **FAST)
    assert [r.layer for r in results.rows] == [0, 2, 3]
    assert max(r.score for r in results.rows) > results.baseline  # red vs blue is learnt
    paths = [write_png(tmp_path / f"{i}.png", im) for i, im in enumerate(images)]
    from_files = probe_layers(str(folders["vit"]), [str(p) for p in paths], colours, **FAST)
    assert [r.score for r in from_files.rows] == [r.score for r in results.rows]


def test_an_audio_sweep_from_arrays_or_wav_files(folders, tmp_path) -> None:
    clips, tones = planted_audio(24)
    results = probe_layers(folders["wav2vec2"], clips, tones, **FAST)
    assert max(r.score for r in results.rows) > results.baseline  # low vs high tone is learnt
    paths = [write_wav(tmp_path / f"{i}.wav", c) for i, c in enumerate(clips)]
    from_files = probe_layers(folders["wav2vec2"], paths, tones, **FAST)
    assert from_files.n_test == results.n_test
    assert max(r.score for r in from_files.rows) > from_files.baseline


def test_the_command_line_probes_an_image_column_and_an_audio_column(folders, tmp_path) -> None:
    images, colours = planted_images(20)
    for i, im in enumerate(images):
        write_png(tmp_path / f"im{i}.png", im)
    rows = [{"path": f"im{i}.png", "colour": c} for i, c in enumerate(colours)]  # relative paths
    write_rows(tmp_path / "images.csv", rows)
    out = tmp_path / "vit-probe"
    args = ["--model", str(folders["vit"]), "--data", str(tmp_path / "images.csv")]
    args += ["--image-column", "path", "--label-column", "colour", "--val-splits", "1"]
    assert main(["probe", *args, "--quiet", "--output", str(out)]) == 0
    assert len(json.loads((out / "probe_results.json").read_text())["rows"]) == 4

    clips, tones = planted_audio(20)
    rows = [
        {"wav": str(write_wav(tmp_path / f"a{i}.wav", c)), "tone": t}
        for i, (c, t) in enumerate(zip(clips, tones))
    ]
    write_rows(tmp_path / "clips.jsonl", rows)
    out = tmp_path / "w2v-probe"
    args = ["--model", str(folders["wav2vec2"]), "--data", str(tmp_path / "clips.jsonl")]
    args += ["--audio-column", "wav", "--label-column", "tone", "--layers", "1"]
    assert main(["probe", *args, "--val-splits", "1", "--quiet", "--output", str(out)]) == 0
    assert json.loads((out / "probe_results.json").read_text())["rows"][0]["layer"] == 1


def test_the_command_line_reads_datasets_image_and_audio_columns(folders, tmp_path) -> None:
    datasets = pytest.importorskip("datasets")
    images, colours = planted_images(20)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    data = datasets.Dataset.from_dict({"image": images, "label": colours}, features=features)
    data.save_to_disk(tmp_path / "images")
    args = ["--model", str(folders["vit"]), "--data", str(tmp_path / "images"), "--quiet"]
    args += ["--image-column", "image", "--layers", "0", "--output", str(tmp_path / "a")]
    assert main(["probe", *args, "--val-splits", "1"]) == 0

    clips, tones = planted_audio(20)
    paths = [str(write_wav(tmp_path / f"{i}.wav", c)) for i, c in enumerate(clips)]
    audio = datasets.Dataset.from_dict({"audio": paths, "label": tones})
    audio.cast_column("audio", datasets.Audio(sampling_rate=16_000)).save_to_disk(tmp_path / "au")
    args = ["--model", str(folders["wav2vec2"]), "--data", str(tmp_path / "au"), "--quiet"]
    args += ["--audio-column", "audio", "--layers", "0", "--output", str(tmp_path / "b")]
    assert main(["probe", *args, "--val-splits", "1"]) == 0


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_wav_files_of_any_pcm_width_read_with_the_standard_library(tmp_path, width) -> None:
    import wave

    rng = np.random.default_rng(0)
    left = rng.uniform(-0.5, 0.5, 500)
    stereo = np.stack([left, left], 1)  # two equal channels: their mean is the signal
    scale = 2 ** (8 * width - 1) - 1
    ints = np.round(stereo * scale).astype({1: np.int16, 2: "<i2", 3: "<i4", 4: "<i4"}[width])
    if width == 1:
        raw = (ints + 128).astype(np.uint8).tobytes()
    elif width == 3:
        raw = b"".join(int(v).to_bytes(3, "little", signed=True) for v in ints.ravel())
    else:
        raw = ints.tobytes()
    with wave.open(str(tmp_path / "x.wav"), "wb") as f:
        f.setnchannels(2)
        f.setsampwidth(width)
        f.setframerate(8_000)
        f.writeframes(raw)
    samples, rate = read_audio(tmp_path / "x.wav")
    assert rate == 8_000 and samples.dtype == np.float32 and samples.shape == (500,)
    np.testing.assert_allclose(samples, left, atol=2 / scale + 1e-6)


def test_inputs_a_sweep_cannot_read_are_refused(folders, tmp_path) -> None:
    images, colours = planted_images(4)
    clips, _ = planted_audio(2)
    assert [input_kind(images), input_kind(clips), input_kind(["a text"])] == [
        "image",
        "audio",
        "text",
    ]
    with pytest.raises(
        ConfigError, match=r"inputs mix audio \(inputs\[1\]\), image \(inputs\[0\]\)"
    ):
        input_kind([images[0], clips[0]])
    with pytest.raises(ConfigError, match=r"image file '.*missing.png' does not exist"):
        probe_layers(folders["vit"], [str(tmp_path / "missing.png")] * 4, colours, **FAST)
    with pytest.raises(ConfigError, match=r"task='token' labels words; images and audio take"):
        probe_layers(folders["vit"], images, colours, task="token", progress=False)
    build_tiny("vit", 2).save_pretrained(tmp_path / "bare")  # no image processor saved
    with pytest.raises(CheckpointError, match=r"cannot load an image processor from .*bare"):
        probe_layers(tmp_path / "bare", images, colours, **FAST)
    with pytest.raises(ConfigError, match=r"audio of shape \(2, 3\); expected one non-empty 1-D"):
        stereo = {"array": np.zeros((2, 3)), "sampling_rate": 16_000}  # a datasets Audio cell
        probe_layers(folders["wav2vec2"], [stereo] * 4, colours, **FAST)
