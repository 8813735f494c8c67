"""A local cluster's settings (its nodes run in tests/integration/test_cluster.py)."""

from __future__ import annotations

from pathlib import Path

from tokenbudget.dev import cluster


def test_every_node_of_a_cluster_listens_on_ports_of_its_own(tmp_path: Path) -> None:
    created = cluster.LocalCluster.create(tmp_path, size=3)
    ports = [p for node in created.nodes for p in (node.port, node.controller_port)]
    assert len(set(ports)) == 6
