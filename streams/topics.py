"""Every Kafka topic tokenbudget uses, with its partitions and configs, and every
consumer group it reads them in.

Topics are created up front (the broker runs with ``auto.create.topics.enable=false``)
because Faust does not consume a topic that appears after its worker started, and
raises PartitionsMismatch when a source topic and its table changelog differ in
partition count. All keyed topics share one partition count (``[kafka] partitions``,
default ``PARTITIONS``) so the ledger tables are co-partitioned with every stream the
ledger reads. Replication is the cluster's default unless ``[kafka]
replication_factor`` says otherwise, for every topic, Faust's own included.

Every name hangs off a namespace (``[kafka] namespace``), so several independent
jobs, or the tests, can share one broker without seeing each other's events.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenbudget.core import sizes
from tokenbudget.core.kafka_admin import DEFAULT_PARTITIONS, TopicSpec

PARTITIONS = DEFAULT_PARTITIONS
DEFAULT_NAMESPACE = "tokenbudget"

LEDGER_TABLE = "ledger"
OUTCOME_TABLE = "outcomes"

_KEEP_FOREVER = {"retention.ms": "-1", "retention.bytes": "-1"}


@dataclass(frozen=True)
class Topics:
    """The topic and consumer group names of one namespace."""

    namespace: str = DEFAULT_NAMESPACE
    partitions: int = PARTITIONS

    @property
    def prompts(self) -> str:
        return f"{self.namespace}.prompts"

    @property
    def completions(self) -> str:
        return f"{self.namespace}.completions"

    @property
    def control(self) -> str:
        """Operators' commands, written by operator principals only: budgets set
        (``budget set``, ``run`` from its config), the fleet's changes (``servers
        add|drain``) and the job's identity."""
        return f"{self.namespace}.control"

    @property
    def budgets(self) -> str:
        """The ledger's announcements, written by ledger principals only: halts,
        raises, snapshots and its replies to lease requests."""
        return f"{self.namespace}.budgets"

    @property
    def outcomes(self) -> str:
        """Prompts that ended without a completion (skipped, failed) and producer progress."""
        return f"{self.namespace}.outcomes"

    @property
    def reservations(self) -> str:
        """Lease requests, renewals and releases from dispatchers to the ledger."""
        return f"{self.namespace}.reservations"

    @property
    def dead_letter(self) -> str:
        return f"{self.namespace}.deadletter"

    # Consumer groups: each role's readers share the work of its topics.

    @property
    def ledger_app_id(self) -> str:
        """The ledger's Faust app id, which is its consumer group too."""
        return f"{self.namespace}-ledger"

    @property
    def dispatch_group(self) -> str:
        """The dispatchers' group, on the prompts topic."""
        return f"{self.namespace}-dispatch"

    def dispatcher_instance(self, index: int) -> str:
        """The static member name of ``run``'s dispatcher ``index`` (0: its own) in
        :attr:`dispatch_group`: a rerun's dispatchers take the prompts of a killed
        run's straight back."""
        return f"{self.dispatch_group}-{index}"

    @property
    def sink_group(self) -> str:
        """The Parquet sink's group, on the completions topic."""
        return f"{self.namespace}-sink"

    def changelog(self, table: str) -> str:
        """Faust's name for a table's changelog topic."""
        return f"{self.ledger_app_id}-{table}-changelog"

    @property
    def ledger_leader(self) -> str:
        """Faust's partition-assignor leader topic (one partition)."""
        return f"{self.ledger_app_id}-__assignor-__leader"

    def specs(
        self,
        *,
        prompt_retention_ms: int = 7 * 24 * 3600 * 1000,
        completion_retention_ms: int = -1,
        budget_retention_ms: int = -1,
        replication_factor: int = -1,
        min_insync_replicas: int = -1,
    ) -> list[TopicSpec]:
        """The topics to create before any worker starts.

        Completions and budget events (budgets, outcomes) are the record of what the
        GPUs produced and by default are kept forever so they can be replayed
        (``tokenbudget replay``); -1 means forever. Prompts can be regenerated from
        the datasets, so they expire. ``replication_factor`` and
        ``min_insync_replicas`` of -1 leave them to the cluster's defaults. Every
        topic accepts the message size every producer may send (:mod:`tokenbudget.core.sizes`).
        """
        keyed = {
            self.prompts: {"retention.ms": str(prompt_retention_ms)},
            self.completions: completion_topic_configs(completion_retention_ms),
            self.control: _retention(budget_retention_ms),
            self.budgets: _retention(budget_retention_ms),
            self.outcomes: _retention(budget_retention_ms),
            self.reservations: {"retention.ms": str(prompt_retention_ms)},
            self.dead_letter: dict(_KEEP_FOREVER),
            self.changelog(LEDGER_TABLE): {"cleanup.policy": "compact"},
            self.changelog(OUTCOME_TABLE): {"cleanup.policy": "compact"},
        }
        isr = {"min.insync.replicas": str(min_insync_replicas)} if min_insync_replicas > 0 else {}
        common = {**isr, **sizes.topic_configs()}
        specs = [
            TopicSpec(name, self.partitions, {**configs, **common}, replication_factor)
            for name, configs in keyed.items()
        ]
        # Faust would create it on first start with its own replication setting.
        specs.append(TopicSpec(self.ledger_leader, 1, dict(common), replication_factor))
        return specs


def _retention(retention_ms: int) -> dict[str, str]:
    if retention_ms < 0:
        return dict(_KEEP_FOREVER)
    return {"retention.ms": str(retention_ms), "retention.bytes": "-1"}


def completion_topic_configs(retention_ms: int = -1) -> dict[str, str]:
    """Configs of a completions topic (also used for ``replay --to-topic``)."""
    return {**_retention(retention_ms), **sizes.topic_configs()}
