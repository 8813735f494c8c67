"""Every consumer group's name comes from Topics, hung off the namespace, one per role."""

from __future__ import annotations

from tokenbudget.core.metrics import group_role
from tokenbudget.streams.topics import Topics


def test_each_role_has_its_group_in_the_namespace() -> None:
    topics = Topics("ns")
    groups = {
        "dispatch": topics.dispatch_group,
        "ledger": topics.ledger_app_id,
        "sink": topics.sink_group,
    }
    assert groups == {"dispatch": "ns-dispatch", "ledger": "ns-ledger", "sink": "ns-sink"}
    # the metrics label a group by its role, across namespaces
    assert {role: group_role(group) for role, group in groups.items()} == {
        role: role for role in groups
    }


def test_namespaces_never_share_a_group() -> None:
    a, b = Topics("a"), Topics("b")
    for name in ("dispatch_group", "ledger_app_id", "sink_group"):
        assert getattr(a, name) != getattr(b, name)


def test_a_dispatcher_instance_is_a_static_member_of_the_dispatch_group() -> None:
    topics = Topics("ns")
    assert [topics.dispatcher_instance(i) for i in range(3)] == [
        "ns-dispatch-0",
        "ns-dispatch-1",
        "ns-dispatch-2",
    ]
    assert topics.dispatcher_instance(1).startswith(topics.dispatch_group + "-")
