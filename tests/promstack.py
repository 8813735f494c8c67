"""Real Prometheus and Alertmanager for tests (Debian packages `prometheus`,
`prometheus-alertmanager`; `.ci/run` installs them).

Each stack runs on free 127.0.0.1 ports with temporary data folders, never a
system service. Outside CI a missing binary skips the test; in CI (``CI`` set) it
fails it.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenbudget.core import lifetime
from tokenbudget.dev.ports import free_port, free_ports

ROOT = Path(__file__).resolve().parents[1]
RULES = ROOT / "infra" / "prometheus" / "rules" / "tokenbudget.yml"
RULES_TEST = ROOT / "infra" / "prometheus" / "rules_test.yml"
DASHBOARD = ROOT / "grafana" / "dashboards" / "tokenbudget.json"


# Where the alerts' runbook links point (infra/prometheus/prometheus.yml has the same
# external label).
RUNBOOKS = "https://docs.example/tokenbudget/README.md"


def binary(*names: str) -> str:
    """The first of ``names`` on PATH; skip (fail in CI) when none is."""
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    message = (
        f"{' or '.join(names)} not installed (apt-get install prometheus prometheus-alertmanager)"
    )
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


_DURATION = re.compile(r"(?P<n>\d+)(?P<u>ms|s|m|h|d)")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}


def _scale(match: re.Match[str], factor: float, minimum: int) -> str:
    seconds = int(match.group("n")) * _UNIT_S[match.group("u")]
    return f"{max(minimum, math.ceil(seconds * factor))}s"


def scale_durations(rules_text: str, factor: float, minimum: int = 1) -> str:
    """The rules with every range window ``[5m]`` and ``for:`` scaled by ``factor``
    (at least ``minimum`` seconds): same logic, test-sized time."""
    text = re.sub(
        r"\[(\d+(?:ms|s|m|h|d))\]",
        lambda m: "[" + _DURATION.sub(lambda d: _scale(d, factor, minimum), m.group(1)) + "]",
        rules_text,
    )
    return re.sub(
        r"(for: )(\d+(?:ms|s|m|h|d))",
        lambda m: m.group(1) + _DURATION.sub(lambda d: _scale(d, factor, minimum), m.group(2)),
        text,
    )


@dataclass
class Webhook:
    """Collects Alertmanager webhook payloads (version 4) POSTed to it."""

    port: int
    payloads: list[dict[str, Any]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def alerts(self) -> list[dict[str, Any]]:
        with self.lock:
            return [a for p in self.payloads for a in p.get("alerts", [])]

    def firing(self, alertname: str, **labels: str) -> list[dict[str, Any]]:
        return [
            a
            for a in self.alerts()
            if a.get("status") == "firing"
            and a["labels"].get("alertname") == alertname
            and all(a["labels"].get(k) == v for k, v in labels.items())
        ]


@contextmanager
def webhook_receiver() -> Iterator[Webhook]:
    hook = Webhook(free_port())

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            with hook.lock:
                hook.payloads.append(json.loads(body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            return

    server = ThreadingHTTPServer(("127.0.0.1", hook.port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hook
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Stack:
    prometheus_url: str
    alertmanager_url: str
    webhook: Webhook
    logs: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        response = httpx.get(f"{self.prometheus_url}/api/v1/query", params={"query": expr})
        body = response.json()
        assert body.get("status") == "success", f"{expr}: {body}"
        return list(body["data"]["result"])

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        response = httpx.get(
            f"{self.prometheus_url}/api/v1/query_range",
            params={"query": expr, "start": start, "end": end, "step": step},
        )
        body = response.json()
        assert body.get("status") == "success", f"{expr}: {body}"
        return list(body["data"]["result"])

    def targets_up(self) -> dict[str, str]:
        body = httpx.get(f"{self.prometheus_url}/api/v1/targets").json()
        return {t["scrapeUrl"]: t["health"] for t in body["data"]["activeTargets"]}


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{url} exited {process.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready after {timeout} s: {log.read_text()[-2000:]}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    lifetime.stop(process, 10)


@contextmanager
def prometheus_stack(
    workdir: Path, targets: list[str], *, rules_factor: float = 1 / 30
) -> Iterator[Stack]:
    """Prometheus (1 s scrape and evaluation, the production rules with durations
    scaled by ``rules_factor``) -> Alertmanager (1 s grouping) -> a local webhook."""
    prometheus = binary("prometheus")
    alertmanager = binary("prometheus-alertmanager", "alertmanager")
    workdir.mkdir(parents=True, exist_ok=True)
    prom_port, am_port = free_ports(2)
    with webhook_receiver() as hook:
        (workdir / "rules.yml").write_text(scale_durations(RULES.read_text(), rules_factor))
        (workdir / "alertmanager.yml").write_text(
            json.dumps(
                {
                    "route": {
                        "receiver": "webhook",
                        "group_by": ["alertname", "dataset"],
                        "group_wait": "1s",
                        "group_interval": "1s",
                        "repeat_interval": "1h",
                    },
                    "receivers": [
                        {
                            "name": "webhook",
                            "webhook_configs": [{"url": hook.url, "send_resolved": True}],
                        }
                    ],
                }
            )
        )
        (workdir / "prometheus.yml").write_text(
            json.dumps(
                {
                    "global": {
                        "scrape_interval": "1s",
                        "evaluation_interval": "1s",
                        "external_labels": {"runbooks": RUNBOOKS},
                    },
                    "rule_files": [str(workdir / "rules.yml")],
                    "alerting": {
                        "alertmanagers": [
                            {"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}
                        ]
                    },
                    "scrape_configs": [
                        {"job_name": "tokenbudget", "static_configs": [{"targets": targets}]}
                    ],
                }
            )
        )
        am_log = (workdir / "alertmanager.log").open("wb")
        am = subprocess.Popen(
            [
                alertmanager,
                f"--config.file={workdir / 'alertmanager.yml'}",
                f"--storage.path={workdir / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address=",
            ],
            stdout=am_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        prom_log = (workdir / "prometheus.log").open("wb")
        prom = subprocess.Popen(
            [
                prometheus,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=prom_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            _wait_ready(f"http://127.0.0.1:{am_port}", am, workdir / "alertmanager.log")
            _wait_ready(f"http://127.0.0.1:{prom_port}", prom, workdir / "prometheus.log")
            yield Stack(
                f"http://127.0.0.1:{prom_port}", f"http://127.0.0.1:{am_port}", hook, workdir
            )
        finally:
            _stop(prom)
            _stop(am)
            prom_log.close()
            am_log.close()
