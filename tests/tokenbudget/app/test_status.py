"""``tokenbudget status``: the tokens/s and ETA arithmetic, the rows it shows, and
what it says with no broker or for a namespace that never ran."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tokenbudget import cli
from tokenbudget.app.status import (
    Tracker,
    TrackingBoard,
    format_eta,
    plain_table,
    rate_and_eta,
    to_json,
)
from tokenbudget.cli import build_parser
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard


def snap(dataset: str, at: float, tokens: int, **kw: object) -> ev.LedgerSnapshot:
    fields: dict[str, object] = {
        "dataset": dataset,
        "budget": 1000,
        "unit": "completion_tokens",
        "completion_tokens": tokens,
        "prompt_tokens": 5,
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


def test_rate_is_measured_over_the_window_and_eta_is_remaining_over_rate() -> None:
    points = [(0.0, 0), (10.0, 100), (20.0, 300), (30.0, 500)]
    rate, eta = rate_and_eta(points, remaining=400, window=20)
    assert rate == pytest.approx(20.0)  # (500 - 100) / (30 - 10)
    assert eta == pytest.approx(20.0)


def test_rate_uses_every_point_when_the_window_is_long() -> None:
    rate, eta = rate_and_eta([(20.0, 300), (0.0, 0)], remaining=600, window=100)
    assert rate == pytest.approx(15.0)
    assert eta == pytest.approx(40.0)


@pytest.mark.parametrize(
    ("points", "remaining", "expected"),
    [
        ([], 100, (0.0, None)),  # nothing seen
        ([(5.0, 10)], 100, (0.0, None)),  # one point: no rate
        ([(5.0, 10), (5.0, 20)], 100, (0.0, None)),  # no time elapsed
        ([(0.0, 50), (10.0, 50)], 100, (0.0, None)),  # no progress: no ETA
        ([(0.0, 50), (10.0, 150)], 0, (10.0, 0.0)),  # spent: ETA 0
        ([(0.0, 50), (10.0, 150)], None, (10.0, None)),  # no budget
        ([(0.0, 500), (10.0, 400)], 100, (0.0, None)),  # went down (budget unit changed)
    ],
)
def test_rate_and_eta_edges(
    points: list[tuple[float, int]], remaining: int | None, expected: tuple[float, float | None]
) -> None:
    assert rate_and_eta(points, remaining) == expected


def test_tracker_rows_follow_snapshots() -> None:
    tracker = Tracker(window=30)
    tracker.observe(snap("a", 100.0, 200))
    tracker.observe(snap("a", 110.0, 400))
    tracker.observe(snap("a", 105.0, 999))  # older than the latest: ignored
    tracker.observe(
        snap("b", 110.0, 1100, halted=True, status="halted", unit="total_tokens", budget=1000)
    )
    a, b, c = tracker.rows(["a", "b", "c"], {"c": 50})
    assert (a.kept, a.remaining, a.state) == (400, 600, "open")
    assert a.tokens_per_s == pytest.approx(20.0)
    assert a.eta_s == pytest.approx(30.0)
    assert a.percent_used == pytest.approx(40.0)
    assert a.reserved == 0
    # total_tokens counts the prompt tokens too
    assert (b.kept, b.remaining, b.state, b.eta_s) == (1105, 0, "halted", None)
    assert b.percent_used == pytest.approx(110.5)
    # configured, but the ledger has said nothing of it yet
    assert (c.state, c.budget, c.kept, c.remaining) == ("unknown", 50, 0, 50)
    data = to_json([a, b, c], 1.0)
    assert data["datasets"]["a"]["tokens_per_s"] == pytest.approx(20.0)  # type: ignore[index]


def test_with_now_only_recent_snapshots_make_a_rate() -> None:
    points = [(100.0, 0), (110.0, 200), (120.0, 400)]
    assert rate_and_eta(points, 600, window=30, now=125.0) == (20.0, 30.0)
    # snapshots stopped a minute ago (job over, ledger down): no rate, no ETA
    assert rate_and_eta(points, 600, window=30, now=180.0) == (0.0, None)
    # a ledger that is up but sees no progress keeps publishing the same count
    assert rate_and_eta([(100.0, 400), (105.0, 400)], 600, window=30, now=106.0) == (0.0, None)
    tracker = Tracker(window=30)
    for at, used in points:
        tracker.observe(snap("a", at, used))
    assert tracker.row("a", now=125.0).tokens_per_s == 20.0
    assert tracker.row("a", now=180.0).tokens_per_s == 0.0


def test_plain_table_and_footer() -> None:
    tracker = Tracker()
    tracker.observe(snap("a", 100.0, 250))
    text = plain_table(tracker.rows(["a", "b"], {"b": 10}, now=110.0), 110.0)
    lines = text.splitlines()
    assert lines[0].split() == [
        "dataset",
        "budget",
        "kept",
        "reserved",
        "remaining",
        "used",
        "tokens/s",
        "ETA",
        "state",
    ]
    assert lines[2].split() == ["a", "1,000", "250", "0", "750", "25.0%", "0", "-", "open"]
    assert lines[3].split()[-1] == "unknown"
    assert lines[-1].startswith("latest ledger snapshot 10 s ago")


def test_exhausted_datasets_have_no_eta() -> None:
    tracker = Tracker()
    tracker.observe(snap("x", 1.0, 10, status="exhausted", produced=1))
    tracker.observe(snap("x", 2.0, 20, status="exhausted", produced=1))
    (row,) = tracker.rows(["x"])
    assert row.state == "exhausted" and row.eta_s is None


def test_tracking_board_keeps_the_board_behaviour() -> None:
    board = TrackingBoard()
    board.apply(snap("a", 1.0, 10))
    board.apply(snap("a", 2.0, 1000, halted=True, status="halted"))
    assert board.is_halted("a")
    assert board.tracker.row("a").tokens_per_s == pytest.approx(990.0)


def test_format_eta() -> None:
    assert format_eta(None) == "-"
    assert format_eta(42.4) == "42s"
    assert format_eta(125) == "2m05s"
    assert format_eta(3 * 3600 + 7 * 60) == "3h07m"


def test_status_command_line() -> None:
    args = build_parser().parse_args(["status", "--config", "x.toml", "--watch", "--json"])
    assert (args.config, args.watch, args.json, args.interval) == ("x.toml", True, True, 1.0)


def test_watch_table_fits_the_terminal_by_shortening_names_only() -> None:
    import io

    from rich.console import Console

    from tokenbudget.app.status import table

    tracker = Tracker()
    tracker.observe(
        snap(
            "a_rather_long_dataset_name", 1.0, 400_000, budget=400_000, status="halted", halted=True
        )
    )
    tracker.observe(snap("small", 1.0, 51_543, budget=400_000, status="exhausted"))
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=False)
    console.print(table(tracker.rows(["a_rather_long_dataset_name", "small"], now=2.0), 80))
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert any(line.rstrip().endswith("exhausted") for line in lines)
    assert any(line.startswith("a_rather_long") and "…" in line for line in lines)


def status_config(tmp_path: Path, bootstrap: str, namespace: str = "tokenbudget") -> Path:
    config = tmp_path / "job.toml"
    config.write_text(
        f'[kafka]\nbootstrap = "{bootstrap}"\nnamespace = "{namespace}"\n'
        '[[datasets]]\nname = "a"\npath = "a.jsonl"\nbudget = 1000\n'
    )
    return config


def test_with_the_local_broker_down_status_says_so_and_how_to_start_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TOKENBUDGET_HOME", str(tmp_path / "broker"))  # none runs there
    monkeypatch.delenv("TOKENBUDGET_KAFKA_PORT", raising=False)
    monkeypatch.delenv("TOKENBUDGET_LOG", raising=False)
    config = status_config(tmp_path, "local")
    assert cli.main(["status", "--config", str(config)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == (
        "tokenbudget: error: the local broker (127.0.0.1:9092) is not running, so no job "
        "runs on it; start it with `tokenbudget broker up`, or start the job with "
        f"`tokenbudget run --config {config}`\n"
    )


@pytest.mark.integration
def test_status_of_a_namespace_that_never_ran_says_so_in_one_line(
    tmp_path: Path,
    kafka_bootstrap: str,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("TOKENBUDGET_LOG", raising=False)
    config = status_config(tmp_path, kafka_bootstrap, namespace)
    said = (
        f"job '{namespace}' has never run on {kafka_bootstrap} (no topic "
        f"{namespace}.budgets): nothing to show; `tokenbudget run --config {config}` "
        "starts it\n"
    )
    assert cli.main(["status", "--config", str(config)]) == 0
    assert capsys.readouterr() == (said, "")
    assert cli.main(["status", "--config", str(config), "--json"]) == 0
    out, err = capsys.readouterr()
    assert err == said
    assert json.loads(out)["datasets"]["a"]["state"] == "unknown"


# ---- what is read from Kafka is printed with its control characters visible -----------

CLEAR = "evil\x1b[2J\x1b[Hname"  # a dataset name that clears the screen when printed raw
SHOWN = "evil\\x1b[2J\\x1b[Hname"


def events_on_the_topic() -> list[ev.Event]:
    return [
        snap("a", 1.0, 10),
        snap(CLEAR, 1.0, 20),  # a dataset only the topic knows, named by whoever wrote it
        ev.ServerAdded(url="http://gpu9:1/\x1b[31m[red]x", at=1.0),
    ]


class TopicWatcher:
    """The job's topics, as :class:`BudgetWatcher` reads them to ``status`` and
    ``servers list``."""

    def __init__(
        self,
        bootstrap: str,
        topics: object,
        board: BudgetBoard | None = None,
        *,
        fleet_reports: bool = False,
    ) -> None:
        self.board = board or BudgetBoard()
        self.caught_up = asyncio.Event()

    async def start(self) -> None:
        for event in events_on_the_topic():
            self.board.apply(event)
        self.caught_up.set()

    async def run(self) -> None:
        await asyncio.Event().wait()

    async def stop(self) -> None:
        pass


def test_status_prints_names_and_urls_read_from_the_topic_with_escapes_visible(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tokenbudget.app import status
    from tokenbudget.streams.topics import Topics

    monkeypatch.setattr(status, "BudgetWatcher", TopicWatcher)
    code = asyncio.run(
        status.follow(
            "k:9092",
            Topics("n"),
            ["a"],
            {"a": 1000},
            watch=False,
            as_json=False,
            servers=["http://a:1"],
        )
    )
    out = capsys.readouterr().out
    assert code == 0 and "\x1b" not in out
    assert SHOWN in out and "http://gpu9:1/\\x1b[31m[red]x" in out
    # --json carries the names as they are (JSON escapes them itself)
    asyncio.run(status.follow("k:9092", Topics("n"), ["a"], {}, watch=False, as_json=True))
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and CLEAR in json.loads(printed)["datasets"]


def test_the_watch_table_shows_escapes_and_markup_as_written() -> None:
    import io

    from rich.console import Console

    from tokenbudget.app.status import table

    board = TrackingBoard()
    for event in events_on_the_topic():
        board.apply(event)
    tracker = board.tracker
    tracker.observe(snap("[bold]x", 1.0, 5))
    out = io.StringIO()
    Console(file=out, width=200, force_terminal=False).print(table(tracker.rows(["a"]), 200))
    text = out.getvalue()
    assert "\x1b" not in text and SHOWN in text and "[bold]x" in text


def test_servers_list_prints_urls_read_from_the_topic_with_escapes_visible(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from tokenbudget.app import servers
    from tokenbudget.core.config import build

    monkeypatch.setattr(servers, "BudgetWatcher", TopicWatcher)
    text = servers.listing(build({}, environ={}), "k:9092", as_json=False)
    assert "\x1b" not in text and "http://gpu9:1/\\x1b[31m[red]x" in text
    tracker = servers.FleetTracker()
    tracker.observe(events_on_the_topic()[2])
    (row,) = tracker.rows([])
    assert servers.progress_line(row) == (
        "server http://gpu9:1/\\x1b[31m[red]x: -, 0/0 in flight, 0 tokens/s, 0 errors"
    )
