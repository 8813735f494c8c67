"""Regenerate the jar locks from ``infra/kafka/pom.xml`` with Maven (developers only).

    python -m tokenbudget.localkafka.jarlock [--pom POM] [--out DIR] VERSION...

For each Kafka version, Maven resolves the pom (``dependency:list`` with absolute file
names: the same resolution ``dependency:copy-dependencies`` does, and it leaves the jars
in ~/.m2), and ``DIR/jars-<VERSION>.lock`` gets one line per jar with its SHA-256 and
size (the format is in :mod:`tokenbudget.localkafka.jars`). The lock records the pom's SHA-256 so
a test notices a pom changed without regenerating the locks. ``make jars-lock`` runs this
for the supported versions; users never need Maven for those.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenbudget.core.errors import BrokerError
from tokenbudget.core.files import write_atomic
from tokenbudget.localkafka.jars import LOCK_DIR, Jar, format_lock

REPO_ROOT = Path(__file__).resolve().parents[2]
POM = REPO_ROOT / "infra" / "kafka" / "pom.xml"


@dataclass(frozen=True)
class Resolved:
    """One line of ``mvn dependency:list -DoutputAbsoluteArtifactFilename=true``."""

    group: str
    artifact: str
    type: str
    classifier: str
    version: str
    path: Path


def parse_listing(text: str) -> list[Resolved]:
    """The artifacts in a dependency:list output file; other lines are skipped.

    Lines look like ``g:a:jar[:classifier]:v:scope:/abs/path``, and from
    maven-dependency-plugin 3.7 on may end with `` -- module name``.
    """
    found = []
    for raw in text.splitlines():
        line = raw.strip().split(" -- ", 1)[0]
        head, sep, path = line.partition(":/")  # the absolute path starts the last field
        fields = head.split(":")
        if not sep or len(fields) not in (5, 6):
            continue
        group, artifact, kind = fields[:3]
        classifier = fields[3] if len(fields) == 6 else ""
        version = fields[-2]
        found.append(Resolved(group, artifact, kind, classifier, version, Path("/" + path)))
    return found


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def lock_entries(resolved: Sequence[Resolved], kafka_version: str) -> list[Jar]:
    """A Jar per resolved artifact; what the lock format cannot express is an error."""
    jars = []
    for item in resolved:
        jar = Jar(item.group, item.artifact, item.version, "0" * 64, 0)
        where = f"{item.group}:{item.artifact}:{item.version}"
        if item.type != "jar" or item.classifier:
            raise BrokerError(
                f"{where}: type {item.type!r} classifier {item.classifier!r}: "
                "the lock holds plain jars only; change the pom"
            )
        if item.path.name != jar.name:
            raise BrokerError(f"{where}: resolved to {item.path}, not {jar.name} (a SNAPSHOT?)")
        jars.append(
            Jar(jar.group, jar.artifact, jar.version, _sha256(item.path), item.path.stat().st_size)
        )
    names = [jar.name for jar in jars]
    if len(set(names)) != len(names):
        raise BrokerError(f"two artifacts share a jar name: {sorted(names)}")
    if f"kafka_2.13-{kafka_version}.jar" not in names:
        raise BrokerError(f"Maven resolved no kafka_2.13-{kafka_version}.jar: {sorted(names)}")
    return jars


def resolve(pom: Path, kafka_version: str) -> list[Resolved]:
    """Run Maven on ``pom`` for ``kafka_version``; the artifacts it resolves."""
    mvn = shutil.which("mvn")
    if mvn is None:
        raise BrokerError("mvn is not on PATH: generating the jar locks needs Maven")
    with tempfile.TemporaryDirectory(prefix="jarlock-") as tmp:
        listing = Path(tmp) / "dependencies.txt"
        cmd = [
            mvn, "-B", "-q", "-f", str(pom), "dependency:list",
            f"-Dkafka.version={kafka_version}",
            "-DoutputAbsoluteArtifactFilename=true",
            f"-DoutputFile={listing}",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        if proc.returncode != 0 or not listing.is_file():
            output = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
            raise BrokerError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{output}")
        return parse_listing(listing.read_text())


def write_lock(pom: Path, kafka_version: str, out_dir: Path) -> Path:
    """Resolve ``kafka_version`` with Maven and write its lock into ``out_dir``."""
    jars = lock_entries(resolve(pom, kafka_version), kafka_version)
    meta = {
        "kafka-version": kafka_version,
        "pom-sha256": hashlib.sha256(pom.read_bytes()).hexdigest(),
    }
    path = out_dir / f"jars-{kafka_version}.lock"
    write_atomic(path, format_lock(jars, meta))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokenbudget.localkafka.jarlock",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("versions", nargs="+", metavar="VERSION", help="Kafka versions")
    parser.add_argument("--pom", type=Path, default=POM)
    parser.add_argument("--out", type=Path, default=LOCK_DIR)
    args = parser.parse_args(argv)
    try:
        for version in args.versions:
            path = write_lock(args.pom, version, args.out)
            lines = sum(1 for line in path.read_text().splitlines() if not line.startswith("#"))
            print(f"{path}: {lines} jars")
    except (BrokerError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
