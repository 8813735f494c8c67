"""How fast a job's identity hashes a dataset file (``tokenbudget.app.identity.
content_hash``, xxh3_128 over 1 MiB reads), against SHA-256 over the same reads and
against reading alone, with the file in the page cache (warm) and evicted from it
(cold: ``posix_fadvise(DONTNEED)`` on that file only).

    .venv/bin/python bench/content_hash.py [--gib 2] [--dir /tmp]

Writes a file of random bytes of ``--gib`` GiB in a temporary folder under
``--dir`` and removes it after. No broker needed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tokenbudget.app import identity


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class _Nothing:
    def update(self, data: object) -> None:
        pass


def read_with(make: Callable[[], object]) -> Callable[[Path], None]:
    def run(path: Path) -> None:
        identity._feed(make(), path)

    return run


def timed(run: Callable[[Path], object], path: Path, cold: bool) -> float:
    if cold:
        evict(path)
    else:
        run(path)  # into the page cache
    started = time.perf_counter()
    run(path)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="content-hash-") as folder:
        path = Path(folder) / "data.jsonl"
        block = os.urandom(1 << 20)
        with path.open("wb") as out:
            for _ in range(int(args.gib * 1024)):
                out.write(block)
        size = path.stat().st_size
        candidates = {
            "read only": read_with(_Nothing),
            "content_hash (xxh3_128)": identity.content_hash,
            "sha256": read_with(hashlib.sha256),
        }
        print(f"{size / 2**30:.1f} GiB file in {folder}")
        for cache in ("warm", "cold"):
            for name, run in candidates.items():
                seconds = timed(run, path, cache == "cold")
                print(f"{cache:>4}  {name:<24} {seconds:6.2f} s  {size / seconds / 1e9:5.2f} GB/s")


if __name__ == "__main__":
    main()
