"""File primitives every layer shares: an exclusive lock between processes, and a
file replaced whole or not at all, durably.

A durable replacement (:func:`atomic_file`, :func:`write_atomic`) is written under a
temporary name beside the file, flushed and fsynced, renamed over the file, and the
folder fsynced: the rename is on disk only once its folder is. A reader sees the old
file or the new one, never half of one, and after a crash (the machine's included)
the file is one of the two. Everything that must survive a crash is written so: the
Parquet files and the sink's fenced leases, exports, the local broker's files, the
Kafka jars' lock and markers.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def fsync_dir(folder: Path) -> None:
    """Put ``folder``'s entries on disk: what makes a rename in it durable."""
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


@contextlib.contextmanager
def atomic_file(
    path: Path, *, binary: bool = False, mode: int = 0o666, temporary: Path | None = None
) -> Iterator[IO[Any]]:
    """A handle (UTF-8 text, or bytes with ``binary``) whose content durably replaces
    ``path`` when the block ends without an error (see the module); on an error
    while it is written ``path`` is left as it was and the temporary removed. A
    crash (or a rename that fails) leaves the temporary, under a hidden name: where
    that matters, whoever writes the folder removes them at start. ``path``'s folder
    is made if missing.

    The file is created with ``mode`` (less the umask), so a file with passwords is
    never readable by others, not even for a moment. ``temporary`` names the
    temporary where a reader of the folder must know it (default: hidden, with this
    process's pid, so two processes never write one temporary)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary or path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_atomic(path: Path, text: str, mode: int = 0o666) -> None:
    """Durably replace ``path`` with ``text`` (:func:`atomic_file`)."""
    with atomic_file(path, mode=mode) as fh:
        fh.write(text)
