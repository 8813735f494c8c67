"""Replay throughput: a completions topic into Parquet, against pyarrow's own speed.

Generates ``--events`` completions of realistic size (1,500-4,000 token ids each,
Zipf-distributed ids below 151,643, the server's text at ~4 characters per token,
8 datasets, 0.5% duplicates as left by dispatcher retries) into a fresh namespace,
replays the topic into Parquet with ``tokenbudget replay``'s code path and prints
events/s and MB/s. Beside it, the ceiling: the time pyarrow alone takes to write
the very same tables (same files, row groups and options) from memory, so the
ratio ceiling / replay shows our overhead (reading Kafka, decoding JSON, building
columns, the first-completion rule). The topics are deleted at the end.

Completions are written as this build writes them (v2: ids as int32 bytes);
``--v1-ids`` writes them as version 1 did (ids as JSON numbers), to measure the
replay of an old topic.

    .venv/bin/python bench/replay.py --bootstrap 127.0.0.1:9092 [--events 200000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgspec
import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kafka import KafkaAdminClient, KafkaProducer

from tokenbudget.core import kafka_admin
from tokenbudget.sinks.parquet import write_parquet
from tokenbudget.sinks.replay import replay
from tokenbudget.sinks.replay_range import ReplayOptions
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.fields import TokenIds
from tokenbudget.streams.topics import Topics

VOCAB = 151_643
DATASETS = [f"B{i}_bench" for i in range(1, 9)]
WORDS = np.array(
    [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "that",
        "for",
        "it",
        "with",
        "as",
        "was",
        "on",
        "be",
        "by",
        "this",
        "are",
        "or",
        "from",
        "at",
        "an",
        "which",
        "def",
        "return",
        "self",
        "import",
        "if",
        "else",
        "for",
        "while",
        "print",
        "value",
        "result",
        "data",
        "list",
        "dict",
        "class",
        "function",
        "variable",
        "number",
        "string",
        "error",
        "true",
        "false",
        "none",
        "first",
        "second",
        "answer",
        "step",
        "therefore",
        "because",
        "since",
        "we",
        "let",
        "x",
        "y",
        "z",
        "equal",
        "sum",
        "total",
    ]
)


def generate(rng: np.random.Generator, i: int, chars_per_token: float) -> ev.CompletionEvent:
    n = int(rng.integers(1500, 4001))
    ids = (rng.zipf(1.15, n) + rng.integers(0, 50, n)) % VOCAB
    text = ""
    if chars_per_token > 0:
        words = WORDS[rng.integers(0, len(WORDS), int(n * chars_per_token / 5))]
        text = " ".join(words.tolist())
    now = time.time()
    return ev.CompletionEvent(
        request_id=uuid.uuid4().hex,
        prompt_id=f"bench-{i:08d}",
        dataset=DATASETS[i % len(DATASETS)],
        prompt_tokens=int(rng.integers(50, 2000)),
        completion_tokens=n,
        output_ids=TokenIds(ids),
        finish_reason="stop" if n < 4000 else "length",
        max_new_tokens=4096,
        text=text,
        dispatched_at=now - 30,
        first_token_at=now - 29,
        finished_at=now,
    )


def v1_wire(event: ev.CompletionEvent) -> bytes:
    """The bytes a version 1 writer produced: ids as a JSON array of numbers."""
    wire = msgspec.json.decode(codec.encode(event))
    wire.update(v=1, output_ids=event.output_ids.tolist())
    return msgspec.json.encode(wire)


def produce(
    bootstrap: str, topic: str, events: int, chars_per_token: float, seed: int, v1: bool = False
) -> int:
    rng = np.random.default_rng(seed)
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        acks=1,
        linger_ms=50,
        batch_size=4 * 1024 * 1024,
        max_request_size=16 * 1024 * 1024,
    )
    total = 0
    previous: list[ev.CompletionEvent] = []
    for i in range(events):
        if previous and rng.random() < 0.005:
            # a dispatcher that crashed before committing sent this prompt again
            old = previous[int(rng.integers(0, len(previous)))]
            event = ev.CompletionEvent(
                **{f: getattr(old, f) for f in old.__struct_fields__ if f != "request_id"},
                request_id=uuid.uuid4().hex,
            )
        else:
            event = generate(rng, i, chars_per_token)
            previous = [*previous[-50:], event]
        value = v1_wire(event) if v1 else codec.encode(event)
        total += len(value)
        producer.send(topic, key=event.dataset.encode(), value=value)
        if i and i % 20_000 == 0:
            print(f"  produced {i:,} events, {total / 1e9:.2f} GB", file=sys.stderr, flush=True)
    producer.flush()
    producer.close()
    return total


def cpu_seconds() -> float:
    """User and system CPU time of this process so far, every thread included."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def ceiling(out: Path, scratch: Path) -> tuple[float, float, int]:
    """Seconds (and CPU seconds) pyarrow takes to write the replay's tables again,
    file by file, from memory, with the same options and row groups; and the rows."""
    tables = []
    for file in sorted(out.glob("dataset=*/*.parquet")):
        meta = pq.ParquetFile(file).metadata
        group = meta.row_group(0).num_rows if meta.num_row_groups else 1
        tables.append((pq.read_table(file), group))
    rows = sum(t.num_rows for t, _ in tables)
    started, cpu = time.perf_counter(), cpu_seconds()
    for i, (table, group) in enumerate(tables):
        with (scratch / f"{i}.parquet").open("wb") as handle:
            write_parquet(table, handle, group)
    return time.perf_counter() - started, cpu_seconds() - cpu, rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--events", type=int, default=200_000)
    parser.add_argument("--chars-per-token", type=float, default=4.0, help="0: no text")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--v1-ids", action="store_true", help="ids as JSON numbers (old topics)")
    parser.add_argument("--workdir", help="default: a temporary folder, removed after")
    parser.add_argument("--keep-topics", action="store_true")
    parser.add_argument(
        "--reuse-namespace", metavar="NS", help="replay NS's topic (left by --keep-topics)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    topics = Topics(args.reuse_namespace or f"bench-replay-{uuid.uuid4().hex[:8]}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="tb-bench-replay-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out, scratch = workdir / "out", workdir / "ceiling"
    scratch.mkdir(exist_ok=True)
    kafka_admin.ensure_topics(args.bootstrap, topics.specs())
    try:
        if not args.reuse_namespace:
            started = time.perf_counter()
            produced = produce(
                args.bootstrap,
                topics.completions,
                args.events,
                args.chars_per_token,
                args.seed,
                v1=args.v1_ids,
            )
            produce_s = time.perf_counter() - started
            print(
                f"produced {args.events:,} completions ({produced / 1e9:.2f} GB of JSON, "
                f"{'v1' if args.v1_ids else 'v2'} ids) "
                f"to {topics.completions} in {produce_s:.1f} s",
                file=sys.stderr,
            )
        load_before = os.getloadavg()[0]
        cpu = cpu_seconds()
        summary = replay(
            ReplayOptions(bootstrap=args.bootstrap, topics=topics, to_parquet=out),
            progress=True,
        )
        replay_cpu_s = cpu_seconds() - cpu
        ceiling_s, ceiling_cpu_s, rows = ceiling(out, scratch)
        load_after = os.getloadavg()[0]
    finally:
        if not args.keep_topics:
            admin = KafkaAdminClient(bootstrap_servers=args.bootstrap)
            try:
                admin.delete_topics([spec.name for spec in topics.specs()])
            finally:
                admin.close()
        shutil.rmtree(scratch, ignore_errors=True)
    parquet_bytes = sum(f.stat().st_size for f in out.glob("dataset=*/*.parquet"))
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    assert summary.parquet is not None
    written = sum(summary.parquet["rows"].values())
    result = {
        "events": summary.events,
        "kept": summary.kept,
        "duplicates": summary.duplicates,
        "rows_written": written,
        "json_mb": round(summary.bytes / 1e6, 1),
        "parquet_mb": round(parquet_bytes / 1e6, 1),
        "replay_s": round(summary.seconds, 2),
        "replay_events_per_s": round(summary.events / summary.seconds),
        "replay_mb_per_s": round(summary.bytes / 1e6 / summary.seconds, 1),
        "pyarrow_ceiling_s": round(ceiling_s, 2),
        "ratio": round(ceiling_s / summary.seconds, 3),
        # busy seconds per replay stage (three threads, so they overlap)
        "stage_seconds": {k: round(v, 2) for k, v in summary.stages.items()},
        # CPU seconds of this process (the broker's are not counted), and the
        # machine's 1-minute load average before the replay and after the ceiling:
        # other processes on the box slow the replay's threads more than the
        # ceiling's single one
        "replay_cpu_s": round(replay_cpu_s, 2),
        "pyarrow_ceiling_cpu_s": round(ceiling_cpu_s, 2),
        "load_average": [round(load_before, 2), round(load_after, 2)],
    }
    assert rows == written == summary.kept, (rows, written, summary.kept)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"replay: {result['events']:,} events ({result['json_mb']:,} MB JSON) -> "
            f"{written:,} rows ({result['parquet_mb']:,} MB Parquet), "
            f"{result['duplicates']:,} duplicates dropped\n"
            f"replay: {result['replay_s']} s, {result['replay_events_per_s']:,} events/s, "
            f"{result['replay_mb_per_s']:,} MB/s\n"
            f"pyarrow alone (write the same tables from memory): {result['pyarrow_ceiling_s']} s\n"
            f"ratio (ceiling / replay): {result['ratio']:.1%}\n"
            "replay stages, busy seconds (overlapping threads): "
            + ", ".join(f"{k} {v}" for k, v in result["stage_seconds"].items())
            + f"\ncpu seconds: replay {result['replay_cpu_s']}, pyarrow alone "
            f"{result['pyarrow_ceiling_cpu_s']}; load average {load_before:.2f} -> "
            f"{load_after:.2f} on {os.cpu_count()} cpus"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
