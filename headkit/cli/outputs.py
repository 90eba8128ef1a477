"""Where the commands write: checked before any work, written so nothing of the user's is lost.

Every command checks its output before it reads a model or trains:

- an output that *is* one of the command's inputs (the same path, through a symlink or a hard
  link: ``os.path.samefile``), or an existing file inside an input folder (a checkpoint's own
  files), is refused;
- an existing output file is replaced only with ``--overwrite``;
- an output folder must be new, empty, or one the command wrote before (``--overwrite``);
  any other folder is refused, naming the files it holds.

Files are written to a fresh name in the target folder, created exclusively (``O_EXCL``, a
random suffix: never a fixed ``X.tmp`` a user may own, never through a symlink), then renamed
over the output. Importing this module imports no torch.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

from ..errors import ConfigError

#: Files of a folder named in a refusal (the rest are counted).
_NAMED = 8


def local_inputs(*sources: object) -> list[Path]:
    """The inputs that are local paths (``packaged:`` names, hub ids and None dropped)."""
    out = []
    for s in sources:
        if s is None or str(s).startswith("packaged:"):
            continue
        p = Path(str(s))
        if p.exists():
            out.append(p)
    return out


def check_output_file(
    output: str | os.PathLike,
    inputs: Iterable[Path],
    overwrite: bool,
    option: str = "--output",
) -> Path:
    """Refuse ``output`` (a file to write) before any work; return it as a Path.

    Refused: one of ``inputs``, an existing file inside an input folder, a folder, and an
    existing file without ``overwrite``.
    """
    out = Path(output)
    _not_an_input(out, inputs, option)
    if out.is_dir():
        raise ConfigError(f"{option}={str(out)!r} is a folder; a file is written there")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise ConfigError(f"{option}={str(out)!r} exists; pass --overwrite to replace it")
    return out


def check_output_folder(
    output: str | os.PathLike,
    inputs: Iterable[Path],
    overwrite: bool,
    ours: Callable[[Path], bool],
    what: str,
    option: str = "--output",
) -> Path:
    """Refuse ``output`` (a folder to write) before any work; return it as a Path.

    A new or empty folder is fine. A folder for which ``ours(folder)`` holds (``what``, e.g.
    "a headkit checkpoint", wrote it) is replaced only with ``overwrite``; any other folder
    with files is refused, naming them, whatever ``overwrite`` says.
    """
    out = Path(output)
    _not_an_input(out, inputs, option)
    for source in inputs:
        if _inside(source, out):
            raise ConfigError(
                f"{option}={str(out)!r} holds the input {str(source)!r}; write elsewhere"
            )
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ConfigError(f"{option}={str(out)!r} is a file or a link; a folder is written there")
    if not out.exists():
        return out
    names = sorted(p.name for p in out.iterdir())
    if not names:
        return out
    if ours(out):
        if not overwrite:
            raise ConfigError(
                f"{option}={str(out)!r} holds {what} already; pass --overwrite to replace it"
            )
        return out
    shown = ", ".join(names[:_NAMED]) + (
        f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    )
    raise ConfigError(
        f"{option}={str(out)!r} is a folder with files that are not {what} ({shown}); "
        "choose a new or empty folder"
    )


def write_file(path: str | os.PathLike, write: Callable[[IO], None]) -> Path:
    """Write ``path`` atomically: ``write(f)`` fills a fresh UTF-8 text file created
    exclusively beside it, which is then renamed over ``path`` (a symlink at ``path`` is
    replaced, not followed)."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with fresh_file(out) as tmp:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    return out


def write_text(path: str | os.PathLike, text: str) -> Path:
    """``write_file`` with a string."""
    return write_file(path, lambda f: f.write(text))


@contextlib.contextmanager
def fresh_file(out: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """A new empty file beside ``out``, created exclusively under a random name (removed on
    the way out unless it was renamed); its mode is what a plain ``open`` would give."""
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=suffix, dir=out.parent)
    tmp = Path(name)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        os.close(fd)
        yield tmp
    finally:
        tmp.unlink(missing_ok=True)


def _not_an_input(out: Path, inputs: Iterable[Path], option: str) -> None:
    for source in inputs:
        if _same(out, source):
            raise ConfigError(
                f"{option}={str(out)!r} is the input {str(source)!r}; writing it would destroy "
                "the input: choose another path"
            )
        if source.is_dir() and _inside(out, source) and (out.exists() or out.is_symlink()):
            raise ConfigError(
                f"{option}={str(out)!r} is a file of the input {str(source)!r}; choose a path "
                "outside it"
            )


def _same(a: Path, b: Path) -> bool:
    """The same file or folder: by inode where both exist (symlinks, hard links), else by
    the resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def _inside(path: Path, folder: Path) -> bool:
    """``path`` lies (strictly) inside ``folder``, symlinks resolved."""
    p, f = path.resolve(), folder.resolve()
    return p != f and f in p.parents
