"""``run``'s metrics: where it serves /metrics (``[metrics] port``, or the next free
block of ports) and the ports of its workers after it, the overshoot each dataset
is allowed, and the consumer groups' lag sampled while it runs."""

from __future__ import annotations

import socket
import sys

import msgspec

from tokenbudget.core import metrics
from tokenbudget.core.config import Config
from tokenbudget.core.errors import ConfigError
from tokenbudget.streams import budget
from tokenbudget.streams.topics import Topics


def _ports_free(host: str, ports: list[int]) -> bool:
    for port in ports:
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                return False
    return True


def ledger_port_offset(index: int, dispatchers: int) -> int:
    """Metrics port of ``run``'s ledger worker ``index``, from ``run``'s own: the
    first on + 1 (it owns the budget gauges), the others after the extra dispatchers
    (which take + 2 to + dispatchers)."""
    return 1 if index == 0 else max(1, dispatchers) + index


def dispatcher_port_offset(index: int) -> int:
    """Metrics port of ``run``'s extra dispatcher ``index`` (0-based), from its own."""
    return 2 + index


def _metrics_offsets(dispatchers: int, ledgers: int) -> list[int]:
    extra = [dispatcher_port_offset(i) for i in range(max(0, dispatchers - 1))]
    return [0, *(ledger_port_offset(i, dispatchers) for i in range(ledgers)), *extra]


def serve_metrics(config: Config, dispatchers: int, ledgers: int) -> Config:
    """Serve ``run``'s /metrics on ``[metrics] port``, or on the next block of free
    ports when another job holds it (its ledgers and extra dispatchers take the ports
    after it); say where on stderr. Returns the config with the port taken."""
    wanted = config.metrics.port
    if not wanted:
        return config
    offsets = _metrics_offsets(dispatchers, ledgers)
    span = max(offsets) + 1
    host = config.metrics.host
    for base in range(wanted, wanted + 16 * span, span):
        ours = metrics.serving(host, base)  # a run before this one in this process
        wanted_free = [base + o for o in offsets if o or not ours]
        if base + span <= 65536 and _ports_free(host, wanted_free):
            break
    else:
        raise ConfigError(
            "metrics.port",
            f"no {span} free ports from {wanted} on {host}; set another port, or 0 for none",
            source=config.source,
        )
    metrics.serve(host, base, config.kafka.namespace, "run")
    moved = "" if base == wanted else f" ({wanted} is taken)"
    others = (
        f", its ledger on {base + 1}"
        if span == 2
        else f", its workers on {base + 1} to {base + span - 1}"
        if span > 2
        else ""
    )
    print(f"tokenbudget: metrics on http://{host}:{base}/metrics{moved}{others}", file=sys.stderr)
    return msgspec.structs.replace(
        config, metrics=msgspec.structs.replace(config.metrics, port=base)
    )


def set_overshoot_allowances(config: Config, dispatchers: int) -> None:
    """Each dataset's gauge of how far past its budget the job may end (by admission
    mode, concurrency, its longest answer and the dispatchers sharing it)."""
    for dataset in config.datasets:
        metrics.OVERSHOOT_ALLOWANCE.labels(dataset=dataset.name).set(
            budget.overshoot_allowance(
                config.budget.unit,
                config.budget.admission,
                config.concurrency,
                dataset.max_new_tokens,
                dispatchers,
            )
        )


def start_lag_sampler(config: Config, bootstrap: str) -> metrics.LagSampler:
    """The lag of the dispatchers', the ledger's and the sink's groups, sampled while
    the job runs when ``[metrics] port`` serves it (stop it at the end either way)."""
    topics = Topics(config.kafka.namespace)
    sampler = metrics.LagSampler(
        bootstrap,
        {
            topics.dispatch_group: [topics.prompts],
            topics.ledger_app_id: [topics.completions, topics.outcomes],
            topics.sink_group: [topics.completions],
        },
    )
    if config.metrics.port:
        sampler.start()
    return sampler
