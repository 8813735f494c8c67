"""A Kafka cluster of several KRaft nodes on this machine, for the cluster tests and
benchmarks (a developer tool: production clusters are the user's own).

Every node runs broker and controller in one JVM from the same Maven jars as the
local broker (:mod:`tokenbudget.localkafka.broker`), with its own home, ports and ``node.id``;
all share one cluster id and one static quorum, and the cluster-wide defaults a
production cluster has: ``default.replication.factor`` = the node count and
``min.insync.replicas`` = 2. Losing one node of three keeps every partition writable
with ``acks=all``, which is what the cluster tests rely on::

    cluster = LocalCluster.create(tmp / "cluster")
    bootstrap = cluster.up()          # "127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3"
    cluster.kill(1)                   # SIGKILL node 1, as a lost machine
    cluster.heal()                    # start what is down again
    cluster.down()
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tokenbudget.core.errors import BrokerError
from tokenbudget.core.kafka_admin import wait_ready
from tokenbudget.dev.ports import free_ports
from tokenbudget.localkafka import broker, process
from tokenbudget.localkafka.process import running_pid
from tokenbudget.localkafka.settings import BrokerSettings
from tokenbudget.localkafka.storage import new_cluster_id

# Three JVMs share two cores here: a small heap each starts faster.
NODE_HEAP_MB = 384


@dataclass(frozen=True)
class LocalCluster:
    nodes: tuple[BrokerSettings, ...]

    @classmethod
    def create(cls, home: Path, size: int = 3, *, min_insync_replicas: int = 2) -> LocalCluster:
        """Settings for ``size`` nodes under ``home/node<i>`` on free ports."""
        if size < 1:
            raise BrokerError(f"a cluster needs at least one node, not {size}")
        defaults = BrokerSettings.from_env()
        free = free_ports(2 * size)
        ports = [(free[2 * i], free[2 * i + 1]) for i in range(size)]
        voters = ",".join(f"{i + 1}@127.0.0.1:{c}" for i, (_, c) in enumerate(ports))
        cluster_id = new_cluster_id()
        nodes = tuple(
            replace(
                defaults,
                home=home / f"node{i + 1}",
                port=port,
                controller_port=controller,
                heap_mb=NODE_HEAP_MB,
                quick_start=True,
                node_id=i + 1,
                quorum_voters=voters,
                replication_factor=size,
                min_insync_replicas=min(min_insync_replicas, size),
                cluster_id=cluster_id,
            )
            for i, (port, controller) in enumerate(ports)
        )
        return cls(nodes)

    @property
    def bootstrap(self) -> str:
        return ",".join(node.bootstrap for node in self.nodes)

    def up(self, timeout: float = 120) -> str:
        """Start every node that is not running; return once each answers metadata
        requests listing the whole cluster."""
        pids = {}
        for node in self.nodes:
            node.home.mkdir(parents=True, exist_ok=True)
            pids[node.node_id] = running_pid(node) or broker.launch(node)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            process.wait_ready(
                node.bootstrap,
                max(1.0, deadline - time.monotonic()),
                pid=pids[node.node_id],
                log_path=node.home / "broker.log",
            )
        wait_ready(
            self.bootstrap,
            max(1.0, deadline - time.monotonic()),
            brokers=len(self.nodes),
            interval=0.5,
        )
        return self.bootstrap

    def pid(self, node_id: int) -> int | None:
        return running_pid(self.nodes[node_id - 1])

    def kill(self, node_id: int) -> int:
        """SIGKILL node ``node_id`` (1-based) and wait until it is gone; its pid."""
        pid = self.pid(node_id)
        if pid is None:
            raise BrokerError(f"node {node_id} of the cluster is not running")
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.pid(node_id) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        return pid

    def heal(self, timeout: float = 120) -> None:
        """Start again any node that is down, and wait for the whole cluster."""
        self.up(timeout)

    def down(self, timeout: float = 15) -> None:
        """Stop every node at once: a node stopped alone waits for a quorum the
        others no longer form, and only leaves when killed."""
        pids = [pid for node in self.nodes if (pid := running_pid(node)) is not None]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for node in self.nodes:
            while running_pid(node) is not None and time.monotonic() < deadline:
                time.sleep(0.2)
        for node in self.nodes:
            broker.down(node, timeout=1)
