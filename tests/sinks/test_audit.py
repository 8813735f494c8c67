"""What a replay checks: the skips and failures it counts with the ledger's rule."""

from __future__ import annotations

import pytest

from tokenbudget.sinks import audit
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics


def test_replayed_outcome_counts_keep_each_prompts_first_outcome(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = [
        ev.PromptSkipped(prompt_id="p1", dataset="ds", reason="halted"),
        ev.PromptFailed(prompt_id="p1", dataset="ds", reason="boom", attempts=1),  # not first
        ev.PromptFailed(prompt_id="p2", dataset="ds", reason="boom", attempts=1),
        ev.PromptSkipped(prompt_id="p3", dataset="ds", reason="halted"),  # completed later
        ev.PromptSkipped(prompt_id="q1", dataset="other", reason="halted"),  # not asked for
    ]

    def read_to_end(bootstrap: str, topic: str, apply: object) -> None:
        for event in events:
            apply(event)  # type: ignore[operator]

    monkeypatch.setattr(audit, "read_to_end", read_to_end)
    counts = audit.outcome_counts(
        "unused:9092",
        Topics("ns"),
        completed={"p3"},
        datasets=frozenset({"ds"}),
        rejected={"p2": "ds", "p4": "ds"},  # p2 failed first; p4 has no other outcome
    )
    assert counts == {"ds": (2, 1)}  # skipped p1, p4; failed p2
