"""What the local broker's JVM runs from: its server.properties, rendered from the
packaged template (its SASL listeners and their users, its authorizer), the SCRAM
users StorageTool writes, and the JVM's command line; the pom that lists its jars."""

from __future__ import annotations

import os
import string
from collections.abc import Mapping, Sequence
from pathlib import Path

from tokenbudget.core import security
from tokenbudget.core.errors import BrokerError
from tokenbudget.core.kafka_acls import STANDARD_AUTHORIZER
from tokenbudget.localkafka.settings import (
    _DATA_DIR,
    _LOG4J_FILE,
    _MAIN_CLASS,
    _PROPS_FILE,
    Authorizer,
    BrokerSettings,
    SaslSslListener,
)

REPO_ROOT = Path(__file__).resolve().parents[2]

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


_SERVER_JVM_FLAGS = (
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
)
# Most of a JVM's first seconds go to C2 compiling code it will barely run again: a
# one-shot tool (the storage format) or a broker that lives minutes does with C1.
QUICK_JVM_FLAGS = ("-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-XX:-UsePerfData")


def _jvm_logging_flags(settings: BrokerSettings) -> list[str]:
    return [f"-Dlog4j2.configurationFile={settings.home.resolve() / _LOG4J_FILE}"]


def broker_command(settings: BrokerSettings, java: str = "java") -> list[str]:
    """The command line of the broker JVM (what kafka-server-start.sh would run)."""
    home = settings.home.resolve()
    return [
        java,
        f"-Xmx{settings.heap_mb}m",
        f"-Xms{settings.heap_mb}m",
        *(QUICK_JVM_FLAGS if settings.quick_start else _SERVER_JVM_FLAGS),
        "-Djava.awt.headless=true",
        *_jvm_logging_flags(settings),
        "-cp",
        f"{settings.libs_dir.resolve()}/*",
        _MAIN_CLASS,
        str(home / _PROPS_FILE),
    ]
