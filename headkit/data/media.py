"""Images and audio as examples: what a probe sweep and the command line are given besides text.

- ``input_kind(items)``: "text", "image" or "audio". Images: PIL images, NumPy arrays of
  (height, width[, channels]), paths with an image suffix (``IMAGE_SUFFIXES``) or a
  ``datasets`` Image cell (``{"bytes", "path"}``). Audio: 1-D arrays (or lists) of samples,
  WAV paths, or a ``datasets`` Audio cell (``{"array", "sampling_rate"}``). Anything else is
  text.
- ``read_audio(path)``: mono float32 samples and their rate, with the standard library's
  ``wave`` (PCM WAV), or ``soundfile`` for other formats when it is installed;
  ``resample`` (linear interpolation) brings them to the processor's rate.
- ``load_processor(source, kind)``: the model folder's image processor or feature extractor.
- ``encode_media(processor, items, kind)``: one example dict of model inputs per item
  (``pixel_values``, ``input_values``, ``input_features``), which ``HeadedCollator`` batches.
"""

from __future__ import annotations

import io
import os
import wave
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, ConfigError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3")
KINDS = ("text", "image", "audio")
#: Images an image processor is given at once.
CHUNK = 64


def input_kind(items: Sequence[Any]) -> str:
    """What ``items`` are: "text", "image" or "audio" (all of one kind, else ConfigError)."""
    kinds = {_kind(x) for x in items}
    if len(kinds) > 1:
        first = {k: next(i for i, x in enumerate(items) if _kind(x) == k) for k in sorted(kinds)}
        shown = ", ".join(f"{k} (inputs[{i}])" for k, i in first.items())
        raise ConfigError(f"inputs mix {shown}; give texts, images or audio, one kind")
    return kinds.pop() if kinds else "text"


def _kind(item: Any) -> str:
    if hasattr(item, "getpixel") and hasattr(item, "convert"):  # a PIL image
        return "image"
    if isinstance(item, dict):
        if "array" in item:
            return "audio"
        path = str(item.get("path") or "")
        return "audio" if path.lower().endswith(AUDIO_SUFFIXES) else "image"
    if isinstance(item, (str, os.PathLike)):
        suffix = Path(item).suffix.lower()
        if suffix in IMAGE_SUFFIXES:
            return "image"
        return "audio" if suffix in AUDIO_SUFFIXES else "text"
    array = np.asarray(item) if hasattr(item, "__len__") else None
    if array is not None and array.dtype.kind in "biuf":
        return "audio" if array.ndim == 1 else "image"
    return "text"


def read_audio(path: str | os.PathLike | bytes) -> tuple[np.ndarray, int]:
    """(mono float32 samples in [-1, 1], sampling rate) of an audio file (or a WAV file's
    bytes, as a ``datasets`` Audio cell holds them)."""
    if isinstance(path, bytes):
        source: Any = io.BytesIO(path)
        path = Path("<bytes>.wav")
    else:
        path = source = Path(path)
        if not path.is_file():
            raise ConfigError(f"audio file {str(path)!r} does not exist")
    if path.suffix.lower() != ".wav":
        return _soundfile(path)
    try:
        with wave.open(source if isinstance(source, io.BytesIO) else str(path), "rb") as f:
            width, channels, rate = f.getsampwidth(), f.getnchannels(), f.getframerate()
            raw = f.readframes(f.getnframes())
    except (wave.Error, EOFError) as e:  # float or compressed WAVs: soundfile reads them
        try:
            return _soundfile(path)
        except ConfigError:
            raise ConfigError(
                f"{str(path)!r} is not a PCM WAV file the wave module reads ({e})"
            ) from None
    if width == 3:  # 24-bit: widen to 32
        b = np.frombuffer(raw, np.uint8).reshape(-1, 3)
        raw = np.concatenate([np.zeros((len(b), 1), np.uint8), b], 1).tobytes()
        width = 4
    dtype = {1: np.uint8, 2: "<i2", 4: "<i4"}[width]
    samples = np.frombuffer(raw, dtype).astype(np.float32)
    samples = (samples - 128) / 128 if width == 1 else samples / float(2 ** (8 * width - 1))
    return samples.reshape(-1, channels).mean(1), rate


def _soundfile(path: Path) -> tuple[np.ndarray, int]:
    try:
        import soundfile
    except ImportError:
        raise ConfigError(
            f"{str(path)!r}: reading {path.suffix or 'this'} audio needs soundfile (pip install "
            "soundfile); PCM .wav files are read without it"
        ) from None
    data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    return data.mean(1), int(rate)


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    """``samples`` at ``rate`` brought to ``target`` samples per second (linear
    interpolation; enough for probing, not for listening)."""
    if rate == target or not len(samples):
        return samples
    n = max(1, round(len(samples) * target / rate))
    return np.interp(np.arange(n) * rate / target, np.arange(len(samples)), samples).astype(
        np.float32
    )


def load_processor(source: str | os.PathLike, kind: str) -> Any:
    """The image processor ("image") or feature extractor ("audio") saved with a model."""
    from transformers import AutoFeatureExtractor

    from .._transformers import image_processor

    load = image_processor if kind == "image" else AutoFeatureExtractor.from_pretrained
    try:
        return load(str(source), trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        what = "an image processor" if kind == "image" else "a feature extractor"
        raise CheckpointError(
            f"cannot load {what} from {str(source)!r} for {kind} inputs ({str(e)[:160]}...); "
            "save the model's processor there or pass processor="
        ) from None


def encode_media(processor: Any, items: Sequence[Any], kind: str) -> list[dict[str, Any]]:
    """One example of model inputs per image or clip, through ``processor`` (images in
    chunks of ``CHUNK``, each clip alone: its normalisation is per clip)."""
    examples = []
    if kind == "image":
        for start in range(0, len(items), CHUNK):
            chunk = [_image(x, start + i) for i, x in enumerate(items[start : start + CHUNK])]
            encoded = processor(images=chunk, return_tensors="np")
            examples += [
                {k: np.asarray(v)[i] for k, v in encoded.items()} for i in range(len(chunk))
            ]
        return examples
    rate = int(getattr(processor, "sampling_rate", 16_000))
    for i, item in enumerate(items):
        encoded = processor(_audio(item, rate, i), sampling_rate=rate, return_tensors="np")
        example = {k: np.asarray(v)[0] for k, v in encoded.items()}
        if "input_values" in example:  # raw samples: the collator pads them and builds the mask
            example.pop("attention_mask", None)
        examples.append(example)
    return examples


def _image(item: Any, index: int) -> Any:
    from PIL import Image

    if hasattr(item, "convert"):
        return item.convert("RGB")
    if isinstance(item, dict):  # a datasets Image cell not decoded
        data = item.get("bytes")
        item = io.BytesIO(data) if data else item.get("path")
    if isinstance(item, (str, os.PathLike)) and not Path(item).is_file():
        raise ConfigError(f"inputs[{index}]: image file {str(item)!r} does not exist")
    if isinstance(item, (str, os.PathLike, io.BytesIO)):
        try:
            return Image.open(item).convert("RGB")
        except OSError as e:
            raise ConfigError(f"inputs[{index}]: cannot read the image ({e})") from None
    return Image.fromarray(np.asarray(item)).convert("RGB")


def _audio(item: Any, rate: int, index: int) -> np.ndarray:
    given = None
    if isinstance(item, dict):  # a datasets Audio cell: decoded, or the file's bytes / path
        given = item.get("sampling_rate")
        item = next((item[k] for k in ("array", "bytes", "path") if item.get(k) is not None), None)
    if isinstance(item, (str, os.PathLike, bytes)):
        item, given = read_audio(item)
    samples = np.asarray(item, dtype=np.float32)
    if samples.ndim != 1 or not len(samples):
        raise ConfigError(
            f"inputs[{index}]: audio of shape {samples.shape}; expected one non-empty 1-D array "
            "of samples (mono)"
        )
    return resample(samples, int(given), rate) if given else samples
