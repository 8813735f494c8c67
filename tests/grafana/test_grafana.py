"""Grafana provisioning: every file parses, every datasource reference uses the
provisioned uid, the dashboard is Grafana 10+ JSON, the dashboards provider points
where docker-compose mounts the dashboards, and the Grafana-managed alert rules are
the Prometheus rules (same names, PromQL, ``for``, labels).

That every panel returns data is checked against a real run in
tests/integration/test_observability.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from tests.promstack import DASHBOARD, GRAFANA_ALERTS, ROOT, RULES

GRAFANA = ROOT / "grafana"
UID = "tokenbudget-prometheus"


def load(path: Path) -> Any:
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)


def datasource_refs(node: Any) -> Iterator[Any]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource":
                yield value
            else:
                yield from datasource_refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from datasource_refs(item)


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def test_every_file_parses() -> None:
    files = sorted(p for p in GRAFANA.rglob("*") if p.is_file())
    assert {p.relative_to(GRAFANA).as_posix() for p in files} >= {
        "dashboards/tokenbudget.json",
        "provisioning/datasources/prometheus.yaml",
        "provisioning/dashboards/tokenbudget.yaml",
        "provisioning/alerting/tokenbudget.yaml",
    }
    for path in files:
        assert load(path), path


def test_datasource_has_the_fixed_uid_and_every_reference_uses_it() -> None:
    datasources = load(GRAFANA / "provisioning" / "datasources" / "prometheus.yaml")
    assert datasources["apiVersion"] == 1
    (prometheus,) = datasources["datasources"]
    assert prometheus["type"] == "prometheus" and prometheus["uid"] == UID
    assert prometheus["url"] == "http://127.0.0.1:9090"  # infra/docker-compose.yml

    for ref in datasource_refs(load(DASHBOARD)):
        if ref.get("type") == "grafana":  # the built-in annotations
            continue
        assert ref == {"type": "prometheus", "uid": UID}
    alerting = load(GRAFANA_ALERTS)
    for rule in alerting["groups"][0]["rules"]:
        query, *expressions = rule["data"]
        assert query["datasourceUid"] == UID
        assert query["model"]["datasource"] == {"type": "prometheus", "uid": UID}
        assert all(e["datasourceUid"] == "__expr__" for e in expressions)


def test_dashboard_is_grafana_10_json() -> None:
    dashboard = load(DASHBOARD)
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["uid"] == "tokenbudget" and dashboard["title"]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]

    (variable,) = dashboard["templating"]["list"]
    assert variable["name"] == "dataset" and variable["type"] == "query"
    assert variable["query"]["query"] == "label_values(tokenbudget_budget_tokens, dataset)"
    assert variable["includeAll"] and variable["allValue"] == ".*"

    halts = [a for a in dashboard["annotations"]["list"] if a.get("name") == "Halts"]
    assert halts and "tokenbudget_dataset_halted" in halts[0]["expr"]


def test_dashboard_shows_what_the_issue_asks_for() -> None:
    dashboard = load(DASHBOARD)
    exprs = " ".join(t["expr"] for p in panels(dashboard) for t in p.get("targets", []))
    for metric in (
        "tokenbudget_budget_used_tokens",  # kept
        "tokenbudget_reserved_tokens",
        "tokenbudget_budget_remaining_tokens",
        "tokenbudget_completion_tokens_total",  # tokens/s
        "tokenbudget_overshoot_tokens",
        "tokenbudget_request_latency_seconds_bucket",
        "tokenbudget_time_to_first_token_seconds_bucket",
        "tokenbudget_inference_errors_total",
        "tokenbudget_consumer_lag_events",
        "tokenbudget_parquet_rows_total",
        "tokenbudget_parquet_bytes_total",
    ):
        assert metric in exprs, metric
    titles = {p["title"] for p in panels(dashboard)}
    assert "ETA to budget" in titles


def test_dashboards_provider_matches_the_compose_mount() -> None:
    provider = load(GRAFANA / "provisioning" / "dashboards" / "tokenbudget.yaml")
    (entry,) = provider["providers"]
    assert entry["type"] == "file"
    assert entry["options"]["path"] == "/etc/grafana/dashboards"
    compose = yaml.safe_load((ROOT / "infra" / "docker-compose.yml").read_text())
    volumes = compose["services"]["grafana"]["volumes"]
    assert any(v.startswith("../grafana/dashboards:/etc/grafana/dashboards") for v in volumes)
    assert any(v.startswith("../grafana/provisioning:/etc/grafana/provisioning") for v in volumes)
    mounted = compose["services"]["prometheus"]["volumes"]
    assert any(v.startswith("./prometheus/rules:/etc/prometheus/rules") for v in mounted)


def test_grafana_alert_rules_equal_the_prometheus_rules() -> None:
    prometheus = {r["alert"]: r for r in load(RULES)["groups"][0]["rules"]}
    alerting = load(GRAFANA_ALERTS)
    assert alerting["apiVersion"] == 1
    (group,) = alerting["groups"]
    assert group["folder"] and group["name"] and group["interval"]
    grafana = {r["title"]: r for r in group["rules"]}
    assert set(grafana) == set(prometheus)
    uids = [r["uid"] for r in group["rules"]]
    assert len(uids) == len(set(uids))
    for name, rule in grafana.items():
        source = prometheus[name]
        query = next(d for d in rule["data"] if d["refId"] == "A")["model"]
        assert query["expr"].strip() == source["expr"].strip(), name
        assert query["instant"] is True
        assert rule["for"] == source["for"], name
        assert rule["labels"] == source["labels"], name
        assert rule["noDataState"] == "OK"
        # The query returns series exactly when the rule's condition holds, with
        # positive values: the condition is "last value > 0".
        steps = {d["refId"]: d["model"] for d in rule["data"]}
        assert rule["condition"] == "C"
        assert steps["B"]["type"] == "reduce" and steps["B"]["expression"] == "A"
        assert steps["C"]["type"] == "threshold" and steps["C"]["expression"] == "B"
        assert steps["C"]["conditions"][0]["evaluator"] == {"type": "gt", "params": [0]}
