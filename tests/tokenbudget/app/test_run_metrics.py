"""Where ``run`` serves its metrics: the documented port, or the next free block."""

from __future__ import annotations

import socket

import httpx
import pytest

from tokenbudget.app.run_metrics import ledger_port_offset, serve_metrics
from tokenbudget.core.config import build


def free_block(size: int) -> int:
    """A port with ``size`` free ports from it on."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + size >= 65536:
            continue
        try:
            holders = []
            for port in range(base, base + size):
                holder = socket.socket()
                holders.append(holder)
                holder.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for holder in holders:
                holder.close()
    raise AssertionError("no free block of ports")


def test_ports_of_ledgers_follow_the_extra_dispatchers() -> None:
    # run P, ledger 1 P+1, dispatchers 2..4 P+2..P+4, ledgers 2..3 P+5..P+6
    assert [ledger_port_offset(i, 4) for i in range(3)] == [1, 5, 6]
    assert [ledger_port_offset(i, 1) for i in range(3)] == [1, 2, 3]


def test_a_taken_port_moves_run_to_the_next_free_block_and_says_where(
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = free_block(8)
    config = build({"metrics": {"port": base}, "kafka": {"namespace": "held"}}, environ={})
    with socket.socket() as other_job:
        other_job.bind(("127.0.0.1", base))
        other_job.listen()
        moved = serve_metrics(config, dispatchers=1, ledgers=1)
    # run and its ledger need two ports: the block after the taken one
    assert moved.metrics.port == base + 2
    err = capsys.readouterr().err
    assert f"http://127.0.0.1:{base + 2}/metrics ({base} is taken)" in err
    body = httpx.get(f"http://127.0.0.1:{base + 2}/metrics").text
    assert 'role="run"' in body and 'namespace="held"' in body


def test_port_zero_serves_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    config = build({"metrics": {"port": 0}}, environ={})
    assert serve_metrics(config, dispatchers=3, ledgers=2) is config
    assert capsys.readouterr().err == ""


def test_prometheus_scrapes_every_port_a_default_run_serves() -> None:
    """The shipped scrape config covers run's default block, with extra dispatchers
    and ledgers (a third extra dispatcher once landed on an unscraped port)."""
    from pathlib import Path

    import yaml

    from tokenbudget.app.run_metrics import _metrics_offsets

    config = yaml.safe_load(
        (Path(__file__).parents[3] / "infra" / "prometheus" / "prometheus.yml").read_text()
    )
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "tokenbudget"]
    scraped = {int(t.rsplit(":", 1)[1]) for c in job["static_configs"] for t in c["targets"]}
    port = build({}, environ={}).metrics.port
    assert port == 9464
    for dispatchers, ledgers in ((1, 1), (4, 1), (4, 3), (1, 4)):
        served = {port + offset for offset in _metrics_offsets(dispatchers, ledgers)}
        assert served <= scraped, (dispatchers, ledgers, sorted(served - scraped))
