"""ACLs on any cluster: applied once each, returning once the brokers authorize by
them, and a cluster that cannot or will not take them named with the fix."""

from __future__ import annotations

from typing import Any, get_args

import pytest
from kafka.admin import ACLOperation
from kafka.errors import ClusterAuthorizationFailedError, SecurityDisabledError

from tokenbudget.core import kafka_acls, security
from tokenbudget.core.errors import BrokerError, KafkaAuthError
from tokenbudget.core.kafka_acls import AclBinding


class AclAdmin:
    """An admin client of a cluster with an authorizer: ACLs it accepts show in
    DescribeAcls (and authorize) only ``lag`` descriptions later, as a broker applies
    them from its metadata log a moment after the controller took them."""

    def __init__(self, lag: int = 0) -> None:
        self.shown: list[Any] = []
        self.pending: list[Any] = []
        self.lag = lag
        self.created: list[Any] = []

    def describe_acls(self, acl_filter: Any) -> tuple[list[Any], Any]:
        if self.pending:
            self.lag -= 1
            if self.lag < 0:
                self.shown += self.pending
                self.pending = []
        assert acl_filter.host == "*" and acl_filter.permission_type == kafka_acls.ALLOW
        return [a for a in self.shown if a.principal == acl_filter.principal], None

    def create_acls(self, acls: list[Any]) -> dict[str, list[Any]]:
        self.created += acls
        self.pending += acls
        return {"succeeded": acls, "failed": []}

    def close(self) -> None:
        pass


BINDINGS = [
    AclBinding("User:disp", "topic", "literal", "N.completions", "Write"),
    AclBinding("User:disp", "group", "literal", "N-dispatch", "Read"),
    AclBinding("User:op", "topic", "prefixed", "N.", "DescribeConfigs"),
    AclBinding("User:op", "cluster", "literal", kafka_acls.CLUSTER_RESOURCE, "Describe"),
]


def _serving(monkeypatch: pytest.MonkeyPatch, admin: Any) -> None:
    monkeypatch.setattr(kafka_acls, "admin_client", lambda bootstrap, timeout_ms=0: admin)


def test_applying_acls_adds_the_missing_ones_and_twice_adds_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admin = AclAdmin()
    _serving(monkeypatch, admin)
    assert kafka_acls.apply_acls("k:9092", BINDINGS[:2]) == sorted(BINDINGS[:2])
    assert kafka_acls.apply_acls("k:9092", [*BINDINGS, BINDINGS[0]]) == sorted(BINDINGS[2:])
    assert kafka_acls.apply_acls("k:9092", BINDINGS) == []
    assert len(admin.created) == len(BINDINGS)  # each asked for once
    assert kafka_acls.acls_of("k:9092", "User:op") == sorted(BINDINGS[2:])


def test_applying_acls_returns_once_the_broker_authorizes_by_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    admin = AclAdmin(lag=3)
    _serving(monkeypatch, admin)
    kafka_acls.apply_acls("k:9092", BINDINGS)
    assert admin.pending == [] and len(admin.shown) == len(BINDINGS)


def test_every_operation_resource_and_pattern_goes_to_kafka_and_back() -> None:
    for operation in get_args(kafka_acls.AclOperation):
        for resource, pattern in (
            ("topic", "prefixed"),
            ("group", "literal"),
            ("cluster", "literal"),
        ):
            binding = AclBinding("User:x", resource, pattern, "n", operation)
            acl = kafka_acls._to_acl(binding)
            assert acl.host == "*" and acl.permission_type == kafka_acls.ALLOW
            assert kafka_acls._from_acl(acl) == binding
    assert kafka_acls._to_acl(BINDINGS[2]).operation == ACLOperation.DESCRIBE_CONFIGS


def test_a_cluster_without_an_authorizer_or_a_user_who_may_not_is_named_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bob = security.KafkaSecurity(
        protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="bob",
        sasl_password=security.SecretSource(key="kafka.sasl_password_env", env="BOB_PW"),
    )
    monkeypatch.setitem(security._REGISTRY, "k:9092", bob)

    class Refusing(AclAdmin):
        def __init__(self, error: Exception) -> None:
            super().__init__()
            self.error = error

        def describe_acls(self, acl_filter: Any) -> tuple[list[Any], Any]:
            raise self.error

    _serving(monkeypatch, Refusing(SecurityDisabledError("no authorizer")))
    with pytest.raises(BrokerError) as disabled:
        kafka_acls.apply_acls("k:9092", BINDINGS)
    assert "k:9092 has no authorizer" in str(disabled.value)
    assert f"authorizer.class.name={kafka_acls.STANDARD_AUTHORIZER}" in str(disabled.value)

    _serving(monkeypatch, Refusing(ClusterAuthorizationFailedError("denied")))
    with pytest.raises(KafkaAuthError) as refused:
        kafka_acls.acls_of("k:9092", "User:disp")
    assert "does not let user 'bob' read ACLs (ClusterAuthorizationFailed)" in str(refused.value)
    assert refused.value.keys[-2:] == ["kafka.sasl_username", "kafka.sasl_password_env"]

    class Failing(AclAdmin):
        def create_acls(self, acls: list[Any]) -> dict[str, list[Any]]:
            return {"succeeded": [], "failed": [ClusterAuthorizationFailedError]}

    _serving(monkeypatch, Failing())
    with pytest.raises(KafkaAuthError, match="does not let user 'bob' create ACLs"):
        kafka_acls.apply_acls("k:9092", BINDINGS)
