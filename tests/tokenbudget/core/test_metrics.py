from __future__ import annotations

import logging
import socket

import pytest
from prometheus_client import REGISTRY

from tokenbudget.core import metrics


def test_every_metric_is_declared_in_the_metrics_module_with_the_prefix() -> None:
    import re
    from pathlib import Path

    from tokenbudget.core import metrics

    root = Path(metrics.__file__).resolve().parents[2]
    # Declaring a metric needs prometheus_client's classes: only tokenbudget/core/metrics.py
    # may import them (collections.Counter and the like are not metrics).
    client = re.compile(r"^\s*(from prometheus_client\b|import prometheus_client\b)", re.M)
    for package in ("tokenbudget", "streams", "producers", "sinks"):
        for path in (root / package).rglob("*.py"):
            if path.name == "metrics.py" and path.parent.name == "core":
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
    from tokenbudget.core.metrics import LagSampler

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
    from tokenbudget.core import metrics

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

    from tokenbudget.core import metrics

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


def test_a_taken_port_is_a_warning_and_no_endpoint_not_a_crash(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker of run whose port another job took meanwhile runs on without
    /metrics, instead of exiting (and being started again) for ever."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.WARNING, logger="tokenbudget.core.metrics"):
            assert metrics.serve("127.0.0.1", port, "ns", "ledger") is False
    assert f"the ledger's metrics port 127.0.0.1:{port} is taken" in caplog.text
