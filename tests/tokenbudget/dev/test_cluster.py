"""A local cluster's settings (its nodes run in tests/integration/test_cluster.py)."""

from __future__ import annotations

from pathlib import Path

from tokenbudget.dev import cluster


def test_free_ports_are_distinct_even_when_many_are_asked_for() -> None:
    # bound and closed one at a time, 400 draws from the ephemeral range repeat a port
    # more often than not
    ports = cluster._free_ports(400)
    assert len(set(ports)) == 400


def test_every_node_of_a_cluster_listens_on_ports_of_its_own(tmp_path: Path) -> None:
    created = cluster.LocalCluster.create(tmp_path, size=3)
    ports = [p for node in created.nodes for p in (node.port, node.controller_port)]
    assert len(set(ports)) == 6
