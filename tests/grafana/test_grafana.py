"""Grafana files: every file parses, the dashboard imports into any Grafana 10+ (no
datasource uid of ours, an ``__inputs`` entry for the Prometheus it needs), every
tokenbudget selector follows the job/namespace/dataset variables, every metric
tokenbudget/core/metrics.py declares is on a panel, and no alert rule lives in Grafana (they
live once, in Prometheus).

That every panel returns data is checked against a real run in
tests/integration/test_observability.py. No Grafana JSON schema is available
offline, so the dashboard's structure is checked here field by field instead."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.metrics import MetricWrapperBase

from tests.promstack import DASHBOARD, ROOT
from tokenbudget.core import metrics

GRAFANA = ROOT / "grafana"
UID = "tokenbudget-prometheus"
ALERTMANAGER_UID = "tokenbudget-alertmanager"
VARIABLE = {"type": "prometheus", "uid": "${datasource}"}
SERVER_ROW = "Inference server"

SELECTOR = re.compile(r"tokenbudget_[a-z_]+(\{[^}]*\})?")
FILTERS = ('job=~"$job"', 'namespace=~"$namespace"')
DATASET = 'dataset=~"$dataset"'
SERVER = 'server=~"$server"'
AGGREGATION = re.compile(r"\b(sum|max|min|avg|count)\s*(?:by\s*\(([^)]*)\)\s*)?$")
QUANTILE = re.compile(r"histogram_quantile\(([0-9.]+),")

# tokenbudget/core/metrics.py: "per dataset, owned by the ledger worker". After a rebalance the
# worker that lost a dataset keeps exporting its last values, so summing workers would
# count a dataset twice; the owner's values are the highest.
LEDGER_OWNED = {
    "tokenbudget_completion_tokens_total",
    "tokenbudget_prompt_tokens_total",
    "tokenbudget_samples_total",
    "tokenbudget_budget_tokens",
    "tokenbudget_budget_used_tokens",
    "tokenbudget_budget_remaining_tokens",
    "tokenbudget_reserved_tokens",
    "tokenbudget_overshoot_tokens",
    "tokenbudget_failed_prompts_total",
    "tokenbudget_cut_answers_total",
    "tokenbudget_open_leases",
    "tokenbudget_dataset_halted",
    "tokenbudget_dataset_open",
}


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


def exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every panel target and Prometheus annotation."""
    for panel in panels(dashboard):
        for target in panel.get("targets", []):
            yield f"{panel['title']} [{target['refId']}]", target["expr"]
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            yield f"annotation {annotation['name']}", annotation["expr"]


def variables(dashboard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def declared() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Every tokenbudget series name tokenbudget/core/metrics.py exports -> (its metric, its
    declared labels); ``namespace`` and ``job`` come on top, from the exporter and from
    Prometheus."""
    names: dict[str, tuple[str, tuple[str, ...]]] = {}
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            for suffix in suffixes.get(value._type or "", ("",)):
                names[value._name + suffix] = (value._name, tuple(value._labelnames))
    return names


def enclosing_aggregation(expr: str, index: int) -> tuple[str, set[str]] | None:
    """The innermost ``op by (labels) (...)`` around ``expr[index]``, if any."""
    depth = 0
    for i in range(index - 1, -1, -1):
        if expr[i] == ")":
            depth += 1
        elif expr[i] == "(":
            if depth:
                depth -= 1
                continue
            match = AGGREGATION.search(expr[:i])
            if match:
                labels = {label.strip() for label in (match.group(2) or "").split(",")}
                return match.group(1), labels - {""}
    return None


def test_every_file_parses() -> None:
    files = sorted(p for p in GRAFANA.rglob("*") if p.is_file())
    assert {p.relative_to(GRAFANA).as_posix() for p in files} >= {
        "dashboards/tokenbudget.json",
        "provisioning/datasources/prometheus.yaml",
        "provisioning/dashboards/tokenbudget.yaml",
    }
    for path in files:
        assert load(path), path


def test_no_grafana_managed_alert_rules() -> None:
    # The rules live in Prometheus (infra/prometheus/rules/); a provisioned copy in
    # Grafana evaluated them a second time and notified nobody.
    assert not (GRAFANA / "provisioning" / "alerting").exists()
    alerting = {"groups", "contactPoints", "policies", "templates", "muteTimes"}
    for path in GRAFANA.rglob("*.y*ml"):
        assert not alerting & set(load(path)), path
    dashboard = load(DASHBOARD)
    assert not [p["title"] for p in panels(dashboard) if "alert" in p]  # legacy panel alerts


def test_provisioned_datasources_show_the_prometheus_alerts() -> None:
    datasources = load(GRAFANA / "provisioning" / "datasources" / "prometheus.yaml")
    assert datasources["apiVersion"] == 1
    by_type = {d["type"]: d for d in datasources["datasources"]}
    assert set(by_type) == {"prometheus", "alertmanager"}
    prometheus, alertmanager = by_type["prometheus"], by_type["alertmanager"]
    # The provisioned uid may stay fixed for the compose stack; the dashboard must not
    # rely on it (test_the_dashboard_names_no_datasource_uid).
    assert prometheus["uid"] == UID and prometheus["isDefault"]
    assert prometheus["url"] == "http://127.0.0.1:9090"  # infra/docker-compose.yml
    assert prometheus["jsonData"]["manageAlerts"] is True
    assert prometheus["jsonData"]["alertmanagerUid"] == alertmanager["uid"] == ALERTMANAGER_UID
    assert alertmanager["jsonData"]["implementation"] == "prometheus"
    assert alertmanager["jsonData"]["handleGrafanaManagedAlerts"] is False
    compose = yaml.safe_load((ROOT / "infra" / "docker-compose.yml").read_text())
    listen = "--web.listen-address=127.0.0.1:9094"
    assert listen in compose["services"]["alertmanager"]["command"]
    assert alertmanager["url"] == "http://127.0.0.1:9094"


def test_the_dashboard_names_no_datasource_uid() -> None:
    # Another Grafana has other uids: a hard-coded one breaks every panel on import.
    assert UID not in DASHBOARD.read_text()
    dashboard = load(DASHBOARD)
    for ref in datasource_refs(dashboard):
        if ref == {"type": "grafana", "uid": "-- Grafana --"}:  # the built-in annotations
            continue
        assert ref == VARIABLE, ref
    # An absent reference means "the default datasource", not the one picked.
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == VARIABLE, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == VARIABLE, panel["title"]
    for annotation in dashboard["annotations"]["list"]:
        assert annotation["datasource"]["type"] in {"grafana", "prometheus"}
    for where, expr in exprs(dashboard):
        assert "datasource" not in expr, where


def test_import_inputs_and_requires() -> None:
    dashboard = load(DASHBOARD)
    (source,) = dashboard["__inputs"]
    assert source["name"] == "DS_PROMETHEUS" and source["label"]
    assert source["type"] == "datasource" and source["pluginId"] == "prometheus"
    # Import replaces ${DS_PROMETHEUS} with the datasource picked: it must preselect the
    # variable every panel reads, and no undeclared input may be left to replace.
    text = DASHBOARD.read_text()
    assert set(re.findall(r"\$\{(DS_[A-Z0-9_]+)\}", text)) == {"DS_PROMETHEUS"}
    current = variables(dashboard)["datasource"]["current"]
    assert current["value"] == "${DS_PROMETHEUS}"

    requires = {(r["type"], r["id"]): r for r in dashboard["__requires"]}
    version = requires[("grafana", "grafana")]["version"]
    assert tuple(int(part) for part in version.split(".")) >= (10, 0, 0)
    assert ("datasource", "prometheus") in requires
    used = {p["type"] for p in panels(dashboard) if p["type"] != "row"}
    assert {id_ for type_, id_ in requires if type_ == "panel"} == used


def test_variables_datasource_job_namespace_dataset_server_in_order() -> None:
    dashboard = load(DASHBOARD)
    listing = dashboard["templating"]["list"]
    # Each query narrows by the ones before it, so the order is the dependency order.
    assert [v["name"] for v in listing] == ["datasource", "job", "namespace", "dataset", "server"]
    datasource = listing[0]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    assert not datasource["multi"] and not datasource["includeAll"]
    queries = {
        "job": "label_values(tokenbudget_build_info, job)",
        "namespace": 'label_values(tokenbudget_build_info{job=~"$job"}, namespace)',
        "dataset": (
            'label_values(tokenbudget_budget_tokens{job=~"$job", namespace=~"$namespace"}, dataset)'
        ),
        "server": (
            'label_values(tokenbudget_server_state{job=~"$job", namespace=~"$namespace"}, server)'
        ),
    }
    for variable in listing[1:]:
        name = variable["name"]
        assert variable["type"] == "query", name
        assert variable["datasource"] == VARIABLE, name
        assert variable["query"]["query"] == variable["definition"] == queries[name]
        assert variable["multi"] and variable["includeAll"], name
        assert variable["allValue"] == ".*", name


def test_every_tokenbudget_selector_filters_job_and_namespace() -> None:
    names = declared()
    checked = 0
    for where, expr in exprs(load(DASHBOARD)):
        for match in SELECTOR.finditer(expr):
            name = match.group(0).split("{")[0]
            assert name in names, f"{where}: {name} is not in tokenbudget/core/metrics.py"
            braces = match.group(1) or ""
            for wanted in FILTERS:
                assert wanted in braces, f"{where}: {match.group(0)} lacks {wanted}"
            if "dataset" in names[name][1]:
                assert DATASET in braces, f"{where}: {match.group(0)} lacks {DATASET}"
            if "server" in names[name][1]:
                assert SERVER in braces, f"{where}: {match.group(0)} lacks {SERVER}"
            checked += 1
    assert checked >= 40


def test_aggregations_keep_namespace_and_take_the_max_of_ledger_metrics() -> None:
    names = declared()
    for where, expr in exprs(load(DASHBOARD)):
        for match in SELECTOR.finditer(expr):
            name = match.group(0).split("{")[0]
            # Each process is its own series (job, instance): unaggregated, one dataset
            # would be drawn once per worker that ever owned it.
            found = enclosing_aggregation(expr, match.start())
            assert found, f"{where}: {name} is not aggregated"
            op, by = found
            # Two jobs may name their datasets alike; only the namespace tells them apart.
            assert "namespace" in by, f"{where}: {op} by ({', '.join(by)}) over {name}"
            if "dataset" in names[name][1]:
                assert "dataset" in by, f"{where}: {op} by ({', '.join(by)}) over {name}"
            if name in LEDGER_OWNED:
                assert op == "max", f"{where}: {op} over ledger-owned {name}"


def test_every_declared_metric_is_on_a_panel() -> None:
    dashboard = load(DASHBOARD)
    names = declared()
    text = " ".join(
        t["expr"] for p in panels(dashboard) if p["type"] != "row" for t in p["targets"]
    )
    shown = {names[m.group(0).split("{")[0]][0] for m in SELECTOR.finditer(text)}
    # tokenbudget_build_info is what the job and namespace variables list.
    missing = {metric for metric, _ in names.values()} - shown - {"tokenbudget_build_info"}
    assert not missing


def test_panels_for_the_new_signals() -> None:
    dashboard = load(DASHBOARD)
    targets = [t["expr"] for p in panels(dashboard) if p["type"] != "row" for t in p["targets"]]

    def aggregated_by(metric: str) -> set[str]:
        labels: set[str] = set()
        for expr in targets:
            for match in SELECTOR.finditer(expr):
                if match.group(0).split("{")[0] == metric:
                    found = enclosing_aggregation(expr, match.start())
                    labels |= found[1] if found else set()
        return labels

    # Counters and gauges, with the label each panel must break them down by.
    for metric, label in (
        ("tokenbudget_wasted_tokens_total", "reason"),
        ("tokenbudget_completions_total", "finish_reason"),
        ("tokenbudget_open_leases", "dataset"),
        ("tokenbudget_reserved_tokens", "dataset"),
        ("tokenbudget_failed_prompts_total", "dataset"),
        ("tokenbudget_inference_retries_total", "reason"),
        ("tokenbudget_completion_token_parts_total", "part"),  # thinking against answer
    ):
        assert label in aggregated_by(metric), metric

    # Histograms: quantiles of their buckets.
    for metric, quantiles, by in (
        ("tokenbudget_halt_latency_seconds_bucket", {"0.5", "0.99"}, {"namespace", "le"}),
        ("tokenbudget_budget_wait_seconds_bucket", {"0.5", "0.99"}, {"dataset", "le"}),
        ("tokenbudget_request_latency_seconds_bucket", {"0.5"}, {"dataset", "le"}),
    ):
        found = {q for e in targets if metric in e for q in QUANTILE.findall(e)}
        assert quantiles <= found, metric
        assert by <= aggregated_by(metric), metric

    titles = [p["title"] for p in panels(dashboard)]
    # The integration test names panels that may be empty on a healthy run by title.
    assert len(titles) == len(set(titles))
    assert "ETA to budget" in titles


def test_a_row_per_server_of_the_fleet() -> None:
    dashboard = load(DASHBOARD)
    top = dashboard["panels"]
    (row,) = [p for p in top if p["type"] == "row" and p.get("repeat") == "server"]
    # Grafana repeats a row that is not collapsed with the panels below it, up to the
    # next row: one such row per value of $server.
    assert not row["collapsed"] and "$server" in row["title"]
    after = sorted(
        (p for p in top if p["gridPos"]["y"] > row["gridPos"]["y"]), key=lambda p: p["gridPos"]["y"]
    )
    repeated = []
    for panel in after:
        if panel["type"] == "row":
            break
        repeated.append(panel)
    shown = " ".join(t["expr"] for p in repeated for t in p["targets"])
    for metric in (
        "tokenbudget_server_requests_total",
        "tokenbudget_server_errors_total",
        "tokenbudget_server_inflight_requests",
        "tokenbudget_server_concurrency_limit",
        "tokenbudget_server_time_to_first_token_seconds_bucket",
    ):
        assert metric in shown, metric
    for panel in repeated:
        assert all('server=~"$server"' in t["expr"] for t in panel["targets"]), panel["title"]
    titles = {p["title"] for p in top}
    assert {"Server state", "Tokens/s generated per server"} <= titles


def test_inference_server_row() -> None:
    dashboard = load(DASHBOARD)
    rows = [p for p in dashboard["panels"] if p["title"] == SERVER_ROW]
    assert len(rows) == 1
    (row,) = rows
    # Collapsed: on a Grafana that does not scrape the server, its panels stay out of
    # the way (and run no queries).
    assert row["type"] == "row" and row["collapsed"] and row["panels"]
    inside = " ".join(t["expr"] for p in row["panels"] for t in p["targets"])
    for metric in (
        "sglang:num_running_reqs",
        "sglang:num_queue_reqs",
        "rate(sglang:generation_tokens_total[$__rate_interval])",
        "rate(sglang:prompt_tokens_total[$__rate_interval])",
        "sglang:token_usage",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:gpu_cache_usage_perc",
        "vllm:kv_cache_usage_perc",
        "rate(vllm:generation_tokens_total[$__rate_interval])",
    ):
        assert metric in inside, metric
    # The integration test tells server panels apart by this row alone.
    assert "tokenbudget_" not in inside
    for panel in panels(dashboard):
        if panel not in row["panels"]:
            for target in panel.get("targets", []):
                assert not re.search(r"\b(sglang|vllm):", target["expr"]), panel["title"]


def test_dashboard_is_grafana_10_json() -> None:
    dashboard = load(DASHBOARD)
    assert dashboard["schemaVersion"] >= 37
    assert dashboard["uid"] == "tokenbudget" and dashboard["title"]
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    for panel in panels(dashboard):
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["y"] >= 0, panel["title"]
        assert grid["w"] > 0 and grid["h"] > 0, panel["title"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            assert panel["collapsed"] == bool(panel["panels"]), panel["title"]
            for inner in panel["panels"]:
                assert inner["gridPos"]["y"] > grid["y"], inner["title"]
            continue
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
    # Overlapping panels are moved by Grafana on load, and the layout is lost.
    layouts = [dashboard["panels"]] + [
        p["panels"] for p in dashboard["panels"] if p["type"] == "row"
    ]
    for layout in layouts:
        boxes = [(p["title"], p["gridPos"]) for p in layout]
        for i, (title, a) in enumerate(boxes):
            for other, b in boxes[i + 1 :]:
                apart = (
                    a["x"] + a["w"] <= b["x"]
                    or b["x"] + b["w"] <= a["x"]
                    or a["y"] + a["h"] <= b["y"]
                    or b["y"] + b["h"] <= a["y"]
                )
                assert apart, f"{title} overlaps {other}"

    annotations = {a["name"]: a for a in dashboard["annotations"]["list"]}
    assert annotations["Annotations & Alerts"]["builtIn"] == 1
    assert "tokenbudget_dataset_halted" in annotations["Halts"]["expr"]
    # Prometheus' own alert state, so Grafana shows the one set of rules.
    assert 'ALERTS{alertstate="firing"' in annotations["Firing alerts"]["expr"]


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
