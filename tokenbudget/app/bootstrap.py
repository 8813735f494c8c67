"""Where ``[kafka] bootstrap`` points, made ready: the local broker started for
``"local"``, an existing cluster's credentials checked, the namespace's topics
created. Every command that talks to Kafka starts here.
"""

from __future__ import annotations

import dataclasses
import logging

from tokenbudget.core import roles, security
from tokenbudget.core.config import Config
from tokenbudget.core.errors import BrokerError, TokenBudgetError
from tokenbudget.core.kafka_admin import STARTUP_WAIT_S, TopicSpec, check_ready, ensure_topics
from tokenbudget.core.retry import retry_until
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import BrokerSettings
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)

# How long one look at a cluster that does not answer may take.
_ATTEMPT_S = 10.0


def local_broker_settings(config: Config) -> BrokerSettings:
    settings = BrokerSettings.from_env()
    env_port_set = settings.port != BrokerSettings.__dataclass_fields__["port"].default
    if env_port_set:
        return settings
    return dataclasses.replace(
        settings,
        port=config.kafka.local_port,
        controller_port=config.kafka.local_controller_port,
    )


def topic_specs(config: Config) -> list[TopicSpec]:
    """The namespace's topics, with the configured partitions, replication and
    retentions."""
    return Topics(config.kafka.namespace, config.kafka.partitions).specs(
        prompt_retention_ms=config.kafka.prompt_retention_ms,
        completion_retention_ms=config.kafka.completion_retention_ms,
        budget_retention_ms=config.kafka.budget_retention_ms,
        replication_factor=config.kafka.replication_factor,
        min_insync_replicas=config.kafka.min_insync_replicas,
    )


def resolve_bootstrap(config: Config, *, create_topics: bool = True) -> str:
    """Return HOST:PORT, starting the local broker if configured, with topics made.

    For an existing cluster this also registers ``[kafka]``'s security for the address
    and connects once, so wrong credentials fail here, as
    :class:`~tokenbudget.core.errors.KafkaAuthError`, before any worker starts. Topics
    are an operator's to make ([[kafka.roles]]: a dispatcher's principal may not): a
    process playing another role finds them made.
    """
    create_topics = create_topics and roles.current_role() in (None, "operator")
    specs = topic_specs(config) if create_topics else []
    if config.kafka.bootstrap == "local":
        return broker.up(local_broker_settings(config), specs)
    bootstrap = config.kafka.bootstrap
    security.register(bootstrap, security.KafkaSecurity.from_config(config))

    def ready() -> None:
        # Every login this process will use: `run` (the operator) starts every role.
        played = roles.current_role()
        checked: set[str] = set()
        for role in roles.ROLES if played in (None, "operator") else (played,):
            login = security.security_for(bootstrap).login(role)
            user = login.username if login is not None else ""
            if user not in checked:
                checked.add(user)
                with roles.acting_as(role):
                    security.check_credentials(bootstrap)
        if create_topics:
            check_ready(bootstrap, _ATTEMPT_S)
            ensure_topics(bootstrap, specs)

    # A broker restarting as a job (re)starts is waited out; wrong credentials are not.
    retry_until(
        ready,
        timeout=STARTUP_WAIT_S,
        retry_on=BrokerError,
        interval=2.0,
        on_retry=lambda exc: log.warning("%s; trying again for up to %.0f s", exc, STARTUP_WAIT_S),
    )
    return bootstrap


def reading_bootstrap(config: Config | None, bootstrap: str = "") -> str:
    """The address of the broker or cluster a read-only command reads (``status``,
    ``jobs``): ``bootstrap`` when given, else the config's (its security registered),
    else the local broker's. A local broker that is not running is not started: a
    TokenBudgetError says so, with the command that starts it."""
    if bootstrap:
        return bootstrap
    if config is not None and config.kafka.bootstrap != "local":
        return resolve_bootstrap(config, create_topics=False)  # registers TLS/SASL
    settings = local_broker_settings(config) if config is not None else BrokerSettings.from_env()
    state = broker.status(settings)
    if not state.ready:
        how = "is starting" if state.running else "is not running"
        job = (
            f"the job with `tokenbudget run --config {config.source}`"
            if config
            else ("a job with `tokenbudget run --config FILE`")
        )
        raise TokenBudgetError(
            f"the local broker ({state.bootstrap}) {how}, so no job runs on it; start it "
            f"with `{broker_up_command(settings)}`, or start {job}"
        )
    return state.bootstrap


def broker_up_command(settings: BrokerSettings) -> str:
    """The command that starts this broker: ``broker up`` reads its ports from the
    environment only, not from ``[kafka] local_port``."""
    if settings.port == BrokerSettings.from_env().port:
        return "tokenbudget broker up"
    return (
        f"TOKENBUDGET_KAFKA_PORT={settings.port} "
        f"TOKENBUDGET_KAFKA_CONTROLLER_PORT={settings.controller_port} tokenbudget broker up"
    )
