"""A real Apache Kafka broker for the local pipeline, started from Maven jars (no Docker).

One JVM runs Kafka in KRaft combined mode (broker and controller, ``node.id=1``,
static quorum) on 127.0.0.1. The jars come from Maven Central through
``infra/kafka/pom.xml`` (locked, with checksums, in ``tokenbudget/localkafka/kafka_resources``)
and are cached outside the repository; the broker's state
lives in ``BrokerSettings.home``::

    home/
      data/                 log.dirs (formatted once by kafka.tools.StorageTool)
      server.properties     rendered from kafka_resources/server.properties.template
      log4j2.properties     copied from kafka_resources/log4j2.properties
      cluster.id            the cluster id the storage was formatted with
      format.json           ... and the Kafka version that formatted it
      broker.pid            pid of the running JVM
      broker.json           what the running JVM was started with (version, ports)
      broker.log            the JVM's stdout+stderr (broker.log.1 = previous run)

``up`` is idempotent and returns the bootstrap address once a metadata request
succeeds (an open port is not readiness). The JVM is detached (own session), so it
outlives the Python process that started it; ``down`` stops it.

With ``BrokerSettings.sasl_ssl`` the broker also opens a SASL_SSL listener (TLS from a
PKCS12 keystore; SCRAM-SHA-256/512 and PLAIN users), for testing secured clients, and
with ``sasl_plaintext`` a SASL_PLAINTEXT one (the same users, no TLS). The PLAINTEXT
listener stays: readiness probes and topic creation use it. SCRAM users are written
into the metadata when the storage is first formatted (StorageTool ``--add-scram``),
so adding users later needs a wiped home. The rendered server.properties then holds
passwords and is written readable by its owner only. ``BrokerSettings.authorizer``
turns Kafka's ACLs on (KRaft's StandardAuthorizer, refusing what no ACL allows); the
PLAINTEXT listener is then a super user's door without a password, on 127.0.0.1.

    python -m tokenbudget.localkafka.broker up|status|down|wipe
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenbudget.core import security
from tokenbudget.core.errors import BrokerError, ConfigError
from tokenbudget.core.files import locked, write_atomic
from tokenbudget.core.kafka_admin import (
    STANDARD_AUTHORIZER,
    TopicSpec,
    check_ready,
    ensure_topics,
    warm_up_groups,
)
from tokenbudget.core.retry import retry_until
from tokenbudget.localkafka import jars as kafka_jars
from tokenbudget.localkafka.java import find_java
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_KAFKA_VERSION = "4.1.1"

_PID_FILE = "broker.pid"
_STATE_FILE = "broker.json"
_LOG_FILE = "broker.log"
_PROPS_FILE = "server.properties"
_LOG4J_FILE = "log4j2.properties"
_CLUSTER_ID_FILE = "cluster.id"
_FORMAT_FILE = "format.json"
_LOCK_FILE = ".lock"
_DATA_DIR = "data"
_MARKER_FILE = "complete.json"
# Everything ``up`` may create in home; ``wipe`` refuses to delete anything else.
_HOME_ENTRIES = {
    _PID_FILE,
    _STATE_FILE,
    _LOG_FILE,
    _LOG_FILE + ".1",
    _PROPS_FILE,
    _LOG4J_FILE,
    _CLUSTER_ID_FILE,
    _FORMAT_FILE,
    _LOCK_FILE,
    _DATA_DIR,
}
_MAIN_CLASS = "kafka.Kafka"
_STORAGE_TOOL = "kafka.tools.StorageTool"

# Popen objects of brokers this process started, kept so they are reaped (no zombie,
# no "subprocess still running" warning) while this process lives.
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def _default_home() -> Path:
    env = os.environ.get("TOKENBUDGET_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tokenbudget" / "broker"


def _default_jars_root() -> Path:
    env = os.environ.get("TOKENBUDGET_JARS")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "tokenbudget"


# Users, passwords and keystore passwords are written into server.properties and
# StorageTool's arguments unquoted: keep them to characters that need no escaping.
_SAFE_TOKEN = re.compile(r"[A-Za-z0-9_.\-]+")


def _check_tokens(values: Mapping[str, str]) -> None:
    """Each value (passwords, by the key that names them) is written unquoted."""
    for key, value in values.items():
        if not _SAFE_TOKEN.fullmatch(value):  # never quote the value itself
            raise ConfigError(key, "use letters, digits, '_', '-' and '.' only")


def _check_users(key: str, users: Mapping[str, str]) -> None:
    """A listener's users (``key``: ``sasl_ssl.users`` ...): names and passwords."""
    _check_tokens({f"{key}.{name}": password for name, password in users.items()})
    for name in users:
        if not _SAFE_TOKEN.fullmatch(name):
            raise ConfigError(key, f"{name!r}: letters, digits, '_-.' only")


@dataclass(frozen=True)
class SaslSslListener:
    """A SASL_SSL listener on 127.0.0.1:``port`` beside the PLAINTEXT one.

    ``keystore`` is a PKCS12 file with the broker's key and certificate. Each of
    ``users`` (name -> password) may log in with SCRAM-SHA-256, SCRAM-SHA-512 or PLAIN.
    With ``truststore`` (PKCS12 CA certificates) clients must also present a
    certificate signed by one of them.
    """

    port: int
    keystore: Path
    keystore_password: str = field(repr=False)
    users: Mapping[str, str] = field(default_factory=dict, repr=False)
    truststore: Path | None = None
    truststore_password: str = field(default="", repr=False)

    def secrets(self) -> list[str]:
        """Every password in here, to mask them in anything we show."""
        values = [self.keystore_password, self.truststore_password, *self.users.values()]
        return [v for v in values if v]

    def check(self) -> None:
        stores = {"sasl_ssl.keystore_password": self.keystore_password}
        if self.truststore is not None:
            stores["sasl_ssl.truststore_password"] = self.truststore_password
        _check_tokens(stores)
        _check_users("sasl_ssl.users", self.users)
        paths = {"sasl_ssl.keystore": self.keystore, "sasl_ssl.truststore": self.truststore}
        for key, path in paths.items():
            if path is not None and not path.is_file():
                raise ConfigError(key, f"{path} is not a file")


@dataclass(frozen=True)
class SaslPlaintextListener:
    """A SASL_PLAINTEXT listener on 127.0.0.1:``port`` beside the PLAINTEXT one: the
    ``users`` log in as with :class:`SaslSslListener` (SCRAM or PLAIN), without TLS,
    so no keystore is needed. For tests of principals and ACLs (:class:`Authorizer`);
    passwords cross the loopback in the clear (PLAIN) or hashed (SCRAM)."""

    port: int
    users: Mapping[str, str] = field(default_factory=dict, repr=False)

    def secrets(self) -> list[str]:
        return [v for v in self.users.values() if v]

    def check(self) -> None:
        _check_users("sasl_plaintext.users", self.users)


@dataclass(frozen=True)
class Authorizer:
    """Kafka's own ACLs on the broker: KRaft's StandardAuthorizer, refusing what no
    ACL allows (``allow.everyone.if.no.acl.found=false``).

    ``super_users`` (user names, such as an admin who applies the ACLs) may do
    anything. So may every client of the PLAINTEXT and CONTROLLER listeners: they
    authenticate no one, so their principal is ``User:ANONYMOUS``, and the broker
    reaches its controller and itself through them; refused, it could not start.
    The PLAINTEXT listener (readiness probes, topic creation in tests) is then a door
    that needs no password: it listens on 127.0.0.1 only, and this is for tests.
    """

    super_users: tuple[str, ...] = ()

    def check(self) -> None:
        for name in self.super_users:
            if not _SAFE_TOKEN.fullmatch(name):
                raise ConfigError(
                    "authorizer.super_users", f"{name!r}: letters, digits, '_-.' only"
                )


@dataclass(frozen=True)
class BrokerSettings:
    """Where and how the local broker runs.

    ``home`` holds the broker's state (see the module docstring); ``jars_root`` the
    jar cache shared by all homes (``<jars_root>/kafka-<version>/libs``).
    """

    home: Path = field(default_factory=_default_home)
    port: int = 9092
    controller_port: int = 9093
    kafka_version: str = DEFAULT_KAFKA_VERSION
    heap_mb: int = 768
    jars_root: Path = field(default_factory=_default_jars_root)
    sasl_ssl: SaslSslListener | None = None  # None: PLAINTEXT only
    sasl_plaintext: SaslPlaintextListener | None = None
    authorizer: Authorizer | None = None  # None: every client may do anything
    # One node of a cluster (tokenbudget.dev.cluster): its id, every controller as
    # ``id@host:port`` ("": this node alone), and the cluster's replication defaults.
    node_id: int = 1
    quorum_voters: str = ""
    replication_factor: int = 1
    min_insync_replicas: int = 1
    cluster_id: str = ""  # "": a new one when the storage is first formatted

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def sasl_ssl_bootstrap(self) -> str | None:
        return f"127.0.0.1:{self.sasl_ssl.port}" if self.sasl_ssl else None

    @property
    def sasl_plaintext_bootstrap(self) -> str | None:
        return f"127.0.0.1:{self.sasl_plaintext.port}" if self.sasl_plaintext else None

    @property
    def sasl_users(self) -> dict[str, str]:
        """Every SASL user of the listeners: SCRAM keeps one password per user, for
        the whole cluster."""
        users: dict[str, str] = {}
        for key, listener in (("sasl_ssl", self.sasl_ssl), ("sasl_plaintext", self.sasl_plaintext)):
            for name, password in (listener.users if listener else {}).items():
                if users.setdefault(name, password) != password:
                    raise ConfigError(
                        f"{key}.users.{name}",
                        "the user has another password on the other listener: give it one",
                    )
        return users

    def secrets(self) -> list[str]:
        """Every password of the listeners, to mask them in anything we show."""
        return [s for lst in (self.sasl_ssl, self.sasl_plaintext) if lst for s in lst.secrets()]

    @property
    def libs_dir(self) -> Path:
        return self.jars_root / f"kafka-{self.kafka_version}" / "libs"

    @property
    def major_version(self) -> int:
        try:
            return int(self.kafka_version.split(".", 1)[0])
        except ValueError:
            raise ConfigError(
                "kafka_version", f"'{self.kafka_version}' is not a Kafka version like 4.1.1"
            ) from None

    @classmethod
    def from_env(cls) -> BrokerSettings:
        """Settings from TOKENBUDGET_HOME, TOKENBUDGET_KAFKA_PORT,
        TOKENBUDGET_KAFKA_CONTROLLER_PORT, TOKENBUDGET_KAFKA_VERSION (and
        TOKENBUDGET_JARS for the jar cache); unset variables keep the defaults."""
        kwargs: dict[str, Any] = {}
        for env, key in (
            ("TOKENBUDGET_KAFKA_PORT", "port"),
            ("TOKENBUDGET_KAFKA_CONTROLLER_PORT", "controller_port"),
        ):
            raw = os.environ.get(env)
            if raw:
                try:
                    value = int(raw)
                except ValueError:
                    raise ConfigError(env, f"'{raw}' is not a port number", source="env") from None
                if not 0 < value < 65536:
                    raise ConfigError(env, f"{value} is not a port number", source="env")
                kwargs[key] = value
        version = os.environ.get("TOKENBUDGET_KAFKA_VERSION")
        if version:
            kwargs["kafka_version"] = version
        return cls(**kwargs)


@dataclass(frozen=True)
class BrokerStatus:
    running: bool
    pid: int | None
    bootstrap: str
    ready: bool
    kafka_version: str
    java: str  # the Java it runs with, or would start with


# --------------------------------------------------------------------------- files


# The broker's run-time files ship inside the package, so a wheel install runs it.
RESOURCES = Path(__file__).resolve().parent / "kafka_resources"


def pom_path() -> Path:
    """The pom that lists the broker's jars: $TOKENBUDGET_POM or infra/kafka/pom.xml."""
    env = os.environ.get("TOKENBUDGET_POM")
    path = Path(env).expanduser() if env else REPO_ROOT / "infra" / "kafka" / "pom.xml"
    if not path.is_file():
        raise BrokerError(
            f"Kafka pom not found at {path}; set TOKENBUDGET_POM to infra/kafka/pom.xml "
            "of a tokenbudget checkout"
        )
    return path


def _infra_file(name: str) -> Path:
    path = RESOURCES / name
    if not path.is_file():
        raise BrokerError(f"{path} is missing: this tokenbudget install is broken; reinstall it")
    return path


def render_properties(settings: BrokerSettings, template: str | None = None) -> str:
    """The broker's server.properties for ``settings``.

    Share-coordinator settings (KIP-932) exist only from Kafka 4.0 and are emitted
    only for major version >= 4.
    """
    if template is None:
        template = _infra_file("server.properties.template").read_text()
    if settings.major_version >= 4:
        extra = (
            "# Share groups' state topic (Kafka 4.x).\n"
            f"share.coordinator.state.topic.replication.factor={settings.replication_factor}\n"
            f"share.coordinator.state.topic.min.isr={settings.min_insync_replicas}\n"
        )
    else:
        extra = "# Kafka 3.x: no share-coordinator settings.\n"
    _check_template(settings, template)
    try:
        return string.Template(template).substitute(
            port=settings.port,
            controller_port=settings.controller_port,
            log_dirs=str(settings.home.resolve() / _DATA_DIR),
            version_specific=extra,
            node_id=settings.node_id,
            quorum_voters=settings.quorum_voters
            or f"{settings.node_id}@127.0.0.1:{settings.controller_port}",
            replication_factor=settings.replication_factor,
            min_insync_replicas=settings.min_insync_replicas,
            authorizer=_authorizer_settings(settings.authorizer),
            **_secure_placeholders(settings),
        )
    except (KeyError, ValueError) as exc:
        raise BrokerError(f"server.properties.template has a bad placeholder: {exc}") from exc


def _check_template(settings: BrokerSettings, template: str) -> None:
    """A template without a placeholder for what ``settings`` asks would silently
    drop it: a broker without its secure listener, or without its authorizer."""
    asked = {
        "secure_listener": settings.sasl_ssl or settings.sasl_plaintext,
        "authorizer": settings.authorizer,
    }
    for placeholder, wanted in asked.items():
        if wanted is not None and f"${{{placeholder}}}" not in template:
            raise BrokerError(
                f"server.properties.template has no {placeholder} placeholder (it is older "
                "than this tokenbudget): use the packaged "
                "tokenbudget/localkafka/kafka_resources/server.properties.template"
            )


_SCRAM_MECHANISMS = ("SCRAM-SHA-256", "SCRAM-SHA-512")


def _sasl_settings(listener: str, users: Mapping[str, str]) -> list[str]:
    """The SASL mechanisms of ``listener`` and how it checks ``users``' passwords."""
    prefix = f"listener.name.{listener.lower()}"
    plain_users = " ".join(f'user_{name}="{pw}"' for name, pw in users.items())
    return [
        f"{prefix}.sasl.enabled.mechanisms=PLAIN,{','.join(_SCRAM_MECHANISMS)}",
        # PLAIN checks passwords against this JAAS entry; SCRAM against the credentials
        # StorageTool wrote into the metadata.
        f"{prefix}.plain.sasl.jaas.config="
        f"org.apache.kafka.common.security.plain.PlainLoginModule required {plain_users};",
        *(
            f"{prefix}.{mechanism.lower()}.sasl.jaas.config="
            "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            for mechanism in _SCRAM_MECHANISMS
        ),
    ]


def _sasl_ssl_settings(listener: SaslSslListener) -> list[str]:
    prefix = "listener.name.sasl_ssl"
    lines = [
        "# SASL_SSL listener (BrokerSettings.sasl_ssl): TLS, then SCRAM or PLAIN.",
        *_sasl_settings("SASL_SSL", listener.users),
        f"{prefix}.ssl.keystore.type=PKCS12",
        f"{prefix}.ssl.keystore.location={listener.keystore.resolve()}",
        f"{prefix}.ssl.keystore.password={listener.keystore_password}",
        f"{prefix}.ssl.key.password={listener.keystore_password}",
    ]
    if listener.truststore is not None:
        lines += [
            f"{prefix}.ssl.client.auth=required",
            f"{prefix}.ssl.truststore.type=PKCS12",
            f"{prefix}.ssl.truststore.location={listener.truststore.resolve()}",
            f"{prefix}.ssl.truststore.password={listener.truststore_password}",
        ]
    else:
        lines.append(f"{prefix}.ssl.client.auth=none")
    return lines


def _secure_placeholders(settings: BrokerSettings) -> dict[str, str]:
    """The template's secure_* values: empty strings without a SASL listener."""
    listeners: list[tuple[str, int, list[str]]] = []
    if settings.sasl_ssl is not None:
        settings.sasl_ssl.check()
        listeners.append(
            ("SASL_SSL", settings.sasl_ssl.port, _sasl_ssl_settings(settings.sasl_ssl))
        )
    if settings.sasl_plaintext is not None:
        plain = settings.sasl_plaintext
        plain.check()
        lines = [
            "# SASL_PLAINTEXT listener (BrokerSettings.sasl_plaintext): SCRAM or PLAIN, no TLS.",
            *_sasl_settings("SASL_PLAINTEXT", plain.users),
        ]
        listeners.append(("SASL_PLAINTEXT", plain.port, lines))
    addresses = "".join(f",{name}://127.0.0.1:{port}" for name, port, _ in listeners)
    return {
        "secure_listener": addresses,
        "secure_advertised": addresses,
        "secure_protocol": "".join(f",{name}:{name}" for name, _, _ in listeners),
        "secure_settings": "".join("\n".join(lines) + "\n" for _, _, lines in listeners),
    }


def _authorizer_settings(authorizer: Authorizer | None) -> str:
    if authorizer is None:
        return "# No authorizer (BrokerSettings.authorizer): every client may do anything.\n"
    authorizer.check()
    # The PLAINTEXT and CONTROLLER listeners' clients, the broker itself among them.
    supers = ["User:ANONYMOUS", *(f"User:{name}" for name in authorizer.super_users)]
    return (
        f"authorizer.class.name={STANDARD_AUTHORIZER}\n"
        "allow.everyone.if.no.acl.found=false\n"
        f"super.users={';'.join(supers)}\n"
    )


def _scram_arguments(settings: BrokerSettings) -> list[str]:
    """StorageTool ``--add-scram`` arguments creating every user for both SCRAM hashes."""
    args = []
    for name, password in settings.sasl_users.items():
        for mechanism in _SCRAM_MECHANISMS:
            args += ["--add-scram", f"{mechanism}=[name={name},password={password}]"]
    return args


def _mask(text: str, secrets: Sequence[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, security.MASK)
    return text


def _jvm_logging_flags(settings: BrokerSettings) -> list[str]:
    return [f"-Dlog4j2.configurationFile={settings.home.resolve() / _LOG4J_FILE}"]


def broker_command(settings: BrokerSettings, java: str = "java") -> list[str]:
    """The command line of the broker JVM (what kafka-server-start.sh would run)."""
    home = settings.home.resolve()
    return [
        java,
        f"-Xmx{settings.heap_mb}m",
        f"-Xms{settings.heap_mb}m",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-XX:InitiatingHeapOccupancyPercent=35",
        "-XX:+ExplicitGCInvokesConcurrent",
        "-Djava.awt.headless=true",
        *_jvm_logging_flags(settings),
        "-cp",
        f"{settings.libs_dir.resolve()}/*",
        _MAIN_CLASS,
        str(home / _PROPS_FILE),
    ]


def _tail(path: Path, lines: int = 40) -> str:
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return f"(no {path})"
    return "\n".join(data.splitlines()[-lines:])


# --------------------------------------------------------------------------- jars


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


# --------------------------------------------------------------------------- processes


def _reap(pid: int) -> None:
    child = _CHILDREN.get(pid)
    if child is not None:
        if child.poll() is not None:
            _CHILDREN.pop(pid, None)
        return
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _alive(pid: int) -> bool:
    _reap(pid)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust kill(0)
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


def _is_our_broker(pid: int, settings: BrokerSettings) -> bool:
    if not _alive(pid):
        return False
    cmd = _cmdline(pid)
    if cmd is None:
        return not Path("/proc").is_dir()  # cannot tell without /proc: trust the pid file
    props = str(settings.home.resolve() / _PROPS_FILE)
    return _MAIN_CLASS in cmd and props in cmd


def _find_orphan(settings: BrokerSettings) -> int | None:
    """A broker JVM running on this home whose pid file was lost."""
    props = str(settings.home.resolve() / _PROPS_FILE)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        cmd = _cmdline(int(entry))
        if cmd and _MAIN_CLASS in cmd and props in cmd and _alive(int(entry)):
            return int(entry)
    return None


def running_pid(settings: BrokerSettings) -> int | None:
    """The pid of the broker JVM running on ``settings.home``, if one runs."""
    return _running_pid(settings)


def _running_pid(settings: BrokerSettings) -> int | None:
    pid_file = settings.home / _PID_FILE
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        pid = None
    if pid is not None and _is_our_broker(pid, settings):
        return pid
    if not settings.home.is_dir():
        return None
    orphan = _find_orphan(settings)
    if orphan is not None:
        write_atomic(pid_file, f"{orphan}\n")
    return orphan


def _read_state(settings: BrokerSettings) -> dict[str, Any]:
    try:
        return dict(json.loads((settings.home / _STATE_FILE).read_text()))
    except (OSError, ValueError, TypeError):
        return {}


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


def _split_bootstrap(bootstrap: str) -> tuple[str, int]:
    first = bootstrap.split(",")[0].strip()
    host, _, port = first.rpartition(":")
    return host or "127.0.0.1", int(port)


def _signal_and_wait(pid: int, timeout: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid):
        log.warning("broker pid %d ignored SIGTERM for %.0fs; killing it", pid, timeout)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    _CHILDREN.pop(pid, None)


# --------------------------------------------------------------------------- readiness


def wait_ready(
    bootstrap: str,
    timeout: float,
    *,
    pid: int | None = None,
    log_path: Path | None = None,
) -> None:
    """Block until Kafka at ``bootstrap`` is ready (:func:`check_ready`).

    With ``pid``, fail as soon as that process dies; ``log_path`` (the broker log) is
    quoted in the error.
    """
    host, port = _split_bootstrap(bootstrap)
    deadline = time.monotonic() + timeout

    def quoted_log() -> str:
        tail = _tail(log_path) if log_path else ""
        return f"; last lines of {log_path}:\n{tail}" if log_path else ""

    def attempt() -> None:
        # Only talk Kafka once something listens: keeps kafka-python's connection
        # errors out of the logs while the JVM boots.
        if not _port_open(host, port):
            raise ConnectionRefusedError(f"nothing listens on {host}:{port}")
        check_ready(bootstrap, min(max(0.0, deadline - time.monotonic()), 5.0))

    def exited(_: BaseException) -> None:
        if pid is not None and not _alive(pid):
            raise BrokerError(
                f"the Kafka broker (pid {pid}) exited before it was ready at {bootstrap}"
                + quoted_log()
            )

    def not_ready(last: BaseException) -> BrokerError:
        exited(last)
        return BrokerError(
            f"Kafka at {bootstrap} not ready after {timeout:.0f}s (last error: {last!r})"
            + quoted_log()
        )

    retry_until(attempt, timeout=timeout, on_retry=exited, give_up=not_ready)


# --------------------------------------------------------------------------- lifecycle


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


def _check_ports(settings: BrokerSettings) -> None:
    ports = [
        ("port", settings.port, "TOKENBUDGET_KAFKA_PORT"),
        ("controller_port", settings.controller_port, "TOKENBUDGET_KAFKA_CONTROLLER_PORT"),
    ]
    if settings.sasl_ssl is not None:
        ports.append(("sasl_ssl.port", settings.sasl_ssl.port, "BrokerSettings.sasl_ssl"))
    if settings.sasl_plaintext is not None:
        port = settings.sasl_plaintext.port
        ports.append(("sasl_plaintext.port", port, "BrokerSettings.sasl_plaintext"))
    for name, port, env in ports:
        if not _port_free(port):
            raise BrokerError(
                f"127.0.0.1:{port} ({name}) is in use by another process, not the tokenbudget "
                f"broker of {settings.home}; stop that process or choose another port ({env})"
            )


def _start(settings: BrokerSettings, java: str, described: str = "") -> int:
    home = settings.home.resolve()
    log_path = home / _LOG_FILE
    if log_path.exists():
        os.replace(log_path, home / (_LOG_FILE + ".1"))
    with log_path.open("ab") as out:
        proc = subprocess.Popen(
            broker_command(settings, java),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=home,
            start_new_session=True,
            close_fds=True,
        )
    _CHILDREN[proc.pid] = proc
    write_atomic(home / _PID_FILE, f"{proc.pid}\n")
    state = {
        "pid": proc.pid,
        **_started_with(settings),
        "java": described or java,
        "started_at": time.time(),
    }
    write_atomic(home / _STATE_FILE, json.dumps(state, indent=1))
    return proc.pid


def _started_with(settings: BrokerSettings) -> dict[str, Any]:
    """What a running broker must have been started with to be the one ``settings``
    asks for (recorded in broker.json)."""
    return {
        "kafka_version": settings.kafka_version,
        "port": settings.port,
        "controller_port": settings.controller_port,
        "sasl_ssl_port": settings.sasl_ssl.port if settings.sasl_ssl else None,
        "sasl_plaintext_port": settings.sasl_plaintext.port if settings.sasl_plaintext else None,
        "super_users": list(settings.authorizer.super_users) if settings.authorizer else None,
    }


def _check_started_as_asked(settings: BrokerSettings, pid: int) -> None:
    state = _read_state(settings)
    asked = _started_with(settings)
    # A broker.json written before a setting existed: the broker ran without it.
    started = {
        key: state.get(key, None if key.startswith(("sasl", "super")) else value)
        for key, value in asked.items()
    }
    if started != asked:
        differ = ", ".join(
            f"{key} {started[key]} (asked: {asked[key]})"
            for key in asked
            if started[key] != asked[key]
        )
        raise BrokerError(
            f"the broker of {settings.home.resolve()} (pid {pid}) runs with {differ}; "
            "run down first"
        )


def launch(settings: BrokerSettings) -> int:
    """Start the broker JVM of ``settings`` detached, without waiting for it: fetch
    the jars, render the properties, format the storage on first use. Returns its pid.
    The caller holds the home's lock (or owns the home, as a cluster node does)."""
    home = settings.home.resolve()
    _check_ports(settings)
    runtime = find_java()
    java = runtime.path
    ensure_jars(settings)
    # With a SASL listener the file holds passwords: owner only.
    mode = 0o600 if settings.secrets() else 0o666
    write_atomic(home / _PROPS_FILE, render_properties(settings), mode)
    shutil.copyfile(_infra_file(_LOG4J_FILE), home / _LOG4J_FILE)
    _format_storage(settings, java)
    pid = _start(settings, java, runtime.describe())
    log.info(
        "started Kafka %s (pid %d) on %s with %s",
        settings.kafka_version,
        pid,
        settings.bootstrap,
        runtime.describe(),
    )
    return pid


def up(
    settings: BrokerSettings,
    topics: Sequence[TopicSpec] | None = None,
    *,
    timeout: float = 90,
) -> str:
    """Make sure the broker of ``settings`` runs and is ready, and the topics exist.

    Idempotent: a broker already running on this home is only waited for. Otherwise
    fetch the jars, render the properties, format the storage on first use, start the
    JVM detached, wait for a metadata request to succeed and create ``topics``
    (default: the default namespace's ``Topics().specs()``). Returns the bootstrap address.
    """
    specs = Topics().specs() if topics is None else list(topics)
    home = settings.home
    home.mkdir(parents=True, exist_ok=True)
    home = home.resolve()
    with locked(home / _LOCK_FILE):
        pid = _running_pid(settings)
        if pid is not None:
            _check_started_as_asked(settings, pid)
            wait_ready(settings.bootstrap, timeout, pid=pid, log_path=home / _LOG_FILE)
        else:
            launched = time.monotonic()
            pid = launch(settings)
            try:
                wait_ready(settings.bootstrap, timeout, pid=pid, log_path=home / _LOG_FILE)
            except BrokerError:
                if _alive(pid):  # timed out: do not leave a half-started JVM behind
                    _signal_and_wait(pid, 10)
                    (home / _PID_FILE).unlink(missing_ok=True)
                raise
            log.info(
                "Kafka %s ready on %s %.1fs after launch",
                settings.kafka_version,
                settings.bootstrap,
                time.monotonic() - launched,
            )
    ensure_topics(settings.bootstrap, specs)
    warm_up_groups(settings.bootstrap)
    return settings.bootstrap


def status(settings: BrokerSettings) -> BrokerStatus:
    """Whether the broker of ``settings.home`` runs, and answers metadata requests."""
    pid = _running_pid(settings)
    version = settings.kafka_version
    ready = False
    java = _java_to_start()
    if pid is not None:
        version = _read_state(settings).get("kafka_version", version)
        java = _read_state(settings).get("java", java)
        try:
            check_ready(settings.bootstrap, 3.0)
            ready = True
        except Exception:
            ready = False
    return BrokerStatus(
        running=pid is not None,
        pid=pid,
        bootstrap=settings.bootstrap,
        ready=ready,
        kafka_version=version,
        java=java,
    )


def _java_to_start() -> str:
    try:
        return find_java().describe()
    except BrokerError as exc:
        return f"none: {exc}"


def down(settings: BrokerSettings, *, timeout: float = 30) -> bool:
    """Stop the broker (SIGTERM, SIGKILL after ``timeout``). True if it was running."""
    if not settings.home.is_dir():
        return False
    with locked(settings.home / _LOCK_FILE):
        pid = _running_pid(settings)
        if pid is not None:
            _signal_and_wait(pid, timeout)
        (settings.home / _PID_FILE).unlink(missing_ok=True)
    return pid is not None


def wipe(settings: BrokerSettings) -> None:
    """Stop the broker and delete its home (data included). For tests."""
    down(settings)
    home = settings.home
    if not home.exists():
        return
    resolved = home.resolve()
    if resolved in (Path("/"), Path.home().resolve()):
        raise BrokerError(f"refusing to delete {resolved}")
    strangers = sorted(
        p.name
        for p in resolved.iterdir()
        if p.name not in _HOME_ENTRIES and not p.name.startswith(".")
    )
    if strangers:
        raise BrokerError(
            f"refusing to delete {resolved}: it holds files the broker did not create "
            f"({', '.join(strangers[:5])})"
        )
    shutil.rmtree(resolved)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokenbudget.localkafka.broker",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("command", choices=["up", "status", "down", "wipe", "jars"])
    parser.add_argument("--timeout", type=float, default=90)
    parser.add_argument("--no-topics", action="store_true", help="up: create no topics")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kafka").setLevel(logging.ERROR)
    settings = BrokerSettings.from_env()
    try:
        if args.command == "up":
            t0 = time.monotonic()
            bootstrap = up(settings, [] if args.no_topics else None, timeout=args.timeout)
            print(f"{bootstrap} ready in {time.monotonic() - t0:.1f}s")
        elif args.command == "status":
            print(json.dumps(status(settings).__dict__))
        elif args.command == "down":
            print("stopped" if down(settings, timeout=args.timeout) else "not running")
        elif args.command == "wipe":
            wipe(settings)
        elif args.command == "jars":
            print(ensure_jars(settings))
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
