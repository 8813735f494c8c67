"""The jobs a broker or cluster holds, as ``tokenbudget jobs`` lists them and
``tokenbudget status JOB`` finds one without its config.

A job is a namespace with a record of what it is (its ``job_identity`` on its control
topic, or its budgets topic for a job that ran before the control topic), so the
list is read from Kafka alone: the topics the cluster has, each job's latest record
(its datasets, its config file, its first run), the ledger's latest snapshot of each
dataset (kept and budget), and whether a ledger worker of it is in its consumer
group now.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.errors import KafkaError

from tokenbudget.app.identity import read_recorded
from tokenbudget.app.tables import format_table, printable
from tokenbudget.core.errors import BrokerError, EventDecodeError
from tokenbudget.core.kafka import GroupLag, consumer_options, kafka_python_options, read_to_ends
from tokenbudget.core.kafka_admin import admin_client, connect_error
from tokenbudget.streams import budget, codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics

# The ledger publishes a snapshot of every dataset every few seconds: the last
# records of each partition of the budgets topic hold each dataset's latest.
_TAIL = 5000

JobState = str  # "running" | "halted" | "finished" | "interrupted"


@dataclass(frozen=True)
class DatasetKept:
    name: str
    budget: int | None
    kept: int  # in the budget's unit
    unit: str
    status: str  # the ledger's: "open" | "halted" | "exhausted"; "-": no snapshot yet


@dataclass(frozen=True)
class Job:
    name: str
    datasets: list[DatasetKept]
    state: JobState
    first_run: float | None
    last_run: float | None  # the ledger's latest snapshot
    config: str  # the config file as recorded ("": not known)

    @property
    def kept(self) -> int:
        return sum(d.kept for d in self.datasets)

    @property
    def budget(self) -> int:
        return sum(d.budget or 0 for d in self.datasets)


def job_names(bootstrap: str) -> list[str]:
    """The namespaces on ``bootstrap`` that hold a job: those with a control topic
    (or, made before it, a budgets topic)."""
    try:
        admin = admin_client(bootstrap)
    except (KafkaError, OSError) as exc:
        raise connect_error(bootstrap, exc) from exc
    try:
        topics = set(admin.list_topics())
    finally:
        admin.close()
    return sorted({t.rsplit(".", 1)[0] for t in topics if t.endswith((".control", ".budgets"))})


def latest_snapshots(bootstrap: str, topics: Topics) -> dict[str, ev.LedgerSnapshot]:
    """The ledger's latest snapshot of each dataset, from the last records of the
    budgets topic (each dataset's owner epoch wins, as every reader takes it)."""
    found: dict[str, ev.LedgerSnapshot] = {}

    def keep(record: Any) -> None:
        try:
            event = codec.decode(record.value, record.topic)
        except EventDecodeError:
            return
        if isinstance(event, ev.LedgerSnapshot):
            current = found.get(event.dataset)
            if current is None or (event.epoch, event.at) >= (current.epoch, current.at):
                found[event.dataset] = event

    consumer = KafkaConsumer(
        **kafka_python_options(consumer_options(bootstrap)), group_id=None, enable_auto_commit=False
    )
    try:
        parts = consumer.partitions_for_topic(topics.budgets) or set()
        tps = [TopicPartition(topics.budgets, p) for p in sorted(parts)]
        if not tps:
            return found
        consumer.assign(tps)
        ends, starts = consumer.end_offsets(tps), consumer.beginning_offsets(tps)
        for tp in tps:
            consumer.seek(tp, max(starts[tp], ends[tp] - _TAIL))
        read_to_ends(consumer, keep, timeout=60.0)
    finally:
        consumer.close(autocommit=False)
    return found


def state_of(datasets: Iterable[DatasetKept], running: bool) -> JobState:
    """``running`` while a ledger worker of it is in its group; else
    ``halted`` when every dataset reached its budget, ``finished`` when each reached
    it or ran out of rows, ``interrupted`` when some were still open (a rerun of the
    same config resumes them)."""
    statuses = [d.status for d in datasets]
    if running:
        return "running"
    if statuses and all(s == "halted" for s in statuses):
        return "halted"
    if statuses and all(s in ("halted", "exhausted") for s in statuses):
        return "finished"
    return "interrupted"


def describe(bootstrap: str, name: str, lag: GroupLag | None = None) -> Job | None:
    """The job of namespace ``name``, None when it holds no record of one."""
    topics = Topics(name)
    recorded = read_recorded(bootstrap, topics, legacy=True)
    if recorded is None:
        return None
    snapshots = latest_snapshots(bootstrap, topics)
    datasets = []
    for dataset in recorded.datasets:
        snap = snapshots.get(dataset.name)
        datasets.append(
            DatasetKept(
                name=dataset.name,
                budget=snap.budget if snap is not None else None,
                kept=budget.used(snap) if snap is not None else 0,
                unit=snap.unit if snap is not None else "-",
                status=snap.status if snap is not None else "-",
            )
        )
    own = lag or GroupLag(bootstrap)
    try:
        # A job runs while its ledger does (a job's dispatchers are static members of
        # their group: they stay in it for their session after they stop).
        running = own.members(topics.ledger_app_id) > 0
    finally:
        if lag is None:
            own.close()
    return Job(
        name=name,
        datasets=datasets,
        state=state_of(datasets, running),
        first_run=recorded.first_at or None,
        last_run=max((s.at for s in snapshots.values()), default=None),
        config=recorded.config or _config_of(recorded.recorded_by),
    )


def _config_of(recorded_by: str) -> str:
    """The config of a record made before records named it (``run job.toml``)."""
    _, _, config = recorded_by.partition(" ")
    return config


def every_job(bootstrap: str) -> list[Job]:
    """Every job on ``bootstrap``, by name."""
    lag = GroupLag(bootstrap)
    try:
        return [j for n in job_names(bootstrap) if (j := describe(bootstrap, n, lag)) is not None]
    except KafkaError as exc:
        raise BrokerError(f"listing the jobs on {bootstrap} failed: {exc!r}") from exc
    finally:
        lag.close()


def to_json(jobs: list[Job]) -> dict[str, Any]:
    return {"jobs": [{**asdict(job), "kept": job.kept, "budget": job.budget} for job in jobs]}


def _when(at: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(at)) if at else "-"


def table(jobs: list[Job]) -> str:
    headers = ["job", "datasets", "kept", "budget", "state", "first run", "last run", "config"]
    rows = [
        [
            printable(job.name),
            printable(", ".join(d.name for d in job.datasets)),
            f"{job.kept:,}",
            f"{job.budget:,}",
            job.state,
            _when(job.first_run),
            _when(job.last_run),
            printable(job.config) or "-",
        ]
        for job in jobs
    ]
    return format_table(headers, rows)
