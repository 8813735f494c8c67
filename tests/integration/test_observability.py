"""See and alert, end to end: a real pipeline run scraped by a real Prometheus, its
alerts delivered by a real Alertmanager to a local webhook, every dashboard panel
queried against that Prometheus, and ``tokenbudget status`` read from the ledger.

After the run a rogue producer keeps publishing completions of the halted dataset
``long`` straight to the completions topic, ignoring the halt: the ledger counts
them, so its kept tokens keep growing while it is halted (TokenBudgetHaltIgnored)
and its overshoot passes what requests in flight can explain (TokenBudgetOvershoot).
The run's fleet has a second server that never answers: it stays paused, polled,
while the first carries the job (TokenBudgetServerDown, for it alone).
The rules are the production file with every duration divided by 30
(``scale_durations``), so ``for: 30s`` is 1 s and the 5-minute grace 10 s.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from kafka import KafkaProducer

from tests.integration.test_pipeline import write_jsonl
from tests.promstack import DASHBOARD, RUNBOOKS, Stack, binary, prometheus_stack
from tokenbudget.app.runner import RunReport, run_async, start_ledger_process, stop_process
from tokenbudget.app.status import follow
from tokenbudget.core import config as config_module
from tokenbudget.core import kafka_admin
from tokenbudget.dev.ports import free_ports
from tokenbudget.dev.simulator import server as sim_server
from tokenbudget.dev.simulator.config import Faults, SimulatorConfig
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics

# One worker runs them all (ONE_WORKER in tests/conftest.py): their module fixture is costly.
pytestmark = pytest.mark.integration

CONCURRENCY = 8
MAX_NEW_TOKENS = 2048
# Reservations (the default admission) send nothing the ledger did not grant: the
# design allows no overshoot at all, so any is alerted on.
ALLOWANCE = 0
# Panels' Grafana variables, as Grafana would expand them for a 1 s scrape.
# The job, namespace and dataset variables at "All".
GRAFANA_VARS = {
    "$__rate_interval": "10s",
    "$__interval": "5s",
    "$job": ".*",
    "$namespace": ".*",
    "$dataset": ".*",
    "$server": ".*",
}


@dataclass
class Observed:
    stack: Stack
    report: RunReport
    started: float
    bootstrap: str
    namespace: str
    rogue_events: int
    ledger: Any  # the ledger worker's process
    server: str  # the simulator's URL
    dead: str  # the URL of the fleet's server that never answers


def rogue_completion(i: int) -> ev.CompletionEvent:
    tokens = 4000
    return ev.CompletionEvent(
        request_id=uuid.uuid4().hex,
        prompt_id=f"rogue-{i}",
        dataset="long",
        prompt_tokens=10,
        completion_tokens=tokens,
        output_ids=list(range(tokens)),
        finish_reason="length",
        max_new_tokens=tokens,
        dispatched_at=time.time(),
        finished_at=time.time(),
    )


def wait_for(predicate: Any, timeout: float, what: str, step: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory, kafka_bootstrap: str) -> Iterator[Observed]:
    binary("prometheus")
    binary("prometheus-alertmanager", "alertmanager")
    tmp = tmp_path_factory.mktemp("observability")
    namespace = f"obs{uuid.uuid4().hex[:8]}"
    topics = Topics(namespace)
    kafka_admin.ensure_topics(kafka_bootstrap, topics.specs())
    run_port, ledger_port, sim_port, dead_port = free_ports(4)
    # The simulator is scraped too, as a user scrapes SGLang: its panels need data.
    targets = [f"127.0.0.1:{p}" for p in (run_port, ledger_port, sim_port)]
    with prometheus_stack(tmp / "stack", targets) as stack:
        # The ledger runs on its own, as `tokenbudget ledger` would, so it outlives the
        # run and counts what the rogue producer sends afterwards.
        ledger = start_ledger_process(kafka_bootstrap, namespace, 0.2, metrics_port=ledger_port)
        try:
            wait_for(
                lambda: ledger.poll() is not None or _answers(ledger_port),
                30,
                "the ledger's /metrics",
            )
            assert ledger.poll() is None, f"the ledger worker exited with {ledger.returncode}"
            started = time.time()
            report = asyncio.run(
                asyncio.wait_for(
                    _run(tmp, kafka_bootstrap, namespace, run_port, sim_port, dead_port), 120
                )
            )
            assert ledger.poll() is None, f"the ledger worker exited with {ledger.returncode}"
            assert report.datasets["long"].status == "halted"
            rogue = _rogue(stack, kafka_bootstrap, topics)
            server, dead = (f"http://127.0.0.1:{port}" for port in (sim_port, dead_port))
            yield Observed(
                stack, report, started, kafka_bootstrap, namespace, rogue, ledger, server, dead
            )
        finally:
            stop_process(ledger)


def _answers(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).status_code == 200
    except httpx.TransportError:
        return False


async def _run(
    tmp: Path, bootstrap: str, namespace: str, metrics_port: int, sim_port: int, dead_port: int
) -> RunReport:
    # Slow enough that the run spans several scrapes (about 40 long answers of ~1.3 s,
    # 8 at a time), with a few injected server errors for the error panels.
    sim = await sim_server.start(
        SimulatorConfig(port=sim_port, tokens_per_second=3000.0, faults=Faults(http_500=0.05))
    )
    try:
        write_jsonl(tmp / "long.jsonl", "#long-code", 200)
        write_jsonl(tmp / "small.jsonl", "#short", 12)
        config = config_module.build(
            {
                "kafka": {"bootstrap": bootstrap, "namespace": namespace},
                "inference": {
                    # The second server never answers: paused from the start.
                    "servers": [{"url": sim.url}, {"url": f"http://127.0.0.1:{dead_port}"}],
                    "concurrency": CONCURRENCY,
                    "max_new_tokens": MAX_NEW_TOKENS,
                    "backoff_s": 0.05,
                    "stream": True,  # first-token times, for the TTFT histogram
                },
                "budget": {"snapshot_interval_s": 0.2},
                "sink": {"path": "out", "flush_interval_s": 0.5},
                "metrics": {"port": metrics_port},
                "datasets": [
                    {"name": "long", "path": "long.jsonl", "budget": "150k"},
                    {"name": "small", "path": "small.jsonl", "budget": "1M"},
                ],
            },
            base_dir=tmp,
            environ={},
        )
        return await run_async(config, bootstrap=bootstrap, ledger_process=False)
    finally:
        await sim.stop()


def _rogue(stack: Stack, bootstrap: str, topics: Topics) -> int:
    """Publish completions of the halted dataset until both alerts reach the webhook."""
    hook = stack.webhook
    # The healthy run alone raised neither (in-flight completions after the halt are
    # within the allowance and the grace period).
    assert not hook.firing("TokenBudgetOvershoot"), hook.alerts()
    assert not hook.firing("TokenBudgetHaltIgnored"), hook.alerts()
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    sent = 0
    try:
        # One undecodable event too: the ledger dead-letters it (and counts it).
        producer.send(topics.completions, key=b"long", value=b"\x00 not an event")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if hook.firing("TokenBudgetOvershoot", dataset="long") and hook.firing(
                "TokenBudgetHaltIgnored", dataset="long"
            ):
                break
            event = rogue_completion(sent)
            producer.send(topics.completions, key=codec.event_key(event), value=codec.encode(event))
            producer.flush()
            sent += 1
            time.sleep(1.0)
        wait_for(
            lambda: stack.query('tokenbudget_dead_lettered_total{topic="completions"}'),
            20,
            "the dead-lettered event in Prometheus",
        )
    finally:
        producer.close()
    return sent


def test_rogue_producer_fires_overshoot_and_halt_ignored_at_the_webhook(
    observed: Observed,
) -> None:
    hook = observed.stack.webhook
    overshoot = hook.firing("TokenBudgetOvershoot", dataset="long")
    ignored = hook.firing("TokenBudgetHaltIgnored", dataset="long")
    assert overshoot, f"no TokenBudgetOvershoot; got {hook.alerts()}"
    assert ignored, f"no TokenBudgetHaltIgnored; got {hook.alerts()}"
    assert overshoot[0]["labels"]["severity"] == "critical"
    assert "tokens kept beyond the budget" in overshoot[0]["annotations"]["summary"]
    assert ignored[0]["annotations"]["summary"] == "long: halted, but its tokens still grow"
    # Informational: both halted and nearly-spent datasets are reported.
    assert hook.firing("TokenBudgetNearlySpent", dataset="long")
    # The dataset that ran out of prompts within its budget raises nothing.
    assert not [a for a in hook.alerts() if a["labels"].get("dataset") == "small"]
    # Webhook payloads are Alertmanager's version 4.
    assert all(p["version"] == "4" for p in hook.payloads)

    # What fired it, as Prometheus saw it: halted, overshoot beyond the allowance.
    stack = observed.stack
    halted = stack.query('tokenbudget_dataset_halted{dataset="long"}')
    assert halted and float(halted[0]["value"][1]) == 1
    over = stack.query('tokenbudget_overshoot_tokens{dataset="long"}')
    assert over and float(over[0]["value"][1]) > ALLOWANCE
    allowance = stack.query('tokenbudget_overshoot_allowance_tokens{dataset="long"}')
    assert allowance and float(allowance[0]["value"][1]) == ALLOWANCE


def _expand(expr: str) -> str:
    # The datasource variable picks the Prometheus; it has no place in PromQL.
    assert "${datasource}" not in expr, expr
    for name, value in GRAFANA_VARS.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, expr
    return expr


def _panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def _finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(v)) for series in result for _, v in series["values"])


def test_every_dashboard_panel_returns_data(observed: Observed) -> None:
    stack = observed.stack
    dashboard = json.loads(DASHBOARD.read_text())
    end = time.time()
    # Streamed answers report their first token: the TTFT histogram has data too.
    assert stack.query("sum(tokenbudget_time_to_first_token_seconds_count) > 0")
    # May be empty on a healthy run: nothing wasted, failed for good or retried, no
    # halt observed late, no answer over its limit or on an expired lease, no bad
    # row, no answer cut while thinking. Their queries still run, so their PromQL is
    # checked.
    may_be_empty = {
        "Bad rows (not prompts)",
        "Unfinished answers/s (cut while thinking)",
        "Wasted tokens/s by reason",
        "Failed prompts/s",
        "Retries/s by reason",
        "Halt latency",
        "Answers corrected or claimed anew/s",
    }
    # What the simulator exports of an SGLang server's metrics; the other server
    # panels (vLLM, SGLang's KV cache) can only be checked for valid PromQL here.
    simulated = {
        "sglang:prompt_tokens_total",
        "sglang:generation_tokens_total",
        "sglang:num_requests_total",
        "sglang:num_aborted_requests_total",
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
    }
    # Server metrics are in Prometheus only when the simulator is a scrape target.
    scraped = stack.query_range(
        'group by (__name__) ({__name__=~"sglang:.+"})', observed.started, end, 1
    )
    (server_row,) = [p for p in dashboard["panels"] if p["title"] == "Inference server"]
    server_panels = {p["id"] for p in server_row["panels"]}
    titles = {p["title"] for p in _panels(dashboard)}
    assert may_be_empty <= titles, may_be_empty - titles

    ran = checked = 0
    problems = []
    for panel in _panels(dashboard):
        for target in panel.get("targets", []):
            expr = _expand(target["expr"])
            result = stack.query_range(expr, observed.started, end, 1)  # raises on bad PromQL
            ran += 1
            if panel["id"] in server_panels:
                served = set(re.findall(r"\b(?:sglang|vllm):[a-z_]+", expr))
                if not scraped or not served <= simulated:
                    continue
            elif panel["title"] in may_be_empty:
                continue
            checked += 1
            if not result:
                problems.append(f"{panel['title']} [{target['refId']}]: no data: {expr}")
            elif not _finite(result):
                problems.append(f"{panel['title']} [{target['refId']}]: only NaN: {expr}")
    assert ran == sum(len(p.get("targets", [])) for p in _panels(dashboard))
    assert checked >= 30
    assert not problems, "\n".join(problems)

    annotations = {a["name"]: a for a in dashboard["annotations"]["list"]}
    # Halts as annotations: the halt of `long` is found.
    found = stack.query_range(_expand(annotations["Halts"]["expr"]), observed.started, end, 1)
    assert {series["metric"]["dataset"] for series in found} >= {"long"}
    # Prometheus' firing alerts as annotations: the two the rogue producer raised.
    alerts = _expand(annotations["Firing alerts"]["expr"])
    found = stack.query_range(alerts, observed.started, time.time(), 1)
    fired = {series["metric"]["alertname"] for series in found}
    assert {"TokenBudgetOvershoot", "TokenBudgetHaltIgnored"} <= fired

    # The variables' values: each label_values() selector, as Grafana runs it with the
    # variables before it at "All".
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    values: dict[str, set[str | None]] = {}
    for name in ("job", "namespace", "dataset"):
        query = variables[name]["query"]["query"]
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", query)
        assert match, query
        selector, label = match.groups()
        series = stack.query_range(_expand(selector), observed.started, end, 1)
        values[name] = {s["metric"].get(label) for s in series}
    assert "tokenbudget" in values["job"]  # tests/promstack.py's job_name
    assert observed.namespace in values["namespace"]
    assert {"long", "small"} <= values["dataset"]


def test_status_reads_the_ledger(observed: Observed, capsys: pytest.CaptureFixture[str]) -> None:
    topics = Topics(observed.namespace)
    budgets = {"long": 150_000, "small": 1_000_000}
    asyncio.run(
        follow(observed.bootstrap, topics, ["long", "small"], budgets, watch=False, as_json=True)
    )
    status = json.loads(capsys.readouterr().out)["datasets"]
    long, small = status["long"], status["small"]
    assert long["state"] == "halted" and small["state"] == "exhausted"
    run_long = observed.report.datasets["long"]
    # The rogue completions came after the run: the ledger counted them too.
    assert long["kept"] >= run_long.completion_tokens + 4000
    assert long["remaining"] == 0 and long["percent_used"] > 100
    assert small["kept"] == observed.report.datasets["small"].completion_tokens
    assert small["remaining"] == 1_000_000 - small["kept"]
    assert small["eta_s"] is None


def test_a_server_that_never_answers_fires_server_down_for_it_alone(observed: Observed) -> None:
    hook = observed.stack.webhook
    wait_for(
        lambda: hook.firing("TokenBudgetServerDown", server=observed.dead),
        60,
        "TokenBudgetServerDown at the webhook",
    )
    # The run serves this worker process's registry, which may still hold the servers
    # of earlier runs in the process: the assertions name the run's two servers.
    [alert] = hook.firing(
        "TokenBudgetServerDown", namespace=observed.namespace, server=observed.dead
    )
    assert not hook.firing("TokenBudgetServerDown", server=observed.server)  # it answered
    assert alert["labels"]["namespace"] == observed.namespace
    assert alert["annotations"]["summary"] == f"{observed.dead}: the inference server is down"
    assert alert["annotations"]["runbook_url"] == f"{RUNBOOKS}#tokenbudgetserverdown"
    state = observed.stack.query(
        f'tokenbudget_server_state{{namespace="{observed.namespace}", state="up"}} == 1'
    )
    up = {s["metric"]["server"] for s in state}
    assert observed.server in up and observed.dead not in up
    # Probed away at the start, it was sent nothing: the other carried the job.
    requests = f'tokenbudget_server_requests_total{{namespace="{observed.namespace}"}}'
    sent = {
        found["metric"]["server"]: float(found["value"][1])
        for found in observed.stack.query(f"sum by (server) ({requests})")
    }
    assert sent[observed.dead] == 0 and sent[observed.server] > 0


def test_a_dead_ledger_fires_ledger_down_at_the_webhook(observed: Observed) -> None:
    """Last in this module: it stops the ledger. The run's metrics are still served
    (its process is this one), its ledger's are gone: TokenBudgetLedgerDown reaches
    Alertmanager's webhook for the job's namespace, with its runbook link."""
    hook = observed.stack.webhook
    assert not hook.firing("TokenBudgetLedgerDown"), hook.alerts()
    stop_process(observed.ledger)
    wait_for(
        lambda: hook.firing("TokenBudgetLedgerDown", namespace=observed.namespace),
        60,
        "TokenBudgetLedgerDown at the webhook",
    )
    [alert] = [a for a in hook.alerts() if a["labels"]["alertname"] == "TokenBudgetLedgerDown"]
    assert alert["annotations"]["runbook_url"] == f"{RUNBOOKS}#tokenbudgetledgerdown"
