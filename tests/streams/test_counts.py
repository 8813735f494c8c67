"""The per-dataset counts: read by name from whatever carries them, and the
outcomes the reports print, in their order."""

from __future__ import annotations

from dataclasses import dataclass

from tokenbudget.streams import events as ev
from tokenbudget.streams.counts import COUNTS, DatasetCounts
from tokenbudget.streams.ledger import DatasetLedger


def snapshot() -> ev.LedgerSnapshot:
    return ev.LedgerSnapshot(
        dataset="a",
        budget=1000,
        unit="completion_tokens",
        completion_tokens=500,
        prompt_tokens=20,
        samples=9,
        skipped=4,
        failed=1,
        produced=None,
        halted=False,
        status="open",
    )


def test_the_counts_are_read_from_a_snapshot_and_a_ledger_state_alike() -> None:
    counts = DatasetCounts.of(snapshot())
    assert counts == DatasetCounts(
        samples=9, completion_tokens=500, prompt_tokens=20, skipped=4, failed=1
    )
    state = DatasetLedger(dataset="a", completion_tokens=500, prompt_tokens=20, samples=9)
    assert DatasetCounts.of(state) == DatasetCounts(
        samples=9, completion_tokens=500, prompt_tokens=20
    )
    assert COUNTS == ("samples", "completion_tokens", "prompt_tokens", "skipped", "failed")


def test_a_record_that_holds_the_counts_takes_them_with_its_own_fields() -> None:
    @dataclass(frozen=True)
    class Row(DatasetCounts):
        name: str

    row = Row.of(snapshot(), name="a")
    assert (row.name, row.samples, row.failed) == ("a", 9, 1)
    assert row.outcomes() == {"samples": 9, "skipped": 4, "failed": 1}
