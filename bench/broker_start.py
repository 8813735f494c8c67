"""How long the local Kafka broker takes to start, fresh and on restart, and the CPU
it spends doing so, with the server JIT (a job's broker, the baseline) against
``quick_start`` (C1 alone, the serial collector: the brokers of tests and dev clusters).

    .venv/bin/python bench/broker_start.py [--version 4.1.1] [--runs 3] [--idle 30]

Prints, per profile, seconds from `broker.up()` to a successful metadata call (jars
already cached) for a freshly formatted home and for a restart of the same home; the
CPU seconds of the broker JVM when it is ready (from /proc, the storage format's JVM
apart) and over ``--idle`` seconds after. Uses a temporary home on free ports;
leaves nothing running.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from tokenbudget.dev.jobs import cpu_seconds
from tokenbudget.dev.ports import free_ports
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.process import running_pid
from tokenbudget.localkafka.settings import BrokerSettings
from tokenbudget.localkafka.storage import ensure_jars


def median(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}, min {min(values):.2f}, max {max(values):.2f}"


def profile(version: str, quick: bool, runs: int, idle_s: float) -> None:
    fresh, restart, ready_cpu, idle_cpu = [], [], [], []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as home:
            port, controller_port = free_ports(2)
            settings = BrokerSettings(
                home=Path(home) / "broker",
                port=port,
                controller_port=controller_port,
                kafka_version=version,
                quick_start=quick,
            )
            ensure_jars(settings)
            t0 = time.monotonic()
            broker.up(settings, [])
            fresh.append(time.monotonic() - t0)
            broker.down(settings)
            t0 = time.monotonic()
            broker.up(settings, [])
            restart.append(time.monotonic() - t0)
            pid = running_pid(settings)
            ready = cpu_seconds(pid) if pid else None
            time.sleep(idle_s)
            later = cpu_seconds(pid) if pid else None
            assert ready is not None and later is not None, "the broker is not running"
            ready_cpu.append(ready)
            idle_cpu.append(later - ready)
            broker.down(settings)
    name = "quick_start (C1, serial GC)" if quick else "server JIT, G1 (baseline)"
    print(f"kafka {version} {name}, {runs} runs:")
    print(f"  fresh (format + start) s: {median(fresh)}")
    print(f"  restart s:                {median(restart)}")
    print(f"  broker CPU s when ready:  {median(ready_cpu)}")
    print(f"  broker CPU s over {idle_s:g} s idle: {median(idle_cpu)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", default=BrokerSettings.from_env().kafka_version)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--idle", type=float, default=30.0)
    args = parser.parse_args()
    for quick in (False, True):
        profile(args.version, quick, args.runs, args.idle)


if __name__ == "__main__":
    main()
