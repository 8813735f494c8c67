"""A job knows what it is: recorded with its first run, compared by every rerun.

A rerun resumes by ``prompt_id`` (the dataset's name and the row's id), so a second
job that shares a namespace and those names, with another file, model or output
folder, would skip every prompt and write nothing where its user looks. So ``run``
and ``produce`` record the job's identity (:class:`tokenbudget.streams.events.JobIdentity`, on
the namespace's control topic, kept forever) and compare each rerun with it before
anything is produced; NeMo Automodel's regeneration pins the same in a manifest.

What counts, per dataset: its rows (a hash of the file's bytes, wherever it lies)
and every setting its prompts or answers depend on: ``format``, ``turns``, ``n``,
``shuffle_seed``, ``template``, ``split``, any other ``[[datasets]]`` key that maps
its rows, ``max_new_tokens`` and the sampling settings in force. For the job:
``inference.api``, ``inference.model`` and ``sink.path``. What does not: budgets
(raising one and running again is the normal way on), ``limit``, ``keep_columns``
(columns beside the answer), concurrency, timeouts, the Kafka and budget-policy
settings.

A dataset added to a job has no history: it is recorded. One removed keeps its
record, so putting it back later is compared with what it was.

A rerun that matches resumes. One that differs stops before producing anything
(:class:`~tokenbudget.core.errors.JobChangedError`, naming what changed and the ways on),
unless resumed anyway (``--resume-changed``), which records the new identity. When
``sink.path`` moved, ``run`` first writes the rows earlier runs kept into the new
folder, replayed from the completions topic (the record of what was generated), so
no row already done is missing from the folder the user named.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import msgspec
import pyarrow.parquet as pq
import xxhash
from aiokafka import AIOKafkaProducer
from kafka import KafkaConsumer, TopicPartition

from tokenbudget.app.upgrade import move_commands
from tokenbudget.core.config import Config, Dataset
from tokenbudget.core.errors import DatasetError, EventDecodeError, JobChangedError
from tokenbudget.core.kafka import (
    aiokafka_producer_options,
    client_options,
    kafka_python_options,
    read_to_ends,
    wait_for_partitions,
)
from tokenbudget.core.names import UNNAMED_JOB, job_name_of
from tokenbudget.core.sampling import SAMPLING_KEYS
from tokenbudget.core.sizes import Compression
from tokenbudget.sinks.audit import live_snapshots
from tokenbudget.sinks.parquet import output_files
from tokenbudget.sinks.replay import replay
from tokenbudget.sinks.replay_range import ReplayOptions
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.fields import DatasetIdentity
from tokenbudget.streams.topics import Topics

Command = Literal["run", "produce"]

# ----------------------------------------------------------------- what a job is

HASH = "xxh3_128"
# A change detector needs no cryptographic hash, and a multi-GB dataset is hashed at
# every run's start. bench/content_hash.py, 4 GiB on this project's 2-core box:
# xxh3_128 5.9 GB/s from the page cache and 1.1 GB/s from disk (as fast as reading
# alone); SHA-256 0.6 GB/s either way.
_CHUNK = 1 << 20

# Dataset fields that are not its identity: its key; where the file lies (its
# content counts); how much of it to do (budget, limit); columns kept beside the
# answer. ``sampling`` is compared key by key. Any other field counts, those added
# later included (a key at its default is left out, so records made before the key
# existed still match).
NOT_IDENTITY = frozenset({"name", "path", "budget", "limit", "keep_columns", "sampling"})


def _defaults() -> dict[str, Any]:
    """Each dataset setting's value when unset: a record leaves those out."""
    out: dict[str, Any] = dict.fromkeys(SAMPLING_KEYS)
    for f in msgspec.structs.fields(Dataset):
        if not f.required and f.name not in NOT_IDENTITY:
            out[f.name] = msgspec.to_builtins(
                f.default if f.default_factory is msgspec.NODEFAULT else f.default_factory()
            )
    return out


DEFAULTS = _defaults()


def content_hash(path: Path) -> str:
    """``xxh3_128:<hex>`` of a file's bytes, read in 1 MiB chunks (any size, constant
    memory); of a folder (a Hugging Face ``save_to_disk``), its files' relative
    paths, sizes and bytes in sorted order, hidden files left out."""
    digest = xxhash.xxh3_128()
    try:
        if path.is_dir():
            for file in _data_files(path):
                name = file.relative_to(path).as_posix().encode()
                header = len(name).to_bytes(8, "little") + name
                digest.update(header + file.stat().st_size.to_bytes(8, "little"))
                _feed(digest, file)
        else:
            _feed(digest, path)
    except OSError as exc:
        raise DatasetError(str(path), f"cannot read it: {exc.strerror}") from exc
    return f"{HASH}:{digest.hexdigest()}"


def _data_files(folder: Path) -> Iterator[Path]:
    for file in sorted(folder.rglob("*")):
        relative = file.relative_to(folder).parts
        if file.is_file() and not any(part.startswith(".") for part in relative):
            yield file


def _feed(digest: Any, file: Path) -> None:
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    with file.open("rb", buffering=0) as handle:
        while n := handle.readinto(buffer):
            digest.update(view[:n])


def dataset_settings(dataset: Dataset) -> dict[str, Any]:
    """The dataset's identity settings that are not at their default."""
    settings: dict[str, Any] = {}
    for f in msgspec.structs.fields(Dataset):
        if f.name in NOT_IDENTITY:
            continue
        if f.name == "columns":
            # as the keys the user wrote (prompt_template's text, not its parse)
            settings.update(dataset.columns.settings())
            continue
        value = msgspec.to_builtins(getattr(dataset, f.name))
        if f.required or value != DEFAULTS[f.name]:
            settings[f.name] = value
    settings.update(msgspec.to_builtins(dict(sorted(dataset.sampling.items()))))
    return settings


def job_settings(config: Config) -> dict[str, Any]:
    return {
        "inference.api": config.inference.api,
        "inference.model": config.inference.model,
        "sink.path": str(config.sink_path),
    }


def identity_of(config: Config, *, at: float | None = None, by: str = "") -> ev.JobIdentity:
    """The job ``config`` describes (its dataset files hashed: blocking)."""
    at = time.time() if at is None else at
    return ev.JobIdentity(
        datasets=tuple(
            DatasetIdentity(
                name=d.name,
                file=str(d.path),
                content=content_hash(d.path),
                settings=dataset_settings(d),
            )
            for d in config.datasets
        ),
        settings=job_settings(config),
        first_at=at,
        recorded_at=at,
        recorded_by=by,
        config=str(Path(config.source).resolve()) if Path(config.source).is_file() else "",
    )


# ------------------------------------------------------------ comparing two jobs


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()


def differences(recorded: ev.JobIdentity, current: ev.JobIdentity) -> list[str]:
    """What ``current`` changes of the ``recorded`` job, one phrase each
    (``datasets[0] B1: data.jsonl content changed``); empty when it is that job.
    Datasets only one side has are no difference (see the module docstring)."""
    out = [
        f"{key} {_show(recorded.settings.get(key))} → {_show(current.settings.get(key))}"
        for key in dict.fromkeys([*current.settings, *recorded.settings])
        if recorded.settings.get(key) != current.settings.get(key)
    ]
    before = {d.name: d for d in recorded.datasets}
    for index, dataset in enumerate(current.datasets):
        old = before.get(dataset.name)
        if old is None:
            continue
        where = f"datasets[{index}] {dataset.name}"
        if old.content != dataset.content:
            moved = "" if old.file == dataset.file else f" ({old.file} → {dataset.file})"
            out.append(f"{where}: {Path(dataset.file).name} content changed{moved}")
        for key in dict.fromkeys([*dataset.settings, *old.settings]):
            was = old.settings.get(key, DEFAULTS.get(key))
            now = dataset.settings.get(key, DEFAULTS.get(key))
            if was != now:
                out.append(f"{where}: {key} {_show(was)} → {_show(now)}")
    return out


def merged(recorded: ev.JobIdentity, current: ev.JobIdentity) -> ev.JobIdentity:
    """The job from now on: ``current``, plus the datasets only the record has (so a
    dataset put back is compared with what it was), first run kept."""
    names = {d.name for d in current.datasets}
    kept = tuple(d for d in recorded.datasets if d.name not in names)
    return msgspec.structs.replace(
        current, datasets=current.datasets + kept, first_at=recorded.first_at
    )


def same_record(a: ev.JobIdentity, b: ev.JobIdentity) -> bool:
    """Whether recording ``b`` after ``a`` would add nothing (times aside)."""
    return a.settings == b.settings and sorted(a.datasets, key=_name) == sorted(
        b.datasets, key=_name
    )


def _name(dataset: DatasetIdentity) -> str:
    return dataset.name


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(at))


def since(recorded: ev.JobIdentity, namespace: str) -> str:
    """The run whose record a rerun was compared with, for its messages."""
    first = recorded.recorded_at <= recorded.first_at
    run = "the first run" if first else "the run that last recorded it"
    return f"{run} of job {namespace} ({_when(recorded.recorded_at)})"


def changed_message(
    changes: list[str], recorded: ev.JobIdentity, config: Config, command: Command
) -> str:
    """The one line a rerun that differs stops with: what changed, and the ways on,
    a new job first (the way its name is given), then this one resumed anyway."""
    shown = "; ".join(changes[:3]) + (f"; and {len(changes) - 3} more" if len(changes) > 3 else "")
    if config.kafka.namespace != config.job.name:
        new = "set another [kafka] namespace"
    else:
        new = "give it another name: [job] name, or save the config under another file name"
    return (
        f"{shown} since {since(recorded, config.kafka.namespace)}: for a new job, {new}; "
        f"to resume this one anyway, `tokenbudget {command} --resume-changed` (records "
        "the job as it is now)"
    )


# --------------------------------------------------- the record on the control topic

# Every record goes to one partition of the control topic, so a rerun reads one
# partition, not every dataset's budgets. The key is no dataset name (those have
# no "@").
RECORD_PARTITION = 0
RECORD_KEY = b"@job"


def read_recorded(
    bootstrap: str, topics: Topics, timeout: float = 120.0, *, legacy: bool = False
) -> ev.JobIdentity | None:
    """The namespace's latest job record, None before its first run (blocking).
    ``legacy``: also look on the budgets topic, where a namespace made before the
    control topic has it (``tokenbudget jobs``; a run moves it first,
    :mod:`tokenbudget.app.upgrade`), and give up on a topic that is not there at
    once instead of waiting for its metadata."""
    found = _latest_record(bootstrap, topics.control, timeout, wait=not legacy)
    if found is None and legacy:
        found = _latest_record(bootstrap, topics.budgets, timeout, wait=False)
    return found


def _latest_record(
    bootstrap: str, topic: str, timeout: float, *, wait: bool
) -> ev.JobIdentity | None:
    found: list[ev.JobIdentity] = []
    # A record is believed from the control topic only; an older namespace's, read
    # on its budgets topic, is the operators' of that time.
    where = topic if topic.endswith(".control") else None

    def keep(record: Any) -> None:
        if record.key != RECORD_KEY:
            return
        try:
            event = codec.decode(record.value, where)
        except EventDecodeError:
            return  # a newer build's record: this one cannot compare with it
        if isinstance(event, ev.JobIdentity):
            found.append(event)

    consumer = KafkaConsumer(
        **kafka_python_options(client_options(bootstrap)), group_id=None, enable_auto_commit=False
    )
    try:
        if wait:
            tps = wait_for_partitions(
                consumer, topic, timeout=60.0, missing=f"no metadata for {topic}"
            )
        else:
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                return None
            tps = [TopicPartition(topic, p) for p in sorted(parts)]
        tp = tps[RECORD_PARTITION]
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        read_to_ends(consumer, keep, timeout=timeout, max_records=10_000)
    finally:
        consumer.close(autocommit=False)
    return found[-1] if found else None


async def record(
    bootstrap: str, topics: Topics, identity: ev.JobIdentity, compression: Compression
) -> None:
    producer = AIOKafkaProducer(**aiokafka_producer_options(bootstrap, compression))
    await producer.start()
    try:
        await producer.send_and_wait(
            topics.control, codec.encode(identity), key=RECORD_KEY, partition=RECORD_PARTITION
        )
    finally:
        await producer.stop()


# ------------------------------------------------------------- a moved sink.path


def rows_in(root: Path, dataset: str) -> int:
    """Rows of ``dataset`` the sink has written under ``root`` (file footers only)."""
    return sum(pq.ParquetFile(f).metadata.num_rows for f in output_files(root, dataset))


def copy_earlier_rows(config: Config, bootstrap: str) -> dict[str, int]:
    """Write every row earlier runs kept of the job's datasets into ``sink.path``,
    replayed from the completions topic with the sink's rules (prompts already
    there are skipped); rows written per dataset (blocking)."""
    summary = replay(
        ReplayOptions(
            bootstrap=bootstrap,
            topics=Topics(config.kafka.namespace),
            datasets=frozenset(d.name for d in config.datasets),
            to_parquet=config.sink_path,
        ),
        progress=False,
    )
    return dict((summary.parquet or {}).get("rows", {}))


def missing_rows(config: Config, bootstrap: str) -> dict[str, tuple[int, int]]:
    """Datasets whose rows in ``sink.path`` are fewer than the ledger counted kept
    (its latest snapshot): name -> (rows there, kept) (blocking)."""
    snapshots = live_snapshots(bootstrap, Topics(config.kafka.namespace))
    out = {}
    for dataset in config.datasets:
        snap = snapshots.get(dataset.name)
        have = rows_in(config.sink_path, dataset.name)
        if snap is not None and have < snap.samples:
            out[dataset.name] = (have, snap.samples)
    return out


def _missing_message(
    config: Config, old_path: str, missing: dict[str, tuple[int, int]], command: Command
) -> str:
    name, (have, kept) = next(iter(missing.items()))
    where = f"{config.sink_path} holds {have} of the {kept} rows earlier runs kept of {name}"
    if command == "produce":
        only = "".join(f" --dataset {d.name}" for d in config.datasets)
        replay_command = (
            f"tokenbudget replay --config {config.source} --to-parquet {config.sink_path}{only}"
        )
        return (
            f"sink.path moved and {where}: write them there first, with no sink writing to "
            f"it, `{replay_command}`, then produce again with --resume-changed"
        )
    return (
        f"sink.path moved and {where} after replaying the completions topic (its retention "
        f"dropped the rest): copy {old_path}/dataset=*/ there, then run again with "
        "--resume-changed"
    )


# ------------------------------------------------------------------ the check


def _say(line: str) -> None:
    print(f"tokenbudget: {line}", file=sys.stderr)


async def settle(
    config: Config, bootstrap: str, *, resume_changed: bool = False, command: Command = "run"
) -> None:
    """Compare the job with the one its namespace recorded, before anything is
    produced: record it on a first run (or when it adds datasets); say so when it
    resumes; raise :class:`JobChangedError` when it differs, unless
    ``resume_changed`` (then a moved ``sink.path`` gets the earlier rows first, and
    the job is recorded as it is now)."""
    topics = Topics(config.kafka.namespace)
    current = await asyncio.to_thread(identity_of, config, by=f"{command} {config.source}")
    await asyncio.to_thread(move_commands, bootstrap, topics, config.kafka.compression)
    recorded = await asyncio.to_thread(read_recorded, bootstrap, topics)
    if recorded is None:
        earlier = await asyncio.to_thread(ran_unnamed, config, bootstrap, current)
        if earlier is not None:
            raise JobChangedError(unnamed_message(config, earlier))
        await record(bootstrap, topics, current, config.kafka.compression)
        return
    changes = differences(recorded, current)
    if changes and not resume_changed:
        raise JobChangedError(changed_message(changes, recorded, config, command))
    old_path = recorded.settings.get("sink.path")
    if changes and old_path != current.settings["sink.path"]:
        await _fill_moved_sink(config, bootstrap, str(old_path), command)
    if changes:
        _say(
            f"resuming job {topics.namespace} although {'; '.join(changes)} since "
            f"{since(recorded, topics.namespace)}: recorded as its job from now on"
        )
    else:
        _say(f"resuming the job unchanged since {since(recorded, topics.namespace)}")
    job = merged(recorded, current)
    if not same_record(recorded, job):
        await record(bootstrap, topics, job, config.kafka.compression)


# Where every job ran before jobs had names: a config that names neither its job nor
# a namespace ran there then, and runs under its file's name now.
UNNAMED_NAMESPACE = UNNAMED_JOB


def ran_unnamed(config: Config, bootstrap: str, current: ev.JobIdentity) -> ev.JobIdentity | None:
    """The record of this very job in :data:`UNNAMED_NAMESPACE`, when the config names
    neither its job nor a namespace (so it ran there before jobs had names) and that
    namespace's job is this one, unchanged; else None (blocking). Started anew under
    its file's name, it would spend its budgets a second time."""
    source = Path(config.source)
    if not source.is_file() or config.kafka.namespace in (UNNAMED_NAMESPACE, ""):
        return None
    if config.job.name != job_name_of(source) or config.kafka.namespace != config.job.name:
        return None  # named by its user: that is the job they mean
    earlier = read_recorded(bootstrap, Topics(UNNAMED_NAMESPACE), legacy=True)
    if earlier is None or differences(earlier, current):
        return None
    return earlier


def unnamed_message(config: Config, earlier: ev.JobIdentity) -> str:
    """The one line a first run of a job that ran before jobs had names stops with."""
    return (
        f"this config's job ran before jobs had names, in namespace {UNNAMED_NAMESPACE} "
        f"(first run {_when(earlier.first_at)}): to resume it, set [kafka] namespace = "
        f'"{UNNAMED_NAMESPACE}"; to start it anew as job {config.job.name}, set [job] '
        f'name = "{config.job.name}"'
    )


async def _fill_moved_sink(config: Config, bootstrap: str, old_path: str, command: Command) -> None:
    """``run``: the earlier rows written into the new ``sink.path``; both commands:
    refuse while any are missing there (``produce`` writes no Parquet)."""
    if command == "run":
        written = await asyncio.to_thread(copy_earlier_rows, config, bootstrap)
        per = ", ".join(f"{name} {n}" for name, n in written.items())
        _say(
            f"sink.path moved from {old_path}: wrote {sum(written.values())} rows earlier "
            f"runs kept ({per or 'none'}) into {config.sink_path}"
        )
    missing = await asyncio.to_thread(missing_rows, config, bootstrap)
    if missing:
        raise JobChangedError(_missing_message(config, old_path, missing, command))
