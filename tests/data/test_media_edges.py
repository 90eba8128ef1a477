"""Images and audio a hostile user hands headkit (issue 31, item 3): every bad one is refused
in one line naming the input before anything large is allocated, and the NumPy image arrays
the docs promise are accepted with their documented meaning."""

from __future__ import annotations

import io
import struct
import wave
import zlib
from pathlib import Path

import numpy as np
import pytest
from conftest import build_tiny
from PIL import Image
from tiny_media import RATE, image_processor, speech_feature_extractor, write_png, write_wav

from headkit import BatchError, ConfigError, HeadConfig, HeadedCollator, HeadedModel
from headkit.data.media import (
    MAX_AUDIO_SAMPLES,
    MAX_IMAGE_PIXELS,
    encode_media,
    read_audio,
    resample,
)

pytestmark = pytest.mark.usefixtures("single_thread")


def _wav_bytes(samples: int = 400, rate: int = RATE) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as f:
        f.setnchannels(1)
        f.setsampwidth(2)
        f.setframerate(16_000)
        f.writeframes(b"\0\1" * samples)
    raw = bytearray(out.getvalue())
    raw[24:28] = struct.pack("<I", rate)  # the fmt chunk's sampling rate, as a corrupt file has it
    return bytes(raw)


def _png_header(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims ``width`` x ``height`` pixels (a few hundred bytes: the
    pixel data is one compressed row, which is all a decompression bomb needs to look like)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    idat = zlib.compress(b"\0" * (1 + 3 * min(width, 64)))
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    path.write_bytes(png)
    return path


@pytest.mark.parametrize("rate", [0, 4_000_000_000])
def test_a_wav_header_with_an_impossible_rate_is_refused_before_reading(tmp_path, rate):
    path = tmp_path / "bad.wav"
    path.write_bytes(_wav_bytes(rate=rate))
    with pytest.raises(
        ConfigError,
        match=rf"bad.wav': the WAV header's sampling rate is {rate}; allowed: a whole number of "
        r"samples per second in 1..768,000$",
    ):
        read_audio(path)


def test_a_wav_claiming_one_hertz_is_refused_before_resampling(tmp_path):
    path = tmp_path / "slow.wav"
    path.write_bytes(_wav_bytes(samples=16_384, rate=1))  # 16,384 s at 16 kHz: 268 M samples
    samples, rate = read_audio(path)
    assert rate == 1 and len(samples) == 16_384
    with pytest.raises(
        ConfigError,
        match=r"^inputs\[0\]: 16,384 samples at 1 Hz resampled to 16,000 Hz is 262,144,000 "
        rf"samples, more than the {MAX_AUDIO_SAMPLES:,} \(MAX_AUDIO_SAMPLES\)",
    ):
        encode_media(speech_feature_extractor(), [str(path)], "audio")


@pytest.mark.parametrize("rate", [0, -16_000, 1e12, 16_000.5, float("nan"), True])
def test_sampling_rates_must_be_positive_whole_and_bounded(rate):
    cell = {"array": np.zeros(800, np.float32), "sampling_rate": rate}
    with pytest.raises(ConfigError, match=r"^inputs\[0\]: sampling_rate is .*; allowed: a whole"):
        encode_media(speech_feature_extractor(), [cell], "audio")
    with pytest.raises(ConfigError, match=r"^sampling_rate is .*; allowed: a whole number"):
        resample(np.zeros(4, np.float32), rate, RATE)


def test_non_finite_samples_are_refused_naming_the_sample():
    clip = np.zeros(800, np.float32)
    clip[17] = np.nan
    with pytest.raises(ConfigError, match=r"^inputs\[1\]: audio sample 17 is nan; allowed: finite"):
        encode_media(speech_feature_extractor(), [np.zeros(800, np.float32), clip], "audio")


def test_a_one_sample_wav_is_refused_naming_the_receptive_field(tmp_path):
    model = HeadedModel(build_tiny("wav2vec2", 2), [HeadConfig("h", pred_for_sequence=True)])
    clips = [
        write_wav(tmp_path / "ok.wav", np.zeros(800)),
        write_wav(tmp_path / "one.wav", np.zeros(1)),
    ]
    examples = encode_media(speech_feature_extractor(), [str(c) for c in clips], "audio")
    with pytest.raises(
        BatchError,
        match=r"^input_values row 1 has 1 samples of audio, fewer than the 20 that "
        r"Wav2Vec2Model's feature encoder needs for one frame",
    ):
        model(**HeadedCollator(model)(examples))


def test_huge_images_and_decompression_bombs_get_headkits_error(tmp_path):
    bomb = _png_header(tmp_path / "bomb.png", 20_000, 10_000)  # past twice PIL's limit
    with pytest.raises(
        ConfigError,
        match=r"^inputs\[0\] \('.*bomb.png'\): the image has more than twice PIL's "
        rf"MAX_IMAGE_PIXELS pixels; allowed: at most {MAX_IMAGE_PIXELS:,} \(MAX_IMAGE_PIXELS\)$",
    ):
        encode_media(image_processor(), [str(bomb)], "image")
    big = _png_header(tmp_path / "big.png", 12_000, 12_000)  # 144 MP: past PIL's limit
    with pytest.raises(
        ConfigError,
        match=r"^inputs\[0\] \('.*big.png'\): the image has 12000x12000 = 144,000,000 pixels",
    ):
        encode_media(image_processor(), [str(big)], "image")
    mid = _png_header(tmp_path / "mid.png", 10_000, 7_000)  # 70 MP: under PIL's limit, over ours
    with pytest.raises(
        ConfigError,
        match=r"^inputs\[1\] \('.*mid.png'\): the image has 10000x7000 = 70,000,000 pixels; "
        rf"allowed: at most {MAX_IMAGE_PIXELS:,} \(MAX_IMAGE_PIXELS, below PIL's",
    ):
        encode_media(image_processor(), [np.zeros((8, 8, 3), np.uint8), str(mid)], "image")


def test_a_corrupt_image_file_names_its_path(tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\nnot a png at all")
    with pytest.raises(
        ConfigError, match=r"^inputs\[0\] \('.*broken.png'\): cannot read the image"
    ):
        encode_media(image_processor(), [str(bad)], "image")


def test_empty_images_are_refused():
    with pytest.raises(ConfigError, match=r"^inputs\[0\]: the image is empty \(0x0 pixels\)$"):
        encode_media(image_processor(), [np.zeros((0, 0, 3), np.uint8)], "image")
    with pytest.raises(ConfigError, match=r"^inputs\[0\]: the image is empty \(0x0 pixels\)$"):
        encode_media(image_processor(), [Image.new("RGB", (0, 0))], "image")


def test_numpy_image_arrays_of_any_documented_layout_mean_the_same_image(tmp_path):
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (20, 24, 3)).astype(np.uint8)
    want = encode_media(image_processor(), [rgb], "image")[0]["pixel_values"]
    same = [
        rgb.astype(np.float32) / 255,  # floats in [0, 1]
        rgb.astype(np.float64),  # floats in [0, 255]
        rgb.astype(np.int64),
        np.moveaxis(rgb, -1, 0),  # channels first
        np.concatenate([rgb, np.full((20, 24, 1), 255, np.uint8)], -1),  # opaque RGBA
        str(write_png(tmp_path / "rgb.png", Image.fromarray(rgb))),
    ]
    for i, image in enumerate(same):
        got = encode_media(image_processor(), [image], "image")[0]["pixel_values"]
        np.testing.assert_allclose(got, want, atol=1e-6, err_msg=str(i))
    grey = rgb[..., 0]
    for layout in (grey, grey[..., None], grey[None], grey > 128):
        assert encode_media(image_processor(), [layout], "image")[0]["pixel_values"].shape == (
            3,
            32,
            32,
        )


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros((8, 8, 5)), r"an image array of shape \(8, 8, 5\); allowed: \(height, width\)"),
        (np.zeros((4, 8, 8, 3)), r"an image array of shape \(4, 8, 8, 3\); allowed: .*one image"),
        (
            np.full((8, 8, 3), 300.0),
            r"an image array of float64 values in \[300, 300\]; allowed: integers in 0..255, or",
        ),
        (
            np.full((8, 8, 3), -1),
            r"an image array of int64 values in \[-1, -1\]; allowed: integers in 0..255",
        ),
        (np.full((8, 8, 3), np.nan), r"the image array holds NaN or an infinity"),
    ],
    ids=["5-channels", "a-batch", "over-255", "negative", "nan"],
)
def test_numpy_image_arrays_outside_the_documented_ones_are_refused_naming_the_input(
    array, message
):
    with pytest.raises(ConfigError, match=rf"^inputs\[0\]: {message}"):
        encode_media(image_processor(), [array], "image")
