"""How long the local Kafka broker takes to start, fresh and on restart.

    .venv/bin/python bench/broker_start.py [--version 4.1.1] [--runs 3]

Prints, per run, seconds from `broker.up()` to a successful metadata call (jars
already cached), for a freshly formatted home and for a restart of the same home.
Uses a temporary home on free ports; leaves nothing running.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from tokenbudget.dev.ports import free_ports
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import BrokerSettings
from tokenbudget.localkafka.storage import ensure_jars


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--version", default=BrokerSettings.from_env().kafka_version)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    fresh, restart = [], []
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory() as home:
            port, controller_port = free_ports(2)
            settings = BrokerSettings(
                home=Path(home) / "broker",
                port=port,
                controller_port=controller_port,
                kafka_version=args.version,
            )
            ensure_jars(settings)
            t0 = time.monotonic()
            broker.up(settings, [])
            fresh.append(time.monotonic() - t0)
            broker.down(settings)
            t0 = time.monotonic()
            broker.up(settings, [])
            restart.append(time.monotonic() - t0)
            broker.down(settings)
    for name, values in (("fresh (format + start)", fresh), ("restart", restart)):
        print(
            f"kafka {args.version} {name}: median {statistics.median(values):.2f} s, "
            f"min {min(values):.2f} s, max {max(values):.2f} s over {len(values)} runs"
        )


if __name__ == "__main__":
    main()
