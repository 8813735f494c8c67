"""Kafka's ACLs on any cluster, as :class:`AclBinding` values: what the authorizer
allows a principal (:func:`acls_of`), and allowing more (:func:`apply_acls`, which
returns once the brokers authorize by them). A cluster without an authorizer, or a
principal not allowed to alter ACLs, is an error naming the fix."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from kafka.admin import (
    ACL,
    ACLFilter,
    ACLOperation,
    ACLPermissionType,
    ACLResourcePatternType,
    ResourcePattern,
    ResourcePatternFilter,
    ResourceType,
)
from kafka.errors import KafkaError

from tokenbudget.core.errors import BrokerError
from tokenbudget.core.kafka_admin import admin_client, connect_error, refused
from tokenbudget.core.retry import retry_until

AclResource = Literal["topic", "group", "cluster"]
AclPattern = Literal["literal", "prefixed"]
# Kafka's operations, as kafka-acls.sh spells them.
AclOperation = Literal[
    "All",
    "Read",
    "Write",
    "Create",
    "Delete",
    "Alter",
    "Describe",
    "ClusterAction",
    "DescribeConfigs",
    "AlterConfigs",
    "IdempotentWrite",
    "CreateTokens",
    "DescribeTokens",
]
CLUSTER_RESOURCE = "kafka-cluster"  # the name of the one cluster resource
STANDARD_AUTHORIZER = "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
ALLOW = ACLPermissionType.ALLOW


@dataclass(frozen=True, order=True)
class AclBinding:
    """One right Kafka's authorizer grants: ``principal`` (``User:<name>``) may do
    ``operation`` on the ``resource`` called ``name`` (``prefixed``: on every one
    whose name starts with it), from any host. Allows only: what no binding allows,
    an authorizer with ``allow.everyone.if.no.acl.found=false`` refuses."""

    principal: str
    resource: AclResource
    pattern: AclPattern
    name: str
    operation: AclOperation


_RESOURCE_TYPES: dict[AclResource, ResourceType] = {
    "topic": ResourceType.TOPIC,
    "group": ResourceType.GROUP,
    "cluster": ResourceType.CLUSTER,
}
_PATTERN_TYPES: dict[AclPattern, ACLResourcePatternType] = {
    "literal": ACLResourcePatternType.LITERAL,
    "prefixed": ACLResourcePatternType.PREFIXED,
}
# DescribeConfigs <-> ACLOperation.DESCRIBE_CONFIGS
_OPERATIONS: dict[AclOperation, ACLOperation] = {
    name: ACLOperation[re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()]
    for name in get_args(AclOperation)
}


def _to_acl(binding: AclBinding) -> ACL:
    pattern = ResourcePattern(
        _RESOURCE_TYPES[binding.resource], binding.name, _PATTERN_TYPES[binding.pattern]
    )
    return ACL(binding.principal, "*", _OPERATIONS[binding.operation], ALLOW, pattern)


def _from_acl(acl: ACL) -> AclBinding | None:
    """None for an ACL of a kind no binding has (a transactional id's, a user's)."""
    pattern = acl.resource_pattern
    resource = next((k for k, v in _RESOURCE_TYPES.items() if v == pattern.resource_type), None)
    kind = next((k for k, v in _PATTERN_TYPES.items() if v == pattern.pattern_type), None)
    operation = next((k for k, v in _OPERATIONS.items() if v == acl.operation), None)
    if resource is None or kind is None or operation is None:
        return None
    return AclBinding(acl.principal, resource, kind, pattern.resource_name, operation)


def _acl_error(bootstrap: str, doing: str, error: BaseException | type[BaseException]) -> Exception:
    """Our error for the cluster refusing ``doing`` (kafka-python raises an error
    from DescribeAcls, and gives CreateAcls' failures as error classes)."""
    name = error.__name__ if isinstance(error, type) else type(error).__name__
    if name == "SecurityDisabledError":
        return BrokerError(
            f"the Kafka cluster at {bootstrap} has no authorizer, so it has no ACLs "
            f"({doing}: SecurityDisabled); fix: set authorizer.class.name={STANDARD_AUTHORIZER} "
            "on its brokers (docs/kafka.md, Roles and ACLs)"
        )
    if name == "ClusterAuthorizationFailedError":
        return refused(
            bootstrap,
            doing,
            "ClusterAuthorizationFailed",
            "log in as a principal allowed to alter ACLs (Alter on the cluster, or one of "
            "the brokers' super.users)",
        )
    return BrokerError(f"cannot {doing} on {bootstrap}: {name}: {error}")


def _allowed(admin: Any, bootstrap: str, principal: str) -> set[AclBinding]:
    everything = ResourcePatternFilter(ResourceType.ANY, None, ACLResourcePatternType.ANY)
    wanted = ACLFilter(principal, "*", ACLOperation.ANY, ALLOW, everything)
    try:
        found, _ = admin.describe_acls(wanted)
    except KafkaError as exc:
        raise _acl_error(bootstrap, "read ACLs", exc) from exc
    return {b for b in map(_from_acl, found) if b is not None}


def acls_of(bootstrap: str, principal: str) -> list[AclBinding]:
    """What the cluster's authorizer allows ``principal`` from any host, sorted."""
    try:
        admin = admin_client(bootstrap)
    except (KafkaError, OSError) as exc:
        raise connect_error(bootstrap, exc) from exc
    try:
        return sorted(_allowed(admin, bootstrap, principal))
    finally:
        admin.close()


def apply_acls(
    bootstrap: str, bindings: Sequence[AclBinding], *, timeout: float = 30
) -> list[AclBinding]:
    """Allow every one of ``bindings`` on the cluster; returns those it added, sorted
    (the others were there already: applying them twice adds nothing).

    Returns once the broker authorizes by them: it accepts new ACLs before it has
    applied them from its metadata log, and a client right after would be refused.
    Needs a principal allowed to alter ACLs (:class:`KafkaAuthError` otherwise)."""
    wanted = sorted(set(bindings))
    try:
        admin = admin_client(bootstrap)
    except (KafkaError, OSError) as exc:
        raise connect_error(bootstrap, exc) from exc
    try:
        principals = sorted({b.principal for b in wanted})

        def present() -> set[AclBinding]:
            return set().union(*(_allowed(admin, bootstrap, p) for p in principals))

        missing = [b for b in wanted if b not in present()]
        if not missing:
            return []
        try:
            failed = admin.create_acls([_to_acl(b) for b in missing])["failed"]
        except KafkaError as exc:
            failed = [exc]
        if failed:
            raise _acl_error(bootstrap, "create ACLs", failed[0])

        def applied() -> None:
            if not set(missing) <= present():
                raise BrokerError(
                    f"the Kafka cluster at {bootstrap} accepted {len(missing)} ACLs but "
                    f"did not apply them within {timeout:.0f} s; fix: check its brokers' "
                    "logs, then apply them again"
                )

        retry_until(applied, timeout=timeout, retry_on=BrokerError)
    finally:
        admin.close()
    return missing
