"""One save at a time per checkpoint folder: an exclusive ``flock`` on ``.headkit.lock``.

The lock is taken on a file descriptor of its own for each save, so it serialises saves
from other processes and from other threads of the same process alike (Linux ``flock``
locks belong to the open file description). The lock file is removed at the end of a save
while the lock is still held; a waiter that then gets the lock checks that the path still
names the file it locked, and otherwise starts again on the new one. So a finished save
leaves no lock file behind, and two saves never both hold "the" lock.

Where ``fcntl`` does not exist (Windows) or the file system refuses ``flock``, saves are not
serialised (a warning says so); each is still atomic on its own.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import CheckpointError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK = ".headkit.lock"
#: How long a save waits for another save into the same folder before giving up (seconds).
LOCK_TIMEOUT_S = 3600.0


@contextmanager
def folder_lock(root: Path, timeout: float | None = None) -> Iterator[None]:
    """Hold the folder's save lock for the duration of the ``with`` block (CheckpointError
    when another save holds it for longer than ``timeout`` seconds, default LOCK_TIMEOUT_S)."""
    path = root / LOCK
    wait = LOCK_TIMEOUT_S if timeout is None else timeout
    fd = _acquire(path, wait) if fcntl is not None else None
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)  # still locked: waiters on this file notice and retry
            os.close(fd)


def _acquire(path: Path, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while True:
        fd = _open(path)
        try:
            if not _wait(fd, path, deadline, timeout):
                os.close(fd)
                return None
            same = os.fstat(fd).st_ino == os.lstat(path).st_ino
        except FileNotFoundError:
            same = False  # removed by the save that held it: lock the new one
        except BaseException:
            os.close(fd)
            raise
        if same:
            return fd
        os.close(fd)


def _open(path: Path) -> int:
    """Open (or create) the lock file itself: never through a symlink, and only an empty
    regular file, which is all headkit ever makes of it."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as e:
        if path.is_symlink():
            what = f"a symlink (to {os.readlink(path)!r}), which headkit never follows"
        elif path.is_dir():
            what = "a directory"
        else:
            what = f"not a file headkit can open ({e.strerror})"
        raise _malformed(path, what) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_size:
        os.close(fd)
        kind = f"a file holding {info.st_size} bytes" if stat.S_ISREG(info.st_mode) else "special"
        raise _malformed(path, f"{kind}, not the empty file headkit creates")
    return fd


def _malformed(path: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{str(path)!r} is {what}; it is where saves into this folder take their lock: "
        "remove it (or move it away if it is yours) and save again"
    )


def _wait(fd: int, path: Path, deadline: float, timeout: float) -> bool:
    """Poll for the exclusive lock; False when the file system cannot lock at all."""
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as e:
            if e.errno in (errno.EAGAIN, errno.EACCES):
                pass
            else:
                warnings.warn(
                    f"cannot lock {str(path)!r} ({e}); saves into this folder are not serialised",
                    stacklevel=5,
                )
                return False
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"another save into {str(path.parent)!r} has held {LOCK!r} for over "
                f"{timeout:g} s; wait for it to finish (or, if no save is running, the "
                "process holding it is stuck: end it)"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
