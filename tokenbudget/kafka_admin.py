"""Topic administration every Kafka client of ours needs, on any cluster.

``ensure_topics`` creates a namespace's topics up front (Faust does not consume a
topic that appears after its worker started) and refuses existing ones that would
break the pipeline: a different partition count (Faust needs source topics and
table changelogs to match) or fewer replicas than asked (a lost broker would lose
their data; the error writes the ``kafka-reassign-partitions.sh`` plan). ``probe``
and ``warm_up_groups`` tell whether a cluster answers and make its group
coordinator ready.

kafka-python's blocking admin client does this work: it runs before any event loop
(the CLI, the runner's start-up), and aiokafka's admin client lacks DescribeConfigs
filters and ``wait_for_topics``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient
from kafka.errors import KafkaError

from tokenbudget import security
from tokenbudget.errors import BrokerError, KafkaAuthError
from tokenbudget.files import write_atomic
from tokenbudget.kafka import client_options

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


def admin_client(bootstrap: str, timeout_ms: int = 10_000) -> Any:
    """A kafka-python admin client of ``bootstrap`` (every admin call here goes
    through one: a failed connection leaks nothing)."""
    return _Admin(
        **{**client_options(bootstrap), "client_id": "tokenbudget-broker"},
        request_timeout_ms=timeout_ms,
        bootstrap_timeout_ms=timeout_ms,
    )


def connect_error(bootstrap: str, exc: BaseException) -> BrokerError | KafkaAuthError:
    refused = security.auth_failure(bootstrap, exc)
    if refused is not None:
        return refused
    return BrokerError(f"cannot reach Kafka at {bootstrap}: {exc!r}")


def probe(bootstrap: str, timeout: float) -> None:
    """Raise unless a metadata request to ``bootstrap`` succeeds and lists a broker."""
    admin = admin_client(bootstrap, timeout_ms=max(500, int(timeout * 1000)))
    try:
        cluster = admin.describe_cluster()
    finally:
        admin.close()
    if not cluster.get("brokers"):
        raise BrokerError(f"metadata from {bootstrap} lists no brokers yet")


def _cluster_replication(admin: Any) -> int | None:
    """The cluster's ``default.replication.factor``, or None when it may not be read
    (a user without DescribeConfigs): topics are then created with -1, "the broker's
    default", and existing ones are not checked."""

    try:
        brokers = admin.describe_cluster()["brokers"]
        node = str(brokers[0]["broker_id"])
        resource = ConfigResource(
            ConfigResourceType.BROKER, node, configs={"default.replication.factor": None}
        )
        described = admin.describe_configs([resource], config_filter="all")
        return int(described["broker"][node]["default.replication.factor"]["value"])
    except (KafkaError, LookupError, TypeError, ValueError) as exc:
        log.warning("cannot read the cluster's default.replication.factor (%r)", exc)
        return None


def _wanted_replication(spec: TopicSpec, default: int | None) -> int:
    if spec.replication_factor > 0:
        return spec.replication_factor
    return default if default is not None else -1


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
    raced, failed = set(), []
    for topic in result.get("topics", []):
        code = topic.get("error_code", 0)
        if code == 36:  # TOPIC_ALREADY_EXISTS: created concurrently
            raced.add(topic["name"])
        elif code != 0:
            failed.append(f"{topic['name']}: error {code} {topic.get('error_message')}")
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
    the spec, or fewer replicas than asked, raises BrokerError naming the fix.
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
        default = _cluster_replication(admin)
        existing = set(admin.list_topics()) & set(wanted)
        missing = [spec for name, spec in wanted.items() if name not in existing]
        if missing:
            created = _create_topics(admin, bootstrap, missing, default, timeout_ms)
            existing |= {spec.name for spec in missing} - set(created)
        if existing:
            _check_existing(admin, bootstrap, [wanted[n] for n in sorted(existing)], default)
    except KafkaError as exc:
        refused = security.auth_failure(bootstrap, exc)
        if refused is not None:  # e.g. a user without the right to create topics
            raise refused from exc
        raise BrokerError(f"managing topics on {bootstrap} failed: {exc!r}") from exc
    finally:
        admin.close()


def warm_up_groups(bootstrap: str, timeout: float = 20) -> None:
    """Have the broker create __consumer_offsets now (FindCoordinator does it).

    Otherwise the first consumer group (a Faust worker) gets
    GroupCoordinatorNotAvailableError while the topic is being created. Best effort.
    """

    deadline = time.monotonic() + timeout
    try:
        admin = admin_client(bootstrap, timeout_ms=int(timeout * 1000))
    except KafkaError as exc:
        log.warning("cannot reach %s to warm up the group coordinator: %r", bootstrap, exc)
        return
    try:
        while True:
            try:
                admin.describe_groups(["tokenbudget-broker-warmup"])
                return
            except KafkaError as exc:
                if time.monotonic() > deadline:
                    log.warning("group coordinator of %s not available yet: %r", bootstrap, exc)
                    return
                time.sleep(0.2)
    finally:
        admin.close()


def wait_reachable(bootstrap: str, timeout: float = STARTUP_WAIT_S) -> None:
    """Return once Kafka at ``bootstrap`` answers a metadata request; raise
    :class:`BrokerError` if it has not within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin_client(bootstrap, timeout_ms=_CLIENT_DEFAULT_TIMEOUT_MS).close()
            return
        except KafkaError as exc:
            if time.monotonic() > deadline:
                raise BrokerError(f"cannot reach Kafka at {bootstrap}: {exc!r}") from exc
            log.warning("Kafka at %s does not answer (%r); trying again", bootstrap, exc)
            time.sleep(2.0)


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
