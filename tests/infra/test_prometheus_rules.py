"""The Prometheus and Alertmanager configuration, checked by their own tools:
`promtool check rules`, `promtool test rules` (every alert fires in one case and
stays quiet in another), `promtool check config`, `amtool check-config`."""

from __future__ import annotations

import subprocess

import yaml

from tests.promstack import ROOT, RULES, RULES_TEST, binary, scale_durations

PROMETHEUS_YML = ROOT / "infra" / "prometheus" / "prometheus.yml"
ALERTMANAGER_YML = ROOT / "infra" / "alertmanager" / "alertmanager.yml"
ALERTS = {
    "TokenBudgetOvershoot",
    "TokenBudgetNearlySpent",
    "TokenBudgetHaltIgnored",
    "TokenBudgetDatasetStalled",
    "TokenBudgetInferenceErrors",
    "TokenBudgetConsumerLag",
    "TokenBudgetLedgerDown",
    "TokenBudgetServerDown",
}


def run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    return output


def test_promtool_check_rules() -> None:
    output = run(binary("promtool"), "check", "rules", str(RULES))
    assert f"SUCCESS: {len(ALERTS)} rules found" in output


def test_promtool_test_rules() -> None:
    output = run(binary("promtool"), "test", "rules", str(RULES_TEST))
    assert "SUCCESS" in output


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == ALERTS
    for rule in rules:
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
        # a link Alertmanager and Grafana can follow, not a file path
        anchor = rule["alert"].lower()
        assert rule["annotations"]["runbook_url"] == f"{{{{ $externalLabels.runbooks }}}}#{anchor}"
        assert "runbook" not in {k for k in rule["annotations"] if k != "runbook_url"}
    cases = yaml.safe_load(RULES_TEST.read_text())["tests"]
    fired: set[str] = set()
    quiet: set[str] = set()
    for case in cases:
        for check in case["alert_rule_test"]:
            (fired if check["exp_alerts"] else quiet).add(check["alertname"])
    assert fired == ALERTS
    assert quiet == ALERTS


def test_promtool_check_config(tmp_path) -> None:
    # The real file points at /etc/prometheus/rules (the compose mount): check a
    # copy pointing at the repository's rules.
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    config["rule_files"] = [str(RULES)]
    copy = tmp_path / "prometheus.yml"
    copy.write_text(yaml.safe_dump(config))
    run(binary("promtool"), "check", "config", str(copy))
    targets = config["scrape_configs"][0]["static_configs"][0]["targets"]
    assert "127.0.0.1:9464" in targets and "127.0.0.1:9465" in targets


def test_amtool_check_config() -> None:
    run(binary("amtool"), "check-config", str(ALERTMANAGER_YML))


def test_scale_durations_scales_windows_and_for_only() -> None:
    text = "expr: increase(x[2m]) > 0 and min_over_time(y[5m]) == 1\nfor: 30s\n"
    assert scale_durations(text, 1 / 30) == (
        "expr: increase(x[4s]) > 0 and min_over_time(y[10s]) == 1\nfor: 1s\n"
    )
    assert "[2880s]" in scale_durations("last_over_time(a[1d])", 1 / 30)
    assert "for: 1s" in scale_durations("for: 10s", 1 / 30)
