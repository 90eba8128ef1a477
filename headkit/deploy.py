"""``headkit.export``: a trained model (or checkpoint folder) in a format other stacks serve.

Formats are the entries of ``EXPORTERS`` (``formats.py``): functions
``(model, output_dir, **options)``, added with ``EXPORTERS.register(name, fn)``. Built in
(registered by name in ``headkit/__init__.py``, imported when used): ``"onnx"``, one ONNX
graph of every head for onnxruntime (``integrations/onnx.py``); ``"transformers"``, one head
as a plain transformers classifier folder, where such a class computes it exactly
(``integrations/hf_classifiers.py``); ``"sentence-transformers"``, one sequence head as a
saved SentenceTransformer (``integrations/sentence_transformers.py``); ``"hub"``, the
checkpoint staged in ``output_dir`` and pushed to ``repo_id`` (``checkpoint/hub.py``). The module
is not named ``export.py``: importing ``headkit.export`` would then shadow the function.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .formats import EXPORTERS


def export(
    model: Any,
    directory: str | os.PathLike,
    format: str = "onnx",
    *,
    overwrite: bool = False,
    device: Any = None,
    **options: Any,
) -> Any:
    """Export ``model`` (a HeadedModel, or a checkpoint folder: its tokenizer, if saved there,
    goes along) to ``directory`` with the exporter registered as ``format`` in ``EXPORTERS``;
    returns what it wrote (``OnnxExport``, ``TransformersExport``, ...). ``options`` are the
    exporter's (``export_onnx``: ``tokenizer``, ``heads``, ``atol``, ...).

    ``device`` ("cuda", "cuda:1", "auto", a ``torch.device``; default the CPU): where a
    checkpoint folder is loaded, so the export is traced, and checked against the model, there
    (an ONNX graph is then run with onnxruntime on the CPU and compared within ``atol``). A
    HeadedModel is exported where it is: a ``device`` elsewhere is refused. A device torch
    does not see is a ConfigError before anything is loaded.

    As ``headkit export``, nothing of the user's is replaced: an exporter that knows its own
    output (a ``check_target(directory, overwrite, **options)`` attribute: ``onnx``,
    ``transformers``) checks ``directory`` and its options before anything is loaded or built,
    and replaces an earlier export of its format only with ``overwrite=True`` (only the files it
    can prove it wrote: ``integrations/exporting.py``); any other exporter writes into a new or
    empty folder only."""
    if not isinstance(format, str) or format not in EXPORTERS:
        raise ConfigError(
            f"format={str(format)[:80]!r} is invalid; allowed: {', '.join(EXPORTERS.in_order())}",
            field="format",
            value=format,
        )
    exporter = EXPORTERS.get(format)
    from .modules import on_device, resolve_device  # torch: only once exporting

    folder = isinstance(model, (str, os.PathLike))
    if folder:
        device = resolve_device(device)
    else:
        on_device(model, device)
    check = getattr(exporter, "check_target", None)
    if check is not None:
        check(Path(directory), overwrite, **options)
        options["overwrite"] = overwrite
    else:
        _new_or_empty(Path(directory), format, overwrite)
    if folder:
        model, tokenizer = _open(Path(model), device)
        options.setdefault("tokenizer", tokenizer)
    return exporter(model, directory, **options)


def _new_or_empty(directory: Path, format: str, overwrite: bool) -> None:
    """Refuse a folder with files for an exporter that cannot tell its own files apart."""
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise ConfigError(
            f"directory={str(directory)!r} is a file or a link; a folder is written",
            field="directory",
            value=str(directory),
        )
    names = sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []
    if names:
        shown = ", ".join(repr(n[:80]) for n in names[:8])
        more = f" and {len(names) - 8} more" if len(names) > 8 else ""
        again = " (overwrite=True applies to onnx and transformers exports)" if overwrite else ""
        raise ConfigError(
            f"directory={str(directory)!r} holds files ({shown}{more}); format={format!r} "
            f"writes into a new or empty folder only{again}",
            field="directory",
            value=str(directory),
        )


def _open(folder: Path, device: Any) -> tuple[Any, Any]:
    """The model of a checkpoint folder, on ``device``, and the tokenizer saved beside it
    (None if none)."""
    from transformers import AutoTokenizer

    from .model.headed import HeadedModel

    model = HeadedModel.from_pretrained(folder).to(device).eval()
    tokenizer = None
    if (folder / "tokenizer_config.json").is_file():
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise ConfigError(f"{str(folder)!r}: its tokenizer cannot be loaded ({e})") from None
    return model, tokenizer
