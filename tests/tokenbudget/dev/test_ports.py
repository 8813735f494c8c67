"""Free local ports for the developer tools' processes."""

from __future__ import annotations

from tokenbudget.dev import ports


def test_free_ports_are_distinct_even_when_many_are_asked_for() -> None:
    # bound and closed one at a time, 400 draws from the ephemeral range repeat a port
    # more often than not
    assert len(set(ports.free_ports(400))) == 400
