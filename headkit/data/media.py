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
- Limits, checked before anything is allocated: sampling rates in
  1..``MAX_SAMPLING_RATE`` (a WAV header's too, before its frames are read), at most
  ``MAX_AUDIO_SAMPLES`` samples read or made by resampling, images of at most
  ``MAX_IMAGE_PIXELS`` pixels (below PIL's own decompression-bomb limit) and none empty.
  NumPy image arrays: (height, width) or (height, width, channels) or (channels, height,
  width) with 1, 3 or 4 channels; integers in 0..255 or floats in [0, 1] (scaled by 255) or
  [0, 255]; anything else (5 channels, a batch of images in one array) is a ConfigError
  naming the input.
- ``encode_media(processor, items, kind)``: one example dict of model inputs per item
  (``pixel_values``, ``input_values``, ``input_features``), which ``HeadedCollator`` batches.
"""

from __future__ import annotations

import io
import os
import warnings
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
#: The highest sampling rate accepted (Hz): professional audio goes to 384 kHz, twice that
#: is room to spare; a header or cell claiming more is corrupt.
MAX_SAMPLING_RATE = 768_000
#: The most samples of one clip read from a file or made by resampling (2**26: 70 minutes
#: at 16 kHz, 256 MB of float32), checked before they are allocated.
MAX_AUDIO_SAMPLES = 2**26
#: The most pixels of one image (2**26, 67 MP), below PIL's decompression-bomb limit
#: (``PIL.Image.MAX_IMAGE_PIXELS``, 89 MP), checked from the header before decoding.
MAX_IMAGE_PIXELS = 2**26
#: Channel counts a NumPy image array may have (grey, RGB, RGBA).
IMAGE_CHANNELS = (1, 3, 4)


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
            check_sampling_rate(rate, f"{str(path)!r}: the WAV header's sampling rate")
            _check_samples(f.getnframes(), f"{str(path)!r}: the WAV header's frame count")
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
    info = soundfile.info(str(path))
    check_sampling_rate(info.samplerate, f"{str(path)!r}: the file's sampling rate")
    _check_samples(info.frames, f"{str(path)!r}: the file's frame count")
    data, rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    return data.mean(1), int(rate)


def check_sampling_rate(rate: Any, what: str = "sampling_rate") -> int:
    """``rate`` as an int, or ConfigError naming ``what``: a sampling rate is a whole number
    of samples per second in 1..``MAX_SAMPLING_RATE``."""
    ok = isinstance(rate, (int, np.integer)) or (isinstance(rate, float) and rate.is_integer())
    if isinstance(rate, bool) or not ok or not 1 <= rate <= MAX_SAMPLING_RATE:
        raise ConfigError(
            f"{what} is {rate!r}; allowed: a whole number of samples per second in "
            f"1..{MAX_SAMPLING_RATE:,}"
        )
    return int(rate)


def _check_samples(count: int, what: str) -> None:
    if count > MAX_AUDIO_SAMPLES:
        raise ConfigError(
            f"{what} is {count:,} samples, more than the {MAX_AUDIO_SAMPLES:,} "
            "(MAX_AUDIO_SAMPLES) headkit reads of one clip; cut the audio into shorter clips"
        )


def resample(samples: np.ndarray, rate: int, target: int, where: str = "") -> np.ndarray:
    """``samples`` at ``rate`` brought to ``target`` samples per second (linear
    interpolation; enough for probing, not for listening). Both rates are checked
    (``check_sampling_rate``), and so is the length made (``MAX_AUDIO_SAMPLES``) before it is
    allocated; ``where`` names the input in those errors."""
    rate = check_sampling_rate(rate)
    target = check_sampling_rate(target, "the processor's sampling_rate")
    if rate == target or not len(samples):
        return samples
    n = max(1, round(len(samples) * target / rate))
    made = f"{len(samples):,} samples at {rate:,} Hz resampled to {target:,} Hz"
    _check_samples(n, f"{where}: {made}" if where else made)
    return np.interp(np.arange(n) * rate / target, np.arange(len(samples)), samples).astype(
        np.float32
    )


def load_processor(source: str | os.PathLike, kind: str) -> Any:
    """The image processor ("image") or feature extractor ("audio") saved with a model."""
    from transformers import AutoFeatureExtractor, AutoImageProcessor

    cls = AutoImageProcessor if kind == "image" else AutoFeatureExtractor
    try:
        return cls.from_pretrained(str(source), trust_remote_code=False)
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
    rate = check_sampling_rate(
        getattr(processor, "sampling_rate", 16_000), "the processor's sampling_rate"
    )
    for i, item in enumerate(items):
        encoded = processor(_audio(item, rate, i), sampling_rate=rate, return_tensors="np")
        example = {k: np.asarray(v)[0] for k, v in encoded.items()}
        if "input_values" in example:  # raw samples: the collator pads them and builds the mask
            example.pop("attention_mask", None)
        examples.append(example)
    return examples


def _image(item: Any, index: int) -> Any:
    """One image as RGB, its size checked before it is decoded (``MAX_IMAGE_PIXELS``)."""
    from PIL import Image

    where = f"inputs[{index}]"
    if isinstance(item, dict):  # a datasets Image cell not decoded
        data = item.get("bytes")
        item = io.BytesIO(data) if data else item.get("path")
    if isinstance(item, (str, os.PathLike)):
        where = f"inputs[{index}] ({str(item)!r})"
        if not Path(item).is_file():
            raise ConfigError(f"inputs[{index}]: image file {str(item)!r} does not exist")
    if isinstance(item, (str, os.PathLike, io.BytesIO)):
        with warnings.catch_warnings():  # PIL's bomb warning: headkit's cap is lower
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            try:
                opened = Image.open(item)
            except Image.DecompressionBombError:
                raise ConfigError(
                    f"{where}: the image has more than twice PIL's MAX_IMAGE_PIXELS pixels; "
                    f"allowed: at most {MAX_IMAGE_PIXELS:,} (MAX_IMAGE_PIXELS)"
                ) from None
            except OSError as e:
                raise ConfigError(f"{where}: cannot read the image ({e})") from None
            _check_image_size(opened.size, where)
            try:
                return opened.convert("RGB")
            except (OSError, ValueError) as e:  # truncated or corrupt pixel data
                raise ConfigError(f"{where}: cannot read the image ({e})") from None
    if hasattr(item, "convert"):
        _check_image_size(item.size, where)
        return item.convert("RGB")
    return Image.fromarray(_image_array(item, where)).convert("RGB")


def _check_image_size(size: tuple[int, int], where: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ConfigError(f"{where}: the image is empty ({width}x{height} pixels)")
    if width * height > MAX_IMAGE_PIXELS:
        raise ConfigError(
            f"{where}: the image has {width}x{height} = {width * height:,} pixels; allowed: at "
            f"most {MAX_IMAGE_PIXELS:,} (MAX_IMAGE_PIXELS, below PIL's decompression-bomb "
            "limit): resize it first"
        )


def _image_array(item: Any, where: str) -> np.ndarray:
    """A NumPy image as (height, width[, channels]) uint8 (see the module docstring)."""
    array = np.asarray(item)
    shape = array.shape
    allowed = (
        "(height, width), (height, width, channels) or (channels, height, width) with 1, 3 "
        "or 4 channels, one image per input"
    )
    if array.dtype.kind not in "biuf":
        raise ConfigError(f"{where}: an image array of dtype {array.dtype}; expected numbers")
    if array.ndim == 3 and shape[-1] not in IMAGE_CHANNELS and shape[0] in IMAGE_CHANNELS:
        array = np.moveaxis(array, 0, -1)  # (channels, height, width)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim not in (2, 3) or (array.ndim == 3 and array.shape[-1] not in IMAGE_CHANNELS):
        raise ConfigError(f"{where}: an image array of shape {shape}; allowed: {allowed}")
    _check_image_size((array.shape[1], array.shape[0]), where)
    if array.dtype.kind == "b":
        return array.astype(np.uint8) * 255
    if array.dtype.kind == "f" and not np.isfinite(array).all():
        raise ConfigError(f"{where}: the image array holds NaN or an infinity")
    lo, hi = (float(array.min()), float(array.max())) if array.size else (0.0, 0.0)
    if array.dtype.kind == "f" and lo >= 0 and hi <= 1:
        array = array * 255  # floats in [0, 1]
    elif lo < 0 or hi > 255:
        raise ConfigError(
            f"{where}: an image array of {array.dtype} values in [{lo:g}, {hi:g}]; allowed: "
            "integers in 0..255, or floats in [0, 1] or [0, 255]"
        )
    return np.rint(array).astype(np.uint8) if array.dtype.kind == "f" else array.astype(np.uint8)


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
    _check_samples(len(samples), f"inputs[{index}]: the clip")
    if not np.isfinite(samples).all():
        bad = int(np.flatnonzero(~np.isfinite(samples))[0])
        raise ConfigError(
            f"inputs[{index}]: audio sample {bad} is {samples[bad]}; allowed: finite samples"
        )
    if given is None:
        return samples
    given = check_sampling_rate(given, f"inputs[{index}]: sampling_rate")
    return resample(samples, given, rate, f"inputs[{index}]")
