"""How long a kafka-python client takes to bootstrap when listed brokers are down.

    .venv/bin/python bench/bootstrap.py [--trials 300] [--dead 2] [--timeout-s 30]
                                        [--bootstrap HOST:PORT]

Each trial builds the product's admin client (:func:`kafka_admin.admin_client`, as
``ensure_topics`` and the readiness probe do) on a list of ``--dead`` addresses where
nothing listens followed by the live broker's, the way a client of a cluster with a
node down is configured, and times its bootstrap. Trials alternate between
kafka-python's own reconnect backoff (it grows to 30 s) and ours
(``kafka_python_options``: capped at 1 s, as Java's client is), in the same run on
the same broker; a trial that does not bootstrap within ``--timeout-s`` counts as
failed. The first row is the baseline.
"""

from __future__ import annotations

import argparse
import socket
import time
from typing import Any

from kafka.errors import KafkaError

from tokenbudget.core import kafka_admin
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import BrokerSettings

# kafka-python's own default, the baseline.
LIBRARY_DEFAULT_MS = 30_000


def dead_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def bootstrap_once(listed: str, timeout_ms: int, backoff_max_ms: int | None) -> float | None:
    """Seconds to bootstrap, or None when it failed."""
    original = kafka_admin.kafka_python_options

    def options(base: Any) -> dict[str, Any]:
        built = original(base)
        if backoff_max_ms is not None:
            built["reconnect_backoff_max_ms"] = backoff_max_ms
        return built

    kafka_admin.kafka_python_options = options  # type: ignore[assignment]
    started = time.monotonic()
    try:
        admin = kafka_admin.admin_client(listed, timeout_ms=timeout_ms)
    except KafkaError:
        return None
    finally:
        kafka_admin.kafka_python_options = original  # type: ignore[assignment]
    seconds = time.monotonic() - started
    admin.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=300, help="per setting")
    parser.add_argument("--dead", type=int, default=2, help="dead addresses listed")
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--bootstrap", default="", help="a running broker (default: local)")
    args = parser.parse_args()
    live = args.bootstrap or broker.up(BrokerSettings.from_env(), [])
    settings = {
        f"kafka-python's default ({LIBRARY_DEFAULT_MS} ms)": LIBRARY_DEFAULT_MS,
        "ours (kafka_python_options)": None,
    }
    times: dict[str, list[float | None]] = {name: [] for name in settings}
    for _ in range(args.trials):
        for name, backoff in settings.items():
            listed = ",".join([*(dead_address() for _ in range(args.dead)), live])
            times[name].append(bootstrap_once(listed, int(args.timeout_s * 1000), backoff))
    print(f"{args.trials} bootstraps each through {args.dead} dead addresses and {live}:")
    print(f"{'backoff cap':<40} {'failed':>7} {'over 1 s':>9} {'over 5 s':>9} {'max ok s':>9}")
    for name, measured in times.items():
        ok = [t for t in measured if t is not None]
        failed = len(measured) - len(ok)
        slow = sum(1 for t in ok if t > 1.0)
        slower = sum(1 for t in ok if t > 5.0)
        print(f"{name:<40} {failed:>7} {slow:>9} {slower:>9} {max(ok, default=0):>9.2f}")


if __name__ == "__main__":
    main()
