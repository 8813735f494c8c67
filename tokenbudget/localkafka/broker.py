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
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenbudget.core.errors import BrokerError
from tokenbudget.core.files import locked, write_atomic
from tokenbudget.core.kafka_admin import TopicSpec, check_ready, ensure_topics, warm_up_groups
from tokenbudget.localkafka.java import find_java
from tokenbudget.localkafka.process import (
    _CHILDREN,
    _alive,
    _port_free,
    _read_state,
    _running_pid,
    _signal_and_wait,
    wait_ready,
)
from tokenbudget.localkafka.properties import _infra_file, broker_command, render_properties
from tokenbudget.localkafka.settings import (
    _HOME_ENTRIES,
    _LOCK_FILE,
    _LOG4J_FILE,
    _LOG_FILE,
    _PID_FILE,
    _PROPS_FILE,
    _STATE_FILE,
    BrokerSettings,
    BrokerStatus,
)
from tokenbudget.localkafka.storage import _format_storage, ensure_jars
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)


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
