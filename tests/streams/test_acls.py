"""The ACL table: each role's rights on a namespace, prefixed where the names are
many, the union for a principal several roles share, and how an admin reads it."""

from __future__ import annotations

import json
import shlex

import pytest

from tokenbudget.core.kafka_acls import AclBinding
from tokenbudget.core.roles import ROLES, Role
from tokenbudget.streams import acls
from tokenbudget.streams.topics import Topics

T = Topics("N")
OWN = {role: f"User:{role}" for role in ROLES}  # every role its own principal

EVERY_ROLE = {
    ("topic", "prefixed", "N.", "Describe"),
    ("topic", "literal", "N.control", "Read"),
    ("topic", "literal", "N.budgets", "Read"),
    ("topic", "literal", "N.deadletter", "Write"),
}
RIGHTS: dict[Role, set[tuple[str, str, str, str]]] = {
    "operator": {
        ("topic", "literal", "N.control", "Write"),
        *(("topic", "prefixed", "N.", op) for op in ("Read", "Create", "DescribeConfigs")),
        ("topic", "prefixed", "N.", "AlterConfigs"),
        *(
            ("topic", "prefixed", "N-ledger-", op)
            for op in ("Describe", "Create", "DescribeConfigs", "AlterConfigs")
        ),
        ("group", "prefixed", "N-", "Describe"),
        ("cluster", "literal", "kafka-cluster", "Describe"),
        ("cluster", "literal", "kafka-cluster", "DescribeConfigs"),
    },
    "producer": {
        ("topic", "literal", "N.prompts", "Write"),
        ("topic", "literal", "N.outcomes", "Write"),
        ("topic", "literal", "N.completions", "Read"),
        # a rerun's resume: the ledger's outcome table, the prompts still queued
        ("topic", "literal", "N-ledger-outcomes-changelog", "Read"),
        ("topic", "literal", "N.prompts", "Read"),
        ("group", "literal", "N-dispatch", "Describe"),
    },
    "dispatcher": {
        ("topic", "literal", "N.prompts", "Read"),
        ("group", "literal", "N-dispatch", "Read"),
        ("topic", "literal", "N.completions", "Write"),
        ("topic", "literal", "N.outcomes", "Write"),
        ("topic", "literal", "N.reservations", "Write"),
        # a prompt handed over again: the ledger's outcomes and what it has not applied
        ("topic", "literal", "N-ledger-outcomes-changelog", "Read"),
        ("topic", "literal", "N.completions", "Read"),
        ("group", "literal", "N-ledger", "Describe"),
    },
    "ledger": {
        *(("topic", "literal", f"N.{t}", "Read") for t in ("completions", "outcomes")),
        ("topic", "literal", "N.reservations", "Read"),
        *(("topic", "literal", f"N.{t}", "Write") for t in ("budgets", "completions")),
        ("topic", "literal", "N.reservations", "Write"),
        *(
            ("topic", "prefixed", "N-ledger-", op)
            for op in ("Read", "Write", "Create", "Describe", "DescribeConfigs")
        ),
        ("group", "literal", "N-ledger", "Read"),
        ("group", "literal", "N-ledger", "Describe"),
    },
    "sink": {
        ("topic", "literal", "N.completions", "Read"),
        ("group", "literal", "N-sink", "Read"),
    },
}


@pytest.mark.parametrize("role", ROLES)
def test_each_role_has_its_rights_and_every_roles_share(role: Role) -> None:
    assert set(acls.rights(T, role)) == EVERY_ROLE | RIGHTS[role]
    mine = [b for b in acls.bindings(T, OWN) if b.principal == f"User:{role}"]
    assert {(b.resource, b.pattern, b.name, b.operation) for b in mine} == (
        EVERY_ROLE | RIGHTS[role]
    )


def _may_write(bindings: list[AclBinding], topic: str) -> set[str]:
    """The principals the bindings let write ``topic`` (literally or by a prefix)."""
    return {
        b.principal
        for b in bindings
        if b.resource == "topic"
        and b.operation in ("Write", "All")
        and (b.name == topic if b.pattern == "literal" else topic.startswith(b.name))
    }


def test_each_topic_is_written_by_the_roles_whose_events_it_carries_only() -> None:
    bindings = acls.bindings(T, OWN)
    writers = {spec.name: _may_write(bindings, spec.name) for spec in T.specs()}
    ledger_topics = {name for name in writers if name.startswith("N-ledger-")}
    assert writers == {
        "N.control": {"User:operator"},
        "N.budgets": {"User:ledger"},
        "N.prompts": {"User:producer"},
        "N.completions": {"User:dispatcher", "User:ledger"},
        "N.outcomes": {"User:producer", "User:dispatcher"},
        "N.reservations": {"User:dispatcher", "User:ledger"},
        "N.deadletter": set(OWN.values()),
        **{name: {"User:ledger"} for name in ledger_topics},
    }
    assert len(ledger_topics) == 3  # two changelogs and the assignor's topic


def test_the_prefixes_cover_the_namespace_and_nothing_of_another() -> None:
    names = [spec.name for spec in T.specs()]
    ledger = [n for n in names if n.startswith(acls.ledger_prefix(T))]
    assert sorted(ledger) == sorted(
        [T.changelog("ledger"), T.changelog("outcomes"), T.ledger_leader]
    )
    assert all(n.startswith(acls.topic_prefix(T)) for n in set(names) - set(ledger))
    groups = [T.dispatch_group, T.sink_group, T.ledger_app_id]
    assert all(g.startswith(acls.group_prefix(T)) for g in groups)
    # namespace names hold no '.', so "N." is no other namespace's start
    assert not Topics("N2").prompts.startswith(acls.topic_prefix(T))


def test_only_describing_reading_and_configuring_are_granted_by_prefix() -> None:
    """A prefixed Write would let a role write every topic of the namespace: the
    writes are literal, but the ledger's on its own Faust topics."""
    for binding in acls.bindings(T, OWN):
        if binding.pattern == "prefixed" and binding.operation == "Write":
            assert (binding.principal, binding.name) == ("User:ledger", "N-ledger-")


def test_a_principal_of_several_roles_gets_their_union_each_once() -> None:
    shared = {**OWN, "operator": "User:tb", "sink": "User:tb", "producer": "User:tb"}
    bindings = acls.bindings(T, shared)
    assert len(bindings) == len(set(bindings))
    ours = {
        (b.resource, b.pattern, b.name, b.operation) for b in bindings if b.principal == "User:tb"
    }
    assert ours == EVERY_ROLE | RIGHTS["operator"] | RIGHTS["sink"] | RIGHTS["producer"]
    # N.completions Read is the producer's and the sink's (and in the operator's prefix):
    # listed once
    assert [b.name for b in bindings if b.principal == "User:tb"].count("N.completions") == 1
    assert {b.principal for b in bindings} == {"User:tb", "User:dispatcher", "User:ledger"}


def test_command_lines_an_admin_pastes() -> None:
    bindings = [
        AclBinding("User:disp", "topic", "literal", "N.completions", "Write"),
        AclBinding("User:disp", "topic", "prefixed", "N.", "Describe"),
        AclBinding("User:disp", "group", "literal", "N-dispatch", "Read"),
        AclBinding("User:op", "cluster", "literal", "kafka-cluster", "DescribeConfigs"),
        AclBinding("User:op", "group", "prefixed", "N-", "Describe"),
    ]
    lines = acls.command_lines(bindings, "k1:9092,k2:9092", {"dispatcher": "User:disp"})
    start = "kafka-acls.sh --bootstrap-server k1:9092,k2:9092 --add --allow-principal"
    assert lines == [
        "# User:disp: dispatcher",
        f"{start} User:disp --operation Read --group N-dispatch",
        f"{start} User:disp --operation Write --topic N.completions",
        f"{start} User:disp --operation Describe --topic N. --resource-pattern-type prefixed",
        # a principal no role of the mapping plays: no comment
        f"{start} User:op --operation DescribeConfigs --cluster",
        f"{start} User:op --operation Describe --group N- --resource-pattern-type prefixed",
    ]


def test_a_principal_a_shell_would_split_is_quoted() -> None:
    odd = AclBinding("User:o'brien x", "topic", "literal", "N.control", "Read")
    (line,) = acls.command_lines([odd], "k:9092")
    assert shlex.split(line)[5] == "User:o'brien x"


def test_json_names_every_part_and_round_trips() -> None:
    bindings = acls.bindings(T, OWN)
    shown = json.loads(json.dumps(acls.to_json(bindings)))
    assert len(shown) == len(bindings)
    assert shown[0].keys() == {
        "principal",
        "resource_type",
        "pattern_type",
        "resource_name",
        "operation",
        "permission_type",
        "host",
    }
    back = [
        AclBinding(
            e["principal"],
            e["resource_type"],
            e["pattern_type"],
            e["resource_name"],
            e["operation"],
        )
        for e in shown
    ]
    assert back == bindings
    assert {(e["permission_type"], e["host"]) for e in shown} == {("Allow", "*")}
