"""Throwaway smoke test: does a Faust table work, and recover, against a given broker?

    python bench/faust_smoke.py --bootstrap 127.0.0.1:19092 [--messages 1000]

Pre-creates a source topic and the table's changelog (4 partitions each, with
tokenbudget.localkafka.broker.ensure_topics), starts a Faust worker in a subprocess (memory
store, so the second worker can only get its table back from the changelog), produces
messages with kafka-python, waits until the table's per-key counts match, stops the
worker (SIGTERM), optionally runs --between (say, a broker restart), starts a new
worker process and waits until its table holds the same counts again, then watches it
a few seconds more for double counting. Prints a JSON summary; exit code 0 when both
phases match and the second worker processed no source event (its table came from
the changelog alone).

The worker writes its table to a JSON snapshot file twice a second; that is how the
driver sees the table from outside.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TABLE = "counts"
PARTITIONS = 4


def changelog_name(app_id: str) -> str:
    return f"{app_id}-{TABLE}-changelog"


# --------------------------------------------------------------------------- worker


def run_worker(args: argparse.Namespace) -> None:
    import faust

    app = faust.App(
        args.app_id,
        broker=f"kafka://{args.bootstrap}",
        store="memory://",
        web_enabled=False,
        topic_partitions=PARTITIONS,
        key_serializer="raw",
        value_serializer="raw",
    )
    source = app.topic(args.source, key_type=bytes, value_type=bytes, partitions=PARTITIONS)
    counts = app.Table(TABLE, default=int, partitions=PARTITIONS)
    snapshot = Path(args.snapshot)
    processed = [0]  # source events this process handled (recovery does not count)

    @app.agent(source)
    async def count(stream):  # type: ignore[no-untyped-def]
        async for key, _value in stream.items():
            counts[key.decode()] += 1
            processed[0] += 1

    @app.timer(0.5)
    async def write_snapshot() -> None:
        data = {
            "pid": os.getpid(),
            "t": time.time(),
            "recovered": app.tables.recovery.completed.is_set(),
            "processed": processed[0],
            "counts": dict(counts.items()),
        }
        tmp = snapshot.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, snapshot)

    faust.Worker(app, loglevel="warning").execute_from_commandline()


# --------------------------------------------------------------------------- driver


def start_worker(args: argparse.Namespace, snapshot: Path, log_path: Path) -> subprocess.Popen:
    snapshot.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--role",
        "worker",
        "--bootstrap",
        args.bootstrap,
        "--app-id",
        args.app_id,
        "--source",
        args.source,
        "--snapshot",
        str(snapshot),
    ]
    with log_path.open("ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def read_snapshot(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def wait_counts(
    proc: subprocess.Popen, snapshot: Path, expected: dict[str, int], timeout: float
) -> tuple[bool, float, dict | None]:
    t0 = time.monotonic()
    snap = None
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            return False, time.monotonic() - t0, snap
        snap = read_snapshot(snapshot)
        if snap and snap["counts"] == expected:
            return True, time.monotonic() - t0, snap
        time.sleep(0.2)
    return False, time.monotonic() - t0, snap


def stop_worker(proc: subprocess.Popen, timeout: float = 60) -> tuple[int | None, float]:
    t0 = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode, time.monotonic() - t0


def produce(bootstrap: str, topic: str, n: int, keys: int) -> dict[str, int]:
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    expected: Counter[str] = Counter()
    for i in range(n):
        key = f"k{i % keys}"
        producer.send(topic, key=key.encode(), value=f"{i}".encode())
        expected[key] += 1
    producer.flush(30)
    producer.close()
    return dict(expected)


def committed_vs_end(bootstrap: str, group: str, topic: str) -> dict[str, object]:
    """The group's committed offsets on ``topic`` against the topic's end offsets."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.admin import KafkaAdminClient

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        committed = admin.list_group_offsets({group: None}).get(group, {})
    finally:
        admin.close()
    consumer = KafkaConsumer(bootstrap_servers=bootstrap)
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        end = consumer.end_offsets(tps)
    finally:
        consumer.close()
    got = {tp.partition: committed[tp].offset if tp in committed else None for tp in tps}
    want = {tp.partition: end[tp] for tp in tps}
    # a partition that never had a message has no committed offset: same as 0
    done = all((got[p] or 0) == want[p] for p in want)
    return {"committed": got, "end": want, "all_committed": done}


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_driver(args: argparse.Namespace) -> int:
    from tokenbudget.core.kafka_admin import ensure_topics
    from tokenbudget.streams.topics import TopicSpec

    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="faust-smoke-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ensure_topics(
        args.bootstrap,
        [
            TopicSpec(args.source, PARTITIONS),
            TopicSpec(changelog_name(args.app_id), PARTITIONS, {"cleanup.policy": "compact"}),
        ],
    )
    summary: dict = {"bootstrap": args.bootstrap, "app_id": args.app_id, "workdir": str(workdir)}
    snapshot = workdir / "table.json"

    # Phase 1: count.
    log1 = workdir / "worker1.log"
    proc = start_worker(args, snapshot, log1)
    try:
        expected = produce(args.bootstrap, args.source, args.messages, args.keys)
        ok, took, snap = wait_counts(proc, snapshot, expected, args.timeout)
        summary["phase1"] = {
            "ok": ok,
            "seconds_to_totals": round(took, 1),
            "counts": snap and snap["counts"],
        }
    finally:
        code, stop_s = stop_worker(proc)
    summary["phase1"].update(
        exit_code=code, stop_seconds=round(stop_s, 1), processed=snap and snap.get("processed")
    )
    summary["phase1"]["offsets"] = committed_vs_end(args.bootstrap, args.app_id, args.source)
    if not ok:
        summary["phase1"]["log_tail"] = log_tail(log1)
        print(json.dumps(summary, indent=1))
        return 1

    if args.between:  # e.g. restart the broker between the two workers
        t0 = time.monotonic()
        between = subprocess.run(args.between, shell=True, capture_output=True, text=True)
        summary["between"] = {
            "command": args.between,
            "rc": between.returncode,
            "seconds": round(time.monotonic() - t0, 1),
            "output": (between.stdout + between.stderr)[-1000:],
        }
        if between.returncode != 0:
            print(json.dumps(summary, indent=1))
            return 1

    # Phase 2: a new process must get the same table back from the changelog.
    log2 = workdir / "worker2.log"
    proc = start_worker(args, snapshot, log2)
    try:
        ok2, took2, snap2 = wait_counts(proc, snapshot, expected, args.timeout)
        stable = False
        if ok2:  # reprocessed (uncommitted) events would show up as counts above expected
            time.sleep(args.settle)
            snap3 = read_snapshot(snapshot)
            stable = bool(snap3) and snap3["counts"] == expected
            snap2 = snap3
        from_changelog = bool(snap2) and snap2.get("processed") == 0
        summary["phase2"] = {
            "ok": ok2 and stable and from_changelog,
            "seconds_to_recovered_totals": round(took2, 1),
            "stable_after_s": args.settle if stable else None,
            "recovered_flag": snap2 and snap2.get("recovered"),
            # 0 = the totals came from the changelog alone, not
            # from re-reading the source topic
            "processed_source_events": snap2 and snap2.get("processed"),
            "counts": snap2 and snap2["counts"],
        }
    finally:
        code2, stop2 = stop_worker(proc)
    summary["phase2"].update(exit_code=code2, stop_seconds=round(stop2, 1))
    if not summary["phase2"]["ok"]:
        summary["phase2"]["log_tail"] = log_tail(log2)
    summary["expected"] = expected
    print(json.dumps(summary, indent=1))
    return 0 if summary["phase2"]["ok"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--bootstrap", required=True)
    parser.add_argument("--role", choices=["driver", "worker"], default="driver")
    parser.add_argument("--app-id", default=f"tb-smoke-{uuid.uuid4().hex[:8]}")
    parser.add_argument("--source", default=None)
    parser.add_argument("--snapshot", default=None)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--messages", type=int, default=1000)
    parser.add_argument("--keys", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=120)
    parser.add_argument("--settle", type=float, default=5.0)
    parser.add_argument(
        "--between",
        default=None,
        help="shell command run between the two workers, e.g. a broker restart",
    )
    args = parser.parse_args()
    args.source = args.source or f"{args.app_id}-source"
    if args.role == "worker":
        run_worker(args)
        return 0
    return run_driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
