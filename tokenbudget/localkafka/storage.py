"""What the local broker's first start prepares: its jars (a locked version's, or
Maven's for any other) and its storage, formatted once with the cluster id and the
SCRAM users, and refused when a newer Kafka formatted it."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import shutil
import subprocess
import uuid
from pathlib import Path

from tokenbudget.core.errors import BrokerError
from tokenbudget.core.files import locked, write_atomic
from tokenbudget.localkafka import jars as kafka_jars
from tokenbudget.localkafka.properties import (
    QUICK_JVM_FLAGS,
    _jvm_logging_flags,
    _mask,
    _scram_arguments,
    pom_path,
)
from tokenbudget.localkafka.settings import (
    _CLUSTER_ID_FILE,
    _DATA_DIR,
    _FORMAT_FILE,
    _MARKER_FILE,
    _PROPS_FILE,
    _STORAGE_TOOL,
    BrokerSettings,
)

log = logging.getLogger(__name__)


def _jars_complete(libs: Path, marker: Path, version: str, pom_digest: str) -> bool:
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if data.get("kafka_version") != version or data.get("pom_sha256") != pom_digest:
        return False
    jars = data.get("jars") or []
    return bool(jars) and all((libs / name).is_file() for name in jars)


def ensure_jars(settings: BrokerSettings) -> Path:
    """Fetch the broker's jars unless the cache is complete; return the libs dir.

    A Kafka version with a packaged lock (``kafka_resources/jars-<version>.lock``) is
    downloaded and checked by :mod:`tokenbudget.localkafka.jars`: no Maven. Any other version
    is fetched with Maven: the cache (``<jars_root>/kafka-<version>/libs``) is then
    complete when its marker names this Kafka version, this pom's digest and jars that
    all exist; otherwise the jars are copied into a fresh directory that then replaces
    the old one.
    """
    version = settings.kafka_version
    lock = kafka_jars.lock_file(version)
    if lock is not None:
        return kafka_jars.ensure(settings.libs_dir, lock)
    versions = ", ".join(kafka_jars.locked_versions()) or "none"
    without_maven = (
        f"Kafka {version} has no jar lock in this tokenbudget, so Maven fetches its jars; "
        f"only the locked versions ({versions}) work without Maven: set "
        "TOKENBUDGET_KAFKA_VERSION to one of them"
    )
    try:
        pom = pom_path()
    except BrokerError as exc:
        raise BrokerError(f"{without_maven}, or: {exc}") from exc
    libs = settings.libs_dir
    vdir = libs.parent
    marker = vdir / _MARKER_FILE
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()
    if _jars_complete(libs, marker, version, digest):
        return libs
    with locked(vdir / ".lock"):
        if _jars_complete(libs, marker, version, digest):
            return libs
        mvn = shutil.which("mvn")
        if mvn is None:
            raise BrokerError(
                f"{without_maven}, or install Maven (apt-get install maven) or put mvn "
                "on PATH, then retry"
            )
        tmp = vdir / f"libs.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [
            mvn,
            "-q",
            "-B",
            "-f",
            str(pom),
            "dependency:copy-dependencies",
            f"-Dkafka.version={version}",
            f"-DoutputDirectory={tmp}",
        ]
        log.info("fetching Kafka %s jars into %s", version, libs)
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise BrokerError(f"running Maven to fetch the Kafka jars failed: {exc}") from exc
        output = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        main_jar = f"kafka_2.13-{version}.jar"
        if proc.returncode != 0 or not (tmp / main_jar).is_file():
            shutil.rmtree(tmp, ignore_errors=True)
            raise BrokerError(
                f"Maven could not fetch Kafka {version} (exit {proc.returncode}): is the "
                f"version on Maven Central and Maven Central reachable (or the jars in "
                f"~/.m2)? Command: {' '.join(cmd)}\n{output}"
            )
        old = vdir / f"libs.old-{os.getpid()}"
        if libs.exists():
            os.replace(libs, old)
        os.replace(tmp, libs)
        shutil.rmtree(old, ignore_errors=True)
        jars = sorted(p.name for p in libs.iterdir() if p.suffix == ".jar")
        write_atomic(
            marker,
            json.dumps({"kafka_version": version, "pom_sha256": digest, "jars": jars}, indent=1),
        )
        return libs


def new_cluster_id() -> str:
    """A Kafka Uuid as ``kafka-storage random-uuid`` prints it (url-safe base64, no
    padding, never starting with '-'), without starting a JVM for it."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _format_storage(settings: BrokerSettings, java: str) -> None:
    home = settings.home.resolve()
    users = sorted(settings.sasl_users)
    if (home / _DATA_DIR / "meta.properties").is_file():
        try:
            formatted = json.loads((home / _FORMAT_FILE).read_text())
            formatted_with = formatted["kafka_version"]
        except (OSError, ValueError, KeyError, TypeError):
            return
        missing = sorted(set(users) - set(formatted.get("scram_users", [])))
        if missing:
            raise BrokerError(
                f"SCRAM users {', '.join(missing)} are not in the metadata of {home / _DATA_DIR}: "
                "they are only created when the storage is first formatted; wipe the broker "
                "home (its topics are lost) or use a new one"
            )
        # Kafka cannot read metadata written by a newer version: say so instead of
        # quoting "No MetadataVersion with feature level 27" from the broker log.
        if _version_tuple(formatted_with)[:2] > _version_tuple(settings.kafka_version)[:2]:
            raise BrokerError(
                f"the data in {home / _DATA_DIR} was formatted by Kafka {formatted_with}; "
                f"Kafka {settings.kafka_version} cannot read it. Use Kafka {formatted_with} "
                "or wipe the broker home (its topics are lost)"
            )
        return
    id_file = home / _CLUSTER_ID_FILE
    cluster_id = settings.cluster_id
    if not cluster_id and id_file.is_file():
        cluster_id = id_file.read_text().strip()
    if not cluster_id:
        cluster_id = new_cluster_id()
        write_atomic(id_file, cluster_id + "\n")
    cmd = [
        java,
        "-Xmx256m",
        *QUICK_JVM_FLAGS,
        *_jvm_logging_flags(settings),
        "-cp",
        f"{settings.libs_dir.resolve()}/*",
        _STORAGE_TOOL,
        "format",
        "-t",
        cluster_id,
        "-c",
        str(home / _PROPS_FILE),
        *_scram_arguments(settings),
    ]
    secrets = settings.secrets()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        # str(TimeoutExpired) quotes the command line, SCRAM passwords included.
        reason = _mask(str(exc), secrets)
        where = home / _DATA_DIR
        raise BrokerError(f"formatting Kafka storage in {where} failed: {reason}") from None
    if proc.returncode != 0:
        output = _mask("\n".join((proc.stdout + proc.stderr).splitlines()[-30:]), secrets)
        raise BrokerError(
            f"formatting Kafka storage in {home / _DATA_DIR} failed (exit {proc.returncode}):"
            f"\n{output}"
        )
    write_atomic(
        home / _FORMAT_FILE,
        json.dumps(
            {
                "kafka_version": settings.kafka_version,
                "cluster_id": cluster_id,
                "scram_users": users,
            }
        ),
    )
