from __future__ import annotations

from prometheus_client import REGISTRY

from streams.ledger import DatasetLedger
from tokenbudget.metrics import LedgerGauges


def value(name: str, dataset: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"dataset": dataset})


def test_ledger_gauges_follow_the_ledger_state() -> None:
    gauges = LedgerGauges()
    gauges.observe(DatasetLedger(dataset="gauged", budget=1000, completion_tokens=400, samples=2))
    gauges.observe(
        DatasetLedger(dataset="gauged", budget=1000, completion_tokens=1100, samples=3, halted=True)
    )
    assert value("tokenbudget_completion_tokens_total", "gauged") == 1100
    assert value("tokenbudget_samples_total", "gauged") == 3
    assert value("tokenbudget_budget_tokens", "gauged") == 1000
    assert value("tokenbudget_budget_remaining_tokens", "gauged") == 0
    assert value("tokenbudget_overshoot_tokens", "gauged") == 100
    assert value("tokenbudget_dataset_halted", "gauged") == 1


def test_ledger_gauges_export_used_open_and_reserved() -> None:
    from streams.ledger import DatasetLedger as Ledger

    gauges = LedgerGauges()
    gauges.observe(Ledger(dataset="fresh", budget=500))
    # Series exist from the first state on, at zero: "no progress" is visible.
    assert value("tokenbudget_completion_tokens_total", "fresh") == 0
    assert value("tokenbudget_samples_total", "fresh") == 0
    assert value("tokenbudget_dataset_open", "fresh") == 1
    assert value("tokenbudget_reserved_tokens", "fresh") == 0
    gauges.observe(
        Ledger(
            dataset="fresh",
            budget=500,
            unit="total_tokens",
            completion_tokens=300,
            prompt_tokens=250,
            samples=2,
            halted=True,
        )
    )
    assert value("tokenbudget_budget_used_tokens", "fresh") == 550
    assert value("tokenbudget_overshoot_tokens", "fresh") == 50
    assert value("tokenbudget_dataset_open", "fresh") == 0
    assert value("tokenbudget_prompt_tokens_total", "fresh") == 250


def test_reserved_and_open_leases_come_from_the_ledgers_leases() -> None:
    from streams.ledger import DatasetLedger as Ledger
    from streams.ledger import Lease

    gauges = LedgerGauges()
    gauges.observe(Ledger(dataset="reserving", budget=10_000))
    assert value("tokenbudget_reserved_tokens", "reserving") == 0
    assert value("tokenbudget_open_leases", "reserving") == 0
    leases = {
        "a": Lease(holder="d1", granted=4096, committed=1000, expires_at=0.0),
        "b": Lease(holder="d2", granted=2048, expires_at=0.0),
    }
    gauges.observe(Ledger(dataset="reserving", budget=10_000, leases=leases))
    assert value("tokenbudget_reserved_tokens", "reserving") == 3096 + 2048
    assert value("tokenbudget_open_leases", "reserving") == 2


def test_failed_prompts_are_counted_once_per_prompt() -> None:
    gauges = LedgerGauges()
    gauges.observe(DatasetLedger(dataset="failing", budget=100, failed=2))
    gauges.observe(DatasetLedger(dataset="failing", budget=100, failed=2))  # a repeat
    gauges.observe(DatasetLedger(dataset="failing", budget=100, failed=3))
    assert value("tokenbudget_failed_prompts_total", "failing") == 3


def test_every_metric_is_declared_in_the_metrics_module_with_the_prefix() -> None:
    import re
    from pathlib import Path

    from tokenbudget import metrics

    root = Path(metrics.__file__).resolve().parents[1]
    # Declaring a metric needs prometheus_client's classes: only tokenbudget/metrics.py
    # may import them (collections.Counter and the like are not metrics).
    client = re.compile(r"^\s*(from prometheus_client\b|import prometheus_client\b)", re.M)
    for package in ("tokenbudget", "streams", "producers", "sinks"):
        for path in (root / package).rglob("*.py"):
            if path.name == "metrics.py" and path.parent.name == "tokenbudget":
                continue
            assert not client.search(path.read_text()), f"{path} declares a metric"
    names = [
        m._name
        for m in vars(metrics).values()
        if type(m).__name__ in {"Counter", "Gauge", "Histogram"}
    ]
    assert len(names) >= 20
    assert all(name.startswith("tokenbudget_") for name in names)
    assert len(names) == len(set(names))


def test_lag_sampler_sets_lag_per_group_and_topic_role() -> None:
    from tokenbudget.metrics import LagSampler

    class FakeLag:
        def lag(self, group: str, topics: list[str]) -> int:
            return {"ns.prompts": 7, "ns.completions": 3}[topics[0]]

    checks = {"ns-dispatch": ["ns.prompts"], "ns-sink": ["ns.completions"]}
    sampler = LagSampler("unused:9092", checks)
    sampler.sample(FakeLag())
    lag = "tokenbudget_consumer_lag_events"
    assert REGISTRY.get_sample_value(lag, {"group": "dispatch", "topic": "prompts"}) == 7
    assert REGISTRY.get_sample_value(lag, {"group": "sink", "topic": "completions"}) == 3


def test_helpers() -> None:
    from tokenbudget import metrics

    assert metrics.topic_role("ns-1.completions") == "completions"
    assert metrics.group_role("ns-1-ledger") == "ledger"
    metrics.consumed("ns.prompts", "dispatcher", 3)
    assert (
        REGISTRY.get_sample_value(
            "tokenbudget_events_consumed_total", {"topic": "prompts", "consumer": "dispatcher"}
        )
        or 0
    ) >= 3


def test_serve_exposes_metrics_once_per_port() -> None:
    import socket

    import httpx

    from tokenbudget import metrics

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics.serve("127.0.0.1", port, "job-a", "run")
    metrics.serve(
        "127.0.0.1", port, "job-a", "run"
    )  # a second call is a no-op, not "address in use"
    metrics.serve("127.0.0.1", 0, "job-a", "run")  # disabled
    metrics.BUDGET.labels(dataset="served").set(7)
    body = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    assert "# TYPE tokenbudget_request_latency_seconds histogram" in body
    # Every series says which job it belongs to: two jobs' "served" never merge.
    assert 'tokenbudget_budget_tokens{dataset="served",namespace="job-a"} 7.0' in body
    assert 'role="run"' in next(
        row for row in body.splitlines() if row.startswith("tokenbudget_build_info{")
    )
    samples = [line for line in body.splitlines() if line and not line.startswith("#")]
    assert samples and all('namespace="job-a"' in line for line in samples)
