"""What ``run`` shows while it runs: bars on a terminal, lines otherwise, both fed
by the budget board."""

from __future__ import annotations

from pathlib import Path

from tokenbudget.app.progress import (
    BudgetProgress,
    ProgressLines,
    choose_mode,
    display,
    progress_line,
    short,
    state_line,
)
from tokenbudget.app.status import StatusRow, Tracker
from tokenbudget.core import config as config_module
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard


def snap(dataset: str, at: float, tokens: int, **kw: object) -> ev.LedgerSnapshot:
    fields: dict[str, object] = {
        "dataset": dataset,
        "budget": 1000,
        "unit": "completion_tokens",
        "completion_tokens": tokens,
        "prompt_tokens": 0,
        "samples": 1,
        "skipped": 0,
        "failed": 0,
        "produced": None,
        "halted": False,
        "status": "open",
        "at": at,
    }
    fields.update(kw)
    return ev.LedgerSnapshot(**fields)  # type: ignore[arg-type]


def two_datasets(tmp_path: Path, **metrics: object) -> config_module.Config:
    return config_module.build(
        {
            "metrics": metrics,
            "datasets": [
                {"name": "a", "path": "a.jsonl", "budget": 1000},
                {"name": "b", "path": "b.jsonl", "budget": 2000},
            ],
        },
        base_dir=tmp_path,
        environ={},
    )


def test_bars_follow_ledger_snapshots(tmp_path: Path) -> None:
    config = two_datasets(tmp_path)
    board = BudgetBoard()
    bars = BudgetProgress(config, board)
    board.apply(snap("a", 1.0, 100))
    bars.update()  # the bars sample the board every 0.25 s
    board.apply(snap("a", 3.0, 500))
    board.apply(snap("b", 3.0, 2100, halted=True, status="halted", budget=2000))
    bars.update()
    tasks = {t.description.strip(): t for t in bars.progress.tasks}
    assert tasks["a"].completed == 500 and tasks["a"].total == 1000
    assert tasks["a"].fields["rate"] == "200" and tasks["a"].fields["state"] == "open"
    assert tasks["a"].fields["eta"] == "2s"  # 500 left at 200/s
    assert tasks["b"].completed == 2000  # the bar stops at the budget; the text says more
    assert tasks["b"].fields["kept"] == "2.1k" and tasks["b"].fields["budget"] == "2k"
    assert tasks["b"].fields["state"] == "halted"


def test_short_numbers() -> None:
    assert [short(n) for n in (0, 999, 1000, 1234, 51_573, 400_000, 2_500_000)] == [
        "0",
        "999",
        "1k",
        "1.2k",
        "52k",
        "400k",
        "2.5M",
    ]


def row(*snaps: ev.LedgerSnapshot, now: float | None = None) -> StatusRow:
    tracker = Tracker()
    for s in snaps:
        tracker.observe(s)
    return tracker.row(snaps[-1].dataset, now=now)


def test_a_progress_line_has_what_a_bar_shows() -> None:
    line = progress_line(row(snap("a", 1.0, 100), snap("a", 3.0, 500)))
    assert line == "a: 500/1k completion_tokens (50%), 200/s, ETA 2s, open"
    stalled = row(snap("a", 1.0, 100), snap("a", 3.0, 500), now=100.0)
    assert progress_line(stalled) == "a: 500/1k completion_tokens (50%), 0/s, ETA -, open"


def test_a_state_line_only_for_news() -> None:
    opened = row(snap("a", 1.0, 100))
    halted = row(snap("a", 2.0, 1000, halted=True, status="halted", samples=9, skipped=4))
    exhausted = row(snap("a", 2.0, 700, status="exhausted", samples=7))
    assert state_line(opened, "unknown") is None
    assert state_line(opened, "open") is None
    assert state_line(halted, "open") == (
        "a: halted, its budget is reached: 1k/1k completion_tokens (samples 9, skipped 4, failed 0)"
    )
    assert state_line(halted, "halted") is None
    assert state_line(exhausted, "open") == (
        "a: exhausted, every prompt has an outcome: 700/1k completion_tokens "
        "(samples 7, skipped 0, failed 0)"
    )
    raised = row(snap("a", 3.0, 1000, budget=5000))
    assert state_line(raised, "halted") == (
        "a: open again, budget 5k completion_tokens (1k/5k completion_tokens)"
    )


def test_lines_say_each_change_once_and_every_dataset_on_each_tick(tmp_path: Path) -> None:
    board = BudgetBoard()
    lines = ProgressLines(two_datasets(tmp_path), board, interval=60)
    assert lines.changes() == []  # no snapshot yet
    assert lines.lines(now=0.0) == [
        "a: 0/1k completion_tokens (0%), 0/s, ETA -, unknown",
        "b: 0/2k completion_tokens (0%), 0/s, ETA -, unknown",
    ]
    board.apply(snap("a", 1.0, 100))
    board.apply(snap("b", 1.0, 100, budget=2000))
    assert lines.changes() == []  # open: what a dataset starts as
    board.apply(snap("b", 2.0, 2000, budget=2000, halted=True, status="halted"))
    assert lines.changes() == [
        "b: halted, its budget is reached: 2k/2k completion_tokens (samples 1, skipped 0, failed 0)"
    ]
    assert lines.changes() == []
    assert lines.lines(now=2.0) == [
        "a: 100/1k completion_tokens (10%), 0/s, ETA -, open",
        "b: 2k/2k completion_tokens (100%), 1.9k/s, ETA -, halted",
    ]


def test_bars_on_a_terminal_lines_elsewhere_none_when_lines_are_off(tmp_path: Path) -> None:
    assert choose_mode(terminal=True) == "live"
    assert choose_mode(terminal=False) == "lines"
    board = BudgetBoard()
    assert isinstance(display("live", two_datasets(tmp_path), board), BudgetProgress)
    every = display("lines", two_datasets(tmp_path, progress_interval_s=5), board)
    assert isinstance(every, ProgressLines) and every.interval == 5
    assert display("lines", two_datasets(tmp_path, progress_interval_s=0), board) is None
    assert display("off", two_datasets(tmp_path), board) is None
