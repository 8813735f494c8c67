"""The file primitives: a file replaced whole and durably (the file fsynced, renamed,
its folder fsynced), or left as it was; an exclusive lock between holders."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from tokenbudget.core import files
from tokenbudget.core.files import atomic_file, locked, write_atomic


def test_write_atomic_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("old")
    write_atomic(path, "new ✓")
    assert path.read_text(encoding="utf-8") == "new ✓"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


def test_the_file_is_created_with_the_mode_asked(tmp_path: Path) -> None:
    path = tmp_path / "server.properties"
    write_atomic(path, "password=x", mode=0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_the_folder_is_made_when_missing(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "file"
    write_atomic(path, "x")
    assert path.read_text() == "x"


def test_an_error_in_the_block_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic_file(path) as out:
        out.write("half of the new")
        raise RuntimeError("the writer failed")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_a_crash_at_the_rename_leaves_the_temporary_for_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "part.parquet"
    temporary = tmp_path / ".part.parquet.tmp"

    def crash(src: object, dst: object) -> None:
        raise OSError("the machine went down")

    monkeypatch.setattr(files.os, "replace", crash)
    with pytest.raises(OSError), atomic_file(path, temporary=temporary) as out:
        out.write("whole")
    assert not path.exists()
    assert temporary.read_text() == "whole"  # hidden, and whole: nothing half-seen


def test_binary_content_and_a_named_temporary(tmp_path: Path) -> None:
    path = tmp_path / "part.parquet"
    temporary = tmp_path / ".part.parquet.tmp"
    with atomic_file(path, binary=True, temporary=temporary) as out:
        out.write(b"\x00\x01")
        assert temporary.exists() and not path.exists()  # nothing seen before the end
    assert path.read_bytes() == b"\x00\x01"
    assert not temporary.exists()


def test_the_file_is_fsynced_before_the_rename_and_the_folder_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        steps.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
        steps.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(files.os, "fsync", fsync)
    monkeypatch.setattr(files.os, "replace", replace)
    write_atomic(tmp_path / "f", "x")
    assert steps == ["fsync file", "rename", "fsync folder"]


def test_locked_is_exclusive_until_released(tmp_path: Path) -> None:
    lock = tmp_path / "locks" / "home.lock"
    taken = threading.Event()

    def other() -> None:
        with locked(lock):
            taken.set()

    with locked(lock):
        thread = threading.Thread(target=other)
        thread.start()
        assert not taken.wait(0.3)  # another holder waits ...
    assert taken.wait(5)  # ... and takes it once released
    thread.join()
