"""Where and how the local broker runs: :class:`BrokerSettings` (its home, ports,
Kafka version, jar cache, node of a cluster), its optional SASL listeners and
authorizer, checked before anything is written, :class:`BrokerStatus`, and the names
of the files its home holds (the layout is drawn in :mod:`tokenbudget.localkafka.broker`)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenbudget.core.errors import ConfigError

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
    # A broker that lives minutes (tests, benches, dev clusters) starts on about half
    # the CPU with the client JIT alone (C1) and the serial collector; a job's broker,
    # up for hours, keeps the server JIT and G1 (bench/broker_start.py).
    quick_start: bool = False
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
