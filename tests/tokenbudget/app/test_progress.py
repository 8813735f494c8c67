"""Progress bars in ``run``: one per dataset, fed by the budget board."""

from __future__ import annotations

from streams import events as ev
from streams.halts import BudgetBoard
from tokenbudget import config as config_module
from tokenbudget.app.progress import BudgetProgress, short


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


def test_bars_follow_ledger_snapshots(tmp_path) -> None:
    config = config_module.build(
        {
            "datasets": [
                {"name": "a", "path": "a.jsonl", "budget": 1000},
                {"name": "b", "path": "b.jsonl", "budget": 2000},
            ]
        },
        base_dir=tmp_path,
        environ={},
    )
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
