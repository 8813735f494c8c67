"""``run``'s child processes: its ledger workers (``tokenbudget ledger``) and its
extra dispatchers (``tokenbudget dispatch``), each supervised
(:class:`~tokenbudget.app.supervision.Supervised`: started again when it exits
unasked), with the metrics ports :mod:`tokenbudget.app.run_metrics` gives them."""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenbudget.app.run_metrics import dispatcher_port_offset, ledger_port_offset
from tokenbudget.app.supervision import Supervised, SupervisedGroup
from tokenbudget.core import lifetime, sizes
from tokenbudget.core.config import Config, servers_environment
from tokenbudget.core.config_file import ENV_PREFIX
from tokenbudget.core.errors import ConfigError
from tokenbudget.core.security import subprocess_env
from tokenbudget.streams.topics import Topics

log = logging.getLogger(__name__)


def cli_command(*args: str) -> list[str]:
    """This tokenbudget, as a subprocess command line."""
    return [sys.executable, "-m", "tokenbudget", *args]


def start_ledger_process(
    bootstrap: str,
    namespace: str,
    snapshot_interval: float,
    metrics_port: int = 0,
    metrics_host: str = "127.0.0.1",
    compression: sizes.Compression = sizes.DEFAULT_COMPRESSION,
) -> subprocess.Popen[bytes]:
    command = cli_command(
        "ledger",
        "--bootstrap",
        bootstrap,
        "--namespace",
        namespace,
        "--snapshot-interval",
        str(snapshot_interval),
        "--metrics-host",
        metrics_host,
        "--metrics-port",
        str(metrics_port),
        "--compression",
        compression,
    )
    # Given only --bootstrap, the child learns the cluster's TLS/SASL from its env.
    return lifetime.spawn(command, env=subprocess_env(bootstrap))


def stop_process(process: subprocess.Popen[bytes], timeout: float = 30) -> None:
    lifetime.stop(process, timeout)


class LedgerWorkers(SupervisedGroup):
    """``run --ledgers N``: N ``tokenbudget ledger`` processes in one Faust group,
    sharing the datasets by partition; a killed one's datasets move to the others
    (and back when it is started again).

    Metrics ports: ``run`` serves on P, the first ledger on P + 1 (it owns the budget
    gauges), extra dispatchers on P + 2 ... P + D, further ledgers after them."""

    def __init__(self, config: Config, bootstrap: str, count: int, dispatchers: int) -> None:
        super().__init__()
        if count < 1:
            raise ConfigError("--ledgers", f"must be >= 1, got {count}", source="command line")
        if count > config.kafka.partitions:
            log.warning(
                "%d ledger workers for %d partitions: %d of them will have nothing to do "
                "(raise [kafka] partitions for new topics)",
                count,
                config.kafka.partitions,
                count - config.kafka.partitions,
            )
        port = config.metrics.port
        for i in range(count):
            offset = ledger_port_offset(i, dispatchers)
            start = functools.partial(
                start_ledger_process,
                bootstrap,
                config.kafka.namespace,
                config.budget.snapshot_interval_s,
                port + offset if port else 0,
                config.metrics.host,
                config.kafka.compression,
            )
            self.children.append(
                Supervised("ledger worker" if count == 1 else f"ledger worker {i + 1}", start)
            )


class ExtraDispatchers(SupervisedGroup):
    """``run --dispatchers N``: N-1 ``tokenbudget dispatch`` processes beside the
    in-process one, all in the same consumer group, sharing budgets via leases."""

    def __init__(self, config: Config, count: int) -> None:
        super().__init__()
        self.config = config
        self.count = max(0, count)
        self.reports: list[Path] = []  # each child's, in the order of children
        self._folder: tempfile.TemporaryDirectory[str] | None = None
        if self.count and not Path(config.source).is_file():
            raise ConfigError(
                "<file>",
                "--dispatchers > 1 needs a config loaded from a file",
                source=config.source,
            )

    def start(self) -> None:
        if not self.count:
            return
        self._folder = tempfile.TemporaryDirectory(prefix="tokenbudget-dispatch-")
        namespace = self.config.kafka.namespace
        for i in range(self.count):
            report = Path(self._folder.name) / f"dispatcher-{i}.json"
            command = cli_command(
                "dispatch",
                "--config",
                str(self.config.source),
                "--report",
                str(report),
                "--instance",
                Topics(namespace).dispatcher_instance(i + 1),
            )
            if self.config.metrics.port:
                port = self.config.metrics.port + dispatcher_port_offset(i)
                command += ["--metrics-port", str(port)]
            spawn = functools.partial(lifetime.spawn, command, env=self._environment())
            child = Supervised(f"dispatcher {i + 1}", spawn)
            self.children.append(child)
            self.reports.append(report)

    def _environment(self) -> dict[str, str]:
        """This process's environment, with its fleet (which ``--server`` or the
        environment may have changed from the file's)."""
        environment = {k: v for k, v in os.environ.items() if k != f"{ENV_PREFIX}INFERENCE__URL"}
        return {**environment, **servers_environment(self.config)}

    def finish(self, hand_back: bool = False) -> dict[str, list[float]]:
        """Stop them (with ``hand_back``, SIGINT: requests the server has not answered
        are handed back, not waited for), and say per dataset when each first refused
        it (their reports)."""
        self.stop(60, signal.SIGINT if hand_back else signal.SIGTERM)
        refused: dict[str, list[float]] = {}
        for report in self.reports:
            if report.exists():
                for dataset, at in json.loads(report.read_text())["refused_at"].items():
                    refused.setdefault(dataset, []).append(float(at))
        if self._folder is not None:
            self._folder.cleanup()
        return refused
