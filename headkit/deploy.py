"""``headkit.export``: a trained model (or checkpoint folder) in a format other stacks serve.

``format="onnx"``: one ONNX graph of every head for onnxruntime (``integrations/onnx.py``);
``format="transformers"``: one head as a plain transformers classifier folder, where such a
class computes it exactly (``integrations/hf_classifiers.py``). Both verify what they wrote
against the model before they move it into ``directory``. The module is not named
``export.py``: importing ``headkit.export`` would then shadow the function.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import ConfigError

FORMATS = ("onnx", "transformers")


def export(
    model: Any,
    directory: str | os.PathLike,
    format: str = "onnx",
    *,
    overwrite: bool = False,
    **options: Any,
) -> Any:
    """Export ``model`` (a HeadedModel, or a checkpoint folder: its tokenizer, if saved there,
    goes along) to ``directory``; returns what was written (``OnnxExport`` or
    ``TransformersExport``). ``directory`` must be new, empty, or an earlier export of the same
    format, replaced only with ``overwrite=True`` (as ``headkit export --overwrite``); only the
    files headkit can prove it wrote there are replaced. ``options`` are those of
    ``export_onnx`` / ``export_transformers`` (``tokenizer``, ``heads`` / ``head``, ``atol``,
    ...), checked before anything is loaded or built."""
    if not isinstance(format, str) or format not in FORMATS:
        raise ConfigError(f"format={str(format)[:80]!r} is invalid; allowed: {', '.join(FORMATS)}")
    from .integrations.exporting import check_atol, check_export_target

    if format == "onnx":
        from .integrations.onnx import SIDECAR, check_onnx_options

        check_onnx_options(
            options.get("opset"), options.get("atol", 1e-4), options.get("exporter", "auto")
        )
    else:
        from .integrations.hf_classifiers import SIDECAR

        check_atol(options.get("atol", 1e-4))
    check_export_target(Path(directory), SIDECAR, overwrite, f"{format} export")
    options["overwrite"] = overwrite
    if isinstance(model, (str, os.PathLike)):
        model, tokenizer = _open(Path(model))
        options.setdefault("tokenizer", tokenizer)
    if format == "onnx":
        from .integrations.onnx import export_onnx

        return export_onnx(model, directory, **options)
    from .integrations.hf_classifiers import export_transformers

    return export_transformers(model, directory, **options)


def _open(folder: Path) -> tuple[Any, Any]:
    """The model of a checkpoint folder and the tokenizer saved beside it (None if none)."""
    from transformers import AutoTokenizer

    from .model.headed import HeadedModel

    model = HeadedModel.from_pretrained(folder).eval()
    tokenizer = None
    if (folder / "tokenizer_config.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{str(folder)!r}: its tokenizer cannot be loaded ({e})") from None
    return model, tokenizer
