"""Topic administration every Kafka client of ours needs, on any cluster.

``ensure_topics`` creates a namespace's topics up front (Faust does not consume a
topic that appears after its worker started) and refuses existing ones that would
break the pipeline: a different partition count (Faust needs source topics and
table changelogs to match) or fewer replicas than asked (a lost broker would lose
their data; the error writes the ``kafka-reassign-partitions.sh`` plan). An existing
topic whose ``max.message.bytes`` is below what the spec asks (a namespace made by an
older version: the broker's 1 MB) is raised with an incremental alter-config, and a
cluster that refuses it, or whose requests are capped below a message, is a
:class:`KafkaLimitsError` naming the setting and the fix. ``check_ready``
is the one test of a cluster being ready (``wait_ready`` waits for it), and
``warm_up_groups`` makes its group coordinator ready.

kafka-python's blocking admin client does this work: it runs before any event loop
(the CLI, the runner's start-up), and aiokafka's admin client lacks DescribeConfigs
filters and ``wait_for_topics``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafka.admin import AlterConfigOp, ConfigResource, ConfigResourceType, KafkaAdminClient
from kafka.errors import KafkaError

from tokenbudget.core import security, sizes
from tokenbudget.core.errors import BrokerError, KafkaAuthError, KafkaLimitsError
from tokenbudget.core.files import write_atomic
from tokenbudget.core.kafka import client_options, kafka_python_options
from tokenbudget.core.retry import retry_until

log = logging.getLogger(__name__)

# How long a command waits at start for an existing cluster that does not answer.
STARTUP_WAIT_S = 60.0

DEFAULT_PARTITIONS = 4

# kafka-python's own request and bootstrap timeouts, for the calls that never set theirs.
_CLIENT_DEFAULT_TIMEOUT_MS = 30_000


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int = DEFAULT_PARTITIONS
    configs: dict[str, str] = field(default_factory=dict)
    replication_factor: int = -1  # -1: the cluster's default.replication.factor


class _Admin(KafkaAdminClient):  # type: ignore[misc]
    """kafka-python 3.0.12 leaves its IO thread (kafka-io-<client_id>) and socket
    behind when bootstrapping in ``__init__`` fails; every failed readiness probe
    would leak one. Stop them before re-raising."""

    def __init__(self, **configs: Any) -> None:
        try:
            super().__init__(**configs)
        except Exception:
            for attr, method in (("_client", "close"), ("_net", "stop"), ("_metrics", "close")):
                stop = getattr(getattr(self, attr, None), method, None)
                if stop is not None:
                    with contextlib.suppress(Exception):
                        stop()
            raise

    def bootstrap_brokers(self) -> int:
        """How many brokers the metadata the client bootstrapped with lists, asking no
        request more: kafka-python logs an ERROR (into a run's output) when a close
        cancels a metadata refresh in flight, which was seen when a request of ours
        came just before the close."""
        return len(self._client.cluster.brokers())


def admin_client(bootstrap: str, timeout_ms: int = 10_000) -> Any:
    """A kafka-python admin client of ``bootstrap`` (every admin call here goes
    through one: a failed connection leaks nothing)."""
    return _Admin(
        **kafka_python_options({**client_options(bootstrap), "client_id": "tokenbudget-broker"}),
        request_timeout_ms=timeout_ms,
        bootstrap_timeout_ms=timeout_ms,
    )


def connect_error(bootstrap: str, exc: BaseException) -> BrokerError | KafkaAuthError:
    refused = security.auth_failure(bootstrap, exc)
    if refused is not None:
        return refused
    return BrokerError(f"cannot reach Kafka at {bootstrap}: {exc!r}")


def check_ready(bootstrap: str, timeout: float, *, brokers: int = 1) -> None:
    """Raise unless Kafka at ``bootstrap`` is ready: a metadata request succeeds and
    lists at least ``brokers`` brokers. The one meaning of "ready" (a port that
    accepts connections is not: a broker opens it before it can answer). Raises
    :class:`BrokerError`, or :class:`KafkaAuthError` when the broker refuses us."""
    try:
        admin = admin_client(bootstrap, timeout_ms=max(500, int(timeout * 1000)))
    except (KafkaError, OSError) as exc:
        raise connect_error(bootstrap, exc) from exc
    try:
        listed = admin.bootstrap_brokers()
    finally:
        admin.close()
    if listed < brokers:
        raise BrokerError(f"metadata from {bootstrap} lists {listed} of {brokers} brokers yet")


def wait_ready(
    bootstrap: str, timeout: float = STARTUP_WAIT_S, *, brokers: int = 1, interval: float = 2.0
) -> None:
    """Return once Kafka at ``bootstrap`` is ready (:func:`check_ready`), asking again
    every ``interval`` seconds; raise its last :class:`BrokerError` if it is not
    within ``timeout`` seconds."""

    def warn(exc: BaseException) -> None:
        log.warning("Kafka at %s is not ready (%s); trying again", bootstrap, exc)

    # One look takes at most as long as the whole wait may (kafka-python's own
    # timeout otherwise: 30 s).
    look = min(_CLIENT_DEFAULT_TIMEOUT_MS / 1000, timeout)
    retry_until(
        functools.partial(check_ready, bootstrap, look, brokers=brokers),
        timeout=timeout,
        retry_on=BrokerError,
        interval=interval,
        on_retry=warn,
    )


# A broker refuses a request larger than this (a static broker setting), whatever
# the topic allows.
_REQUEST_LIMIT = "socket.request.max.bytes"


def _broker_settings(admin: Any) -> dict[str, int] | None:
    """The cluster's ``default.replication.factor`` and request limit (from its
    first broker), or None when they may not be read (a user without
    DescribeConfigs): topics are then created with replication -1, "the broker's
    default", and neither is checked."""
    keys = ("default.replication.factor", _REQUEST_LIMIT)
    try:
        brokers = admin.describe_cluster()["brokers"]
        node = str(brokers[0]["broker_id"])
        resource = ConfigResource(ConfigResourceType.BROKER, node, configs=dict.fromkeys(keys))
        described = admin.describe_configs([resource], config_filter="all")
        return {key: int(described["broker"][node][key]["value"]) for key in keys}
    except (KafkaError, LookupError, TypeError, ValueError) as exc:
        log.warning("cannot read the cluster's %s (%r)", " and ".join(keys), exc)
        return None


def _check_request_limit(bootstrap: str, settings: dict[str, int] | None) -> None:
    limit = (settings or {}).get(_REQUEST_LIMIT)
    # a request holds one message and its headers
    if limit is not None and limit < sizes.MESSAGE_BYTES + 64 * 1024:
        raise KafkaLimitsError(
            f"the brokers at {bootstrap} refuse requests over {_REQUEST_LIMIT} = {limit:,} "
            f"bytes, but tokenbudget sends messages of up to {sizes.MESSAGE_BYTES:,} bytes; "
            f"fix: set {_REQUEST_LIMIT} to at least {2 * sizes.MESSAGE_BYTES} in every "
            "broker's server.properties (Kafka's default is 104857600) and restart them"
        )


def _wanted_replication(spec: TopicSpec, default: int | None) -> int:
    if spec.replication_factor > 0:
        return spec.replication_factor
    return default if default is not None else -1


def refused(bootstrap: str, doing: str, why: str, fix: str) -> KafkaAuthError:
    """The cluster's authorizer refusing the user we log in as ``doing`` (``why``:
    Kafka's error, ``fix``: what to do)."""
    settings = security.security_for(bootstrap)
    login = settings.login()
    who = f"user {login.username!r}" if login is not None else "this client"
    return KafkaAuthError(
        f"the Kafka cluster at {bootstrap} does not let {who} {doing} ({why}): {fix}",
        keys=settings.auth_keys(),
    )


def _create_topics(
    admin: Any, bootstrap: str, specs: Sequence[TopicSpec], default: int | None, timeout_ms: int
) -> list[str]:
    """Create ``specs``; the names this call created (others raced us to it)."""
    result = admin.create_topics(
        {
            spec.name: {
                "num_partitions": spec.partitions,
                "replication_factor": _wanted_replication(spec, default),
                "configs": {k: str(v) for k, v in spec.configs.items()},
            }
            for spec in specs
        },
        timeout_ms=timeout_ms,
        raise_errors=False,
    )
    denied = sorted(t["name"] for t in result.get("topics", []) if t.get("error_code") == 29)
    if denied:  # TOPIC_AUTHORIZATION_FAILED
        raise refused(
            bootstrap,
            f"create topics {', '.join(denied)}",
            "TopicAuthorizationFailed",
            "create them as the operator role, whose ACLs allow it (`tokenbudget acls "
            "--config F` prints them)",
        )
    raced, failed = set(), []
    for topic in result.get("topics", []):
        code = topic.get("error_code", 0)
        if code == 36:  # TOPIC_ALREADY_EXISTS: created concurrently
            raced.add(topic["name"])
        elif code != 0:
            failed.append(f"{topic['name']}: error {code} {topic.get('error_message')}")
    if failed and any(sizes.MESSAGE_BYTES_CONFIG in f for f in failed):
        raise KafkaLimitsError(
            f"creating topics on {bootstrap} failed: {'; '.join(failed)}; tokenbudget's "
            f"topics need {sizes.MESSAGE_BYTES_CONFIG} = {sizes.MESSAGE_BYTES} (a message "
            "holds a prompt and its answer): fix: allow it for these topics on the cluster "
            "(a managed cluster's plan may cap it), or create them with it yourself"
        )
    if failed:
        raise BrokerError(f"creating topics on {bootstrap} failed: {'; '.join(failed)}")
    created = [spec.name for spec in specs if spec.name not in raced]
    admin.wait_for_topics(created, timeout_ms=timeout_ms)
    log.info("created topics %s", ", ".join(created))
    return created


def reassignment_plan(
    topics: Sequence[dict[str, Any]], brokers: Sequence[int], replication: int
) -> dict[str, Any]:
    """A ``kafka-reassign-partitions.sh`` plan that raises every partition of
    ``topics`` (as describe_topics returns them) to ``replication`` replicas, keeping
    the current ones first and spreading the new ones over ``brokers``."""
    partitions = []
    for topic in topics:
        for part in sorted(topic["partitions"], key=lambda p: p["partition_index"]):
            replicas = list(part["replica_nodes"])
            spare = [b for b in brokers if b not in replicas]
            shift = part["partition_index"] % len(spare) if spare else 0
            spare = spare[shift:] + spare[:shift]
            replicas += spare[: max(0, replication - len(replicas))]
            partitions.append(
                {"topic": topic["name"], "partition": part["partition_index"], "replicas": replicas}
            )
    return {"version": 1, "partitions": partitions}


def _check_existing(
    admin: Any, bootstrap: str, specs: Sequence[TopicSpec], default: int | None
) -> None:
    """Topics that exist already must have the spec's partitions (Faust needs source
    topics and table changelogs to match) and at least the replicas asked for."""
    described = {t["name"]: t for t in admin.describe_topics([s.name for s in specs])}
    wrong, thin = [], []
    for spec in specs:
        topic = described.get(spec.name)
        if topic is None or topic.get("error_code", 0) != 0:
            continue
        parts = topic.get("partitions") or []
        if len(parts) != spec.partitions:
            wrong.append(f"{spec.name} has {len(parts)} partitions, wants {spec.partitions}")
        replication = _wanted_replication(spec, default)
        if replication > 0 and min(len(p["replica_nodes"]) for p in parts) < replication:
            thin.append((topic, replication))
    if wrong:
        raise BrokerError(
            "existing topics have the wrong partition count (Faust needs source topics "
            "and table changelogs to match): " + "; ".join(wrong) + ". Delete those "
            "topics, set [kafka] partitions to match, or wipe the broker home."
        )
    if thin:
        raise _under_replicated(admin, bootstrap, thin)


def _under_replicated(
    admin: Any, bootstrap: str, thin: list[tuple[dict[str, Any], int]]
) -> BrokerError:
    brokers = sorted(b["broker_id"] for b in admin.describe_cluster()["brokers"])
    replication = max(r for _, r in thin)
    plan = reassignment_plan([t for t, _ in thin], brokers, replication)
    path = Path(tempfile.gettempdir()) / f"tokenbudget-reassign-{os.getpid()}.json"
    write_atomic(path, json.dumps(plan, indent=1) + "\n")
    names = ", ".join(
        f"{t['name']} ({min(len(p['replica_nodes']) for p in t['partitions'])} < {r})"
        for t, r in thin
    )
    return BrokerError(
        f"existing topics have fewer replicas than asked: {names}; a lost broker would "
        f"lose their data. Raise them with: kafka-reassign-partitions.sh --bootstrap-server "
        f"{bootstrap} --reassignment-json-file {path} --execute (the plan is written "
        "there), or lower [kafka] replication_factor"
    )


def ensure_topics(bootstrap: str, specs: Sequence[TopicSpec], *, timeout: float = 30) -> None:
    """Create the missing topics (the spec's partitions, replication and configs; a
    replication of -1 is the cluster's ``default.replication.factor``).

    Existing topics are left as they are, except that a partition count different from
    the spec, or fewer replicas than asked, raises BrokerError naming the fix, and a
    ``max.message.bytes`` below the spec's is raised to it (KafkaLimitsError when the
    cluster refuses).
    """
    wanted: dict[str, TopicSpec] = {}
    for spec in specs:
        if spec.name in wanted and wanted[spec.name] != spec:
            raise BrokerError(f"topic {spec.name} is specified twice, differently")
        wanted[spec.name] = spec
    if not wanted:
        return

    timeout_ms = int(timeout * 1000)
    try:
        admin = admin_client(bootstrap, timeout_ms=timeout_ms)
    except (KafkaError, OSError) as exc:
        raise connect_error(bootstrap, exc) from exc
    try:
        settings = _broker_settings(admin)
        _check_request_limit(bootstrap, settings)
        default = settings["default.replication.factor"] if settings else None
        existing = set(admin.list_topics()) & set(wanted)
        missing = [spec for name, spec in wanted.items() if name not in existing]
        if missing:
            created = _create_topics(admin, bootstrap, missing, default, timeout_ms)
            existing |= {spec.name for spec in missing} - set(created)
        if existing:
            _check_existing(admin, bootstrap, [wanted[n] for n in sorted(existing)], default)
            _raise_message_limits(admin, bootstrap, [wanted[n] for n in sorted(existing)])
    except KafkaError as exc:
        refused = security.auth_failure(bootstrap, exc)
        if refused is not None:  # e.g. a user without the right to create topics
            raise refused from exc
        raise BrokerError(f"managing topics on {bootstrap} failed: {exc!r}") from exc
    finally:
        admin.close()


def message_limits(admin: Any, names: Sequence[str]) -> dict[str, int]:
    """Each topic's effective ``max.message.bytes`` (its own, or the broker's
    ``message.max.bytes`` it inherits)."""
    described = admin.describe_configs(
        [
            ConfigResource(
                ConfigResourceType.TOPIC, name, configs={sizes.MESSAGE_BYTES_CONFIG: None}
            )
            for name in names
        ],
        config_filter="all",
    )
    topics = described.get("topic", {})
    return {
        name: int(topics[name][sizes.MESSAGE_BYTES_CONFIG]["value"])
        for name in names
        if sizes.MESSAGE_BYTES_CONFIG in topics.get(name, {})
    }


def _raise_message_limits(admin: Any, bootstrap: str, specs: Sequence[TopicSpec]) -> None:
    """Raise the ``max.message.bytes`` of existing topics that allow less than their
    spec (incrementally: their other settings stay as they are)."""
    key = sizes.MESSAGE_BYTES_CONFIG
    asked = {s.name: int(s.configs[key]) for s in specs if key in s.configs}
    if not asked:
        return
    try:
        current = message_limits(admin, list(asked))
    except (KafkaError, LookupError, TypeError, ValueError) as exc:
        log.warning("cannot read the %s of existing topics (%r)", key, exc)
        return
    low = {name: limit for name, limit in current.items() if limit < asked[name]}
    if not low:
        return
    resources = [
        ConfigResource(
            ConfigResourceType.TOPIC, name, configs={key: (AlterConfigOp.SET, str(asked[name]))}
        )
        for name in low
    ]
    try:
        results = admin.alter_configs(resources, raise_on_unknown=False, incremental=True)
        refused = {n: r for n, r in results.get("topic", {}).items() if r != "OK"}
    except KafkaError as exc:
        refused = {name: repr(exc) for name in low}
    if refused:
        names = ", ".join(f"{name} ({low[name]:,} bytes: {why})" for name, why in refused.items())
        raise KafkaLimitsError(
            f"existing topics accept messages smaller than tokenbudget sends, and raising "
            f"their {key} to {sizes.MESSAGE_BYTES} was refused: {names}; fix: grant "
            f"AlterConfigs on them, or run kafka-configs.sh --bootstrap-server {bootstrap} "
            f"--alter --entity-type topics --entity-name <topic> --add-config "
            f"{key}={sizes.MESSAGE_BYTES} for each"
        )
    # The brokers apply a config change from the metadata log a moment later: a
    # producer started before then would still be refused.
    deadline = time.monotonic() + 30
    while any(v < asked[n] for n, v in message_limits(admin, list(low)).items()):
        if time.monotonic() > deadline:
            raise KafkaLimitsError(
                f"raising {key} of {', '.join(sorted(low))} to {sizes.MESSAGE_BYTES} was "
                "accepted but not applied within 30 s; fix: check the brokers' logs, then "
                "run again"
            )
        time.sleep(0.2)
    log.warning(
        "raised %s of %s to %d (made before this version, with the broker's default)",
        key,
        ", ".join(sorted(low)),
        sizes.MESSAGE_BYTES,
    )


def warm_up_groups(bootstrap: str, timeout: float = 20) -> None:
    """Have the broker create __consumer_offsets now (FindCoordinator does it).

    Otherwise the first consumer group (a Faust worker) gets
    GroupCoordinatorNotAvailableError while the topic is being created. Best effort.
    """
    try:
        admin = admin_client(bootstrap, timeout_ms=int(timeout * 1000))
    except KafkaError as exc:
        log.warning("cannot reach %s to warm up the group coordinator: %r", bootstrap, exc)
        return
    try:
        retry_until(
            lambda: admin.describe_groups(["tokenbudget-broker-warmup"]),
            timeout=timeout,
            retry_on=KafkaError,
        )
    except KafkaError as exc:
        log.warning("group coordinator of %s not available yet: %r", bootstrap, exc)
    finally:
        admin.close()


@dataclass(frozen=True)
class TopicLayout:
    partitions: int
    replication_factor: int  # the fewest replicas of any partition


def topic_layout(bootstrap: str, topic: str) -> TopicLayout | None:
    """How ``topic`` is laid out on the cluster; None if it does not exist."""
    admin = admin_client(bootstrap, timeout_ms=_CLIENT_DEFAULT_TIMEOUT_MS)
    try:
        described = admin.describe_topics([topic])
    finally:
        admin.close()
    for found in described:
        parts = found.get("partitions") or []
        if found.get("error_code", 0) == 0 and parts:
            replicas = min(len(p["replica_nodes"]) for p in parts)
            return TopicLayout(len(parts), replicas)
    return None
