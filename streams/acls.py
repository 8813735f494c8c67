"""The Kafka rights of each role on a namespace's topics and groups: the ACL table
(docs/kafka.md, Roles and ACLs), as pure functions, and how an admin reads it.

Each role writes only the topics of the events it is the author of, so that a
broker whose authorizer refuses what no ACL allows (``allow.everyone.if.no.acl.found
= false``) keeps every writer to its own: the operators' commands (``N.control``),
the ledger's announcements and grants (``N.budgets``), the dispatchers' answers and
lease requests, the producer's prompts. Reading is granted where the role's code
reads, and every process reads the commands and the announcements from the start,
without a group.

What the table relies on is Kafka's own: Read, Write, Delete and Alter imply
Describe, and AlterConfigs implies DescribeConfigs; a consumer that assigns its
partitions itself needs no right on a group, one that reads a group's committed
offsets (OffsetFetch, and the FindCoordinator before it) needs Describe on that
group, one in a group Read on it; metadata (a topic's partitions) needs Describe on
the topic. An idempotent producer needs IdempotentWrite on the cluster only from
brokers older than 2.8: later ones grant it with Write on any topic, so the table
leaves it out.

A principal several roles share (a role without a login of its own logs in as
``[kafka] sasl_username``) gets the union of their rights.
"""

from __future__ import annotations

import itertools
import shlex
from collections.abc import Callable, Mapping
from typing import Any

from tokenbudget.core.kafka_acls import (
    CLUSTER_RESOURCE,
    AclBinding,
    AclOperation,
    AclPattern,
    AclResource,
)
from tokenbudget.core.roles import Role
from tokenbudget.streams.topics import OUTCOME_TABLE, Topics

# A binding without its principal: what a role may do.
Right = tuple[AclResource, AclPattern, str, AclOperation]


def topic_prefix(topics: Topics) -> str:
    """The start of every topic name of the namespace but the ledger's own."""
    return f"{topics.namespace}."


def ledger_prefix(topics: Topics) -> str:
    """The start of the ledger's Faust topics (table changelogs, the assignor's)."""
    return f"{topics.ledger_app_id}-"


def group_prefix(topics: Topics) -> str:
    """The start of every consumer group name of the namespace."""
    return f"{topics.namespace}-"


def _topic(name: str, *operations: AclOperation) -> list[Right]:
    return [("topic", "literal", name, op) for op in operations]


def _topics(prefix: str, *operations: AclOperation) -> list[Right]:
    return [("topic", "prefixed", prefix, op) for op in operations]


def _group(name: str, *operations: AclOperation) -> list[Right]:
    return [("group", "literal", name, op) for op in operations]


def _every_role(t: Topics) -> list[Right]:
    """Metadata of the namespace's topics; the operators' commands and the ledger's
    announcements, read from the start (the budget board); dead letters, which any
    reader of a bad event writes."""
    return [
        *_topics(topic_prefix(t), "Describe"),
        *_topic(t.control, "Read"),
        *_topic(t.budgets, "Read"),
        *_topic(t.dead_letter, "Write"),
    ]


def _operator(t: Topics) -> list[Right]:
    """``run``'s own work, ``budget set``, ``servers add|drain``, ``status``,
    ``replay``, ``export``: commands written, everything read, the topics created
    and checked (their configs read, a message size raised), the groups' committed
    offsets read for lag and the drain (OffsetFetch), the cluster's default
    replication and request limit read."""
    return [
        *_topic(t.control, "Write"),
        *_topics(topic_prefix(t), "Read", "Create", "DescribeConfigs", "AlterConfigs"),
        # Describe too: a topic it may not describe is missing to it, and created again.
        *_topics(ledger_prefix(t), "Describe", "Create", "DescribeConfigs", "AlterConfigs"),
        ("group", "prefixed", group_prefix(t), "Describe"),
        ("cluster", "literal", CLUSTER_RESOURCE, "Describe"),
        ("cluster", "literal", CLUSTER_RESOURCE, "DescribeConfigs"),
    ]


def _producer(t: Topics) -> list[Right]:
    """Prompts and its progress written. A rerun skips what an earlier run kept
    (the completions, and the ledger's outcome table) and the prompts still queued
    (the prompts topic from the dispatchers' committed offsets: producers/prompts/resume.py)."""
    return [
        *_topic(t.prompts, "Write", "Read"),
        *_topic(t.outcomes, "Write"),
        *_topic(t.completions, "Read"),
        *_topic(t.changelog(OUTCOME_TABLE), "Read"),
        *_group(t.dispatch_group, "Describe"),
    ]


def _dispatcher(t: Topics) -> list[Right]:
    """Prompts read in its group; answers, skips and failures, lease requests,
    renewals and releases and its fleet reports written. A prompt handed to it
    again is looked up among the ledger's outcomes and the completions past the
    ledger's committed offsets (producers/prompts/resume.py, OutcomeView)."""
    return [
        *_topic(t.prompts, "Read"),
        *_group(t.dispatch_group, "Read"),
        *_topic(t.completions, "Write", "Read"),
        *_topic(t.outcomes, "Write"),
        *_topic(t.reservations, "Write"),
        *_topic(t.changelog(OUTCOME_TABLE), "Read"),
        *_group(t.ledger_app_id, "Describe"),
    ]


def _ledger(t: Topics) -> list[Right]:
    """What it counts read in its Faust group; halts, grants and snapshots written,
    its lease fences among the lease's answers, lease expiries; its own topics
    (tables' changelogs, the assignor's) read, written, made and checked by Faust."""
    return [
        *_topic(t.completions, "Read", "Write"),
        *_topic(t.outcomes, "Read"),
        *_topic(t.reservations, "Read", "Write"),
        *_topic(t.budgets, "Write"),
        *_topics(ledger_prefix(t), "Read", "Write", "Create", "Describe", "DescribeConfigs"),
        *_group(t.ledger_app_id, "Read", "Describe"),
    ]


def _sink(t: Topics) -> list[Right]:
    """Completions read in its group."""
    return [*_topic(t.completions, "Read"), *_group(t.sink_group, "Read")]


_RIGHTS: dict[Role, Callable[[Topics], list[Right]]] = {
    "operator": _operator,
    "producer": _producer,
    "dispatcher": _dispatcher,
    "ledger": _ledger,
    "sink": _sink,
}


def rights(topics: Topics, role: Role) -> list[Right]:
    """What ``role`` may do on the namespace of ``topics``, every role's share included."""
    return [*_every_role(topics), *_RIGHTS[role](topics)]


def bindings(topics: Topics, principals: Mapping[Role, str]) -> list[AclBinding]:
    """The ACLs that let each role's principal (``User:<name>``) do its work on the
    namespace of ``topics``, sorted, each once: a principal of several roles gets the
    union of their rights."""
    return sorted(
        {
            AclBinding(principal, *right)
            for role, principal in principals.items()
            for right in rights(topics, role)
        }
    )


# --------------------------------------------------------------------------- shown


def _resource_options(binding: AclBinding) -> list[str]:
    if binding.resource == "cluster":
        return ["--cluster"]
    options = [f"--{binding.resource}", shlex.quote(binding.name)]
    if binding.pattern == "prefixed":
        options += ["--resource-pattern-type", "prefixed"]
    return options


def command_lines(
    acls: list[AclBinding], bootstrap: str, principals: Mapping[Role, str] | None = None
) -> list[str]:
    """``kafka-acls.sh`` command lines that add ``acls``, one each, grouped by
    principal; with ``principals``, a comment before each group names its roles."""
    lines = []
    for principal, group in itertools.groupby(sorted(acls), key=lambda b: b.principal):
        roles = [role for role, p in (principals or {}).items() if p == principal]
        if roles:
            lines.append(f"# {principal}: {', '.join(roles)}")
        for binding in group:
            lines.append(
                " ".join(
                    [
                        "kafka-acls.sh --bootstrap-server",
                        shlex.quote(bootstrap),
                        "--add --allow-principal",
                        shlex.quote(principal),
                        "--operation",
                        binding.operation,
                        *_resource_options(binding),
                    ]
                )
            )
    return lines


def to_json(acls: list[AclBinding]) -> list[dict[str, Any]]:
    """``acls`` as JSON objects, with Kafka's names for their parts: each allows
    its operation from any host."""
    return [
        {
            "principal": b.principal,
            "resource_type": b.resource,
            "pattern_type": b.pattern,
            "resource_name": b.name,
            "operation": b.operation,
            "permission_type": "Allow",
            "host": "*",
        }
        for b in sorted(acls)
    ]
