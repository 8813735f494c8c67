"""The oracle's reading of a simulator's request log."""

from __future__ import annotations

import json
from pathlib import Path

from tokenbudget.dev import oracle


def test_peak_in_flight_counts_the_requests_the_server_had_at_once(tmp_path: Path) -> None:
    log = tmp_path / "server-requests.jsonl"
    served = [
        ("#a 1", 0.0, 3.0, "stop"),
        ("#a 2", 1.0, 2.0, "abort"),
        ("#b 1", 1.5, 4.0, "stop"),
        ("#a 3", 2.5, 5.0, "stop"),  # after #a 2 ended: three at once, not four
        ("#a 4", 2.6, 2.7, "fault"),  # refused: never in flight
    ]
    log.write_text(
        "".join(
            json.dumps({"text_head": head, "received_at": t0, "finished_at": t1, "finish": finish})
            + "\n"
            for head, t0, t1, finish in served
        )
    )
    assert oracle.peak_in_flight(log) == 3
    assert oracle.peak_in_flight(log, "#a") == 2
    assert oracle.peak_in_flight(log, "#c") == 0
