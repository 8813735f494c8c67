"""The fleet as people see it (tokenbudget/app/servers.py), without a broker: the
table after the servers are probed, the rows made from what each dispatcher
reported (added up per server, the best state wins, stopped dispatchers left out),
the changes made with ``servers``, the progress lines, the command line."""

from __future__ import annotations

import pytest

from tokenbudget.app import servers
from tokenbudget.app.progress import ProgressLines
from tokenbudget.cli import build_parser
from tokenbudget.core.config import build
from tokenbudget.core.errors import ConfigError
from tokenbudget.producers.inference.backends import ServerCheck
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.fields import ServerReport


def report(holder: str, at: float, *entries: tuple[str, str, int, int]) -> ev.FleetReport:
    """``entries``: (url, state, in flight, tokens so far), windows of 8."""
    return ev.FleetReport(
        holder=holder,
        at=at,
        servers=tuple(
            ServerReport(
                url=url,
                state=state,  # type: ignore[arg-type]
                in_flight=in_flight,
                limit=8,
                concurrency=8,
                requests=tokens // 10,
                tokens=tokens,
                errors=0,
            )
            for url, state, in_flight, tokens in entries
        ),
    )


def test_the_start_table_says_which_servers_are_up() -> None:
    text = servers.start_table(
        [
            ServerCheck("http://a:1", True, ("m",)),
            ServerCheck("http://b:1", False, problem="cannot reach the inference server"),
        ]
    )
    first, _, _, up, down = text.splitlines()
    assert first.startswith("tokenbudget: 2 inference server(s), 1 up (the job starts on those")
    assert up.split()[:3] == ["http://a:1", "up", "m"]
    assert down.split()[:2] == ["http://b:1", "down"] and "cannot reach" in down


def test_rows_add_up_the_dispatchers_and_show_the_best_state() -> None:
    tracker = servers.FleetTracker()
    for event in (
        report("d1", 100.0, ("http://a", "up", 3, 1000), ("http://b", "paused", 0, 500)),
        report("d2", 100.0, ("http://a", "up", 5, 2000), ("http://b", "up", 2, 100)),
        report("d1", 102.0, ("http://a", "up", 4, 1400), ("http://b", "paused", 0, 500)),
        report("old", 10.0, ("http://a", "dropped", 99, 10**6)),  # stopped long ago
    ):
        tracker.observe(event)
    a, b = tracker.rows(["http://a", "http://b"])
    assert (a.state, a.in_flight, a.limit, a.tokens) == ("up", 9, 16, 3400)
    assert a.tokens_per_s == 200.0  # d1: 400 tokens in 2 s; d2 has one report
    assert (b.state, b.in_flight) == ("up", 2)  # one of its dispatchers still sees it up


def test_changes_add_servers_and_drain_them() -> None:
    tracker = servers.FleetTracker()
    tracker.observe(ev.ServerAdded(url="http://c", at=1.0))
    tracker.observe(ev.ServerDrained(url="http://a", at=2.0))
    rows = tracker.rows(["http://a", "http://b"])
    assert [(r.url, r.state) for r in rows] == [
        ("http://a", "drained"),
        ("http://b", "-"),
        ("http://c", "-"),
    ]
    assert rows[0].change.startswith("drained ") and rows[2].change.startswith("added ")
    assert "changed" in servers.table(rows).splitlines()[0]


def test_added_checks_its_arguments() -> None:
    config = build({}, environ={})
    event = servers.added(config, "http://c:1", concurrency=16, weight=None, key_env=None)
    assert (event.url, event.concurrency, event.api_key_env) == ("http://c:1", 16, None)
    with pytest.raises(ConfigError) as info:
        servers.added(config, "c:1", concurrency=None, weight=None, key_env=None)
    assert info.value.key == "URL"
    with pytest.raises(ConfigError):
        servers.added(config, "http://c:1", concurrency=0, weight=None, key_env=None)


ALLOWING = {
    "inference": {
        "servers": [{"url": "http://a:1"}, {"url": "http://b:1", "api_key_env": "B_KEY"}],
        "added_servers": ["https://gpu-"],
        "added_server_keys": ["GPU_KEY"],
    }
}


@pytest.mark.parametrize(
    ("url", "key_env", "refused_by"),
    [
        ("https://gpu-7:30000", None, None),
        ("https://gpu-7:30000", "GPU_KEY", None),
        ("https://gpu-7:30000", "B_KEY", None),  # a configured server's
        ("https://gpu-7:30000", "TOKENBUDGET_API_KEY", None),  # [inference]'s, named
        ("http://a:1", None, None),  # a configured server may always come back
        ("https://cpu-7:30000", None, "inference.added_servers"),
        ("http://gpu-7:30000", None, "inference.added_servers"),  # the prefix says https
        ("https://gpu-7:30000", "HOME", "inference.added_server_keys"),
        ("http://a:1", "AWS_SECRET_ACCESS_KEY", "inference.added_server_keys"),
    ],
)
def test_servers_add_is_refused_before_it_publishes_what_dispatchers_would_refuse(
    url: str, key_env: str | None, refused_by: str | None
) -> None:
    config = build(ALLOWING, environ={})
    if refused_by is None:
        event = servers.added(config, url, concurrency=None, weight=None, key_env=key_env)
        assert (event.url, event.api_key_env) == (url, key_env)
        return
    with pytest.raises(ConfigError) as info:
        servers.added(config, url, concurrency=None, weight=None, key_env=key_env)
    assert info.value.key == refused_by and url in str(info.value)


def test_progress_lines_show_the_fleet_and_its_changes_of_state() -> None:
    config = build(
        {"inference": {"servers": [{"url": "http://a"}, {"url": "http://b"}]}}, environ={}
    )
    board = BudgetBoard()
    lines = ProgressLines(config, board, interval=60)
    board.apply(report("d1", 1.0, ("http://a", "up", 3, 0), ("http://b", "up", 1, 0)))
    assert lines.changes() == []  # up from the start: no news
    assert lines.lines() == [
        "server http://a: up, 3/8 in flight, 0 tokens/s, 0 errors",
        "server http://b: up, 1/8 in flight, 0 tokens/s, 0 errors",
    ]
    board.apply(report("d1", 3.0, ("http://a", "up", 3, 800), ("http://b", "paused", 0, 0)))
    assert lines.changes() == ["server http://b: paused"]
    assert lines.lines()[0] == "server http://a: up, 3/8 in flight, 400 tokens/s, 0 errors"
    board.apply(report("d1", 4.0, ("http://a", "up", 3, 800), ("http://b", "up", 0, 0)))
    assert lines.changes() == ["server http://b: up again"]
    assert servers.summary(servers.FleetTracker().rows(["http://a"])) == "0/1 up"


def test_a_fleet_of_one_up_server_adds_no_lines() -> None:
    board = BudgetBoard()
    lines = ProgressLines(build({}, environ={}), board, interval=60)
    board.apply(report("d1", 1.0, ("http://127.0.0.1:30000", "up", 3, 0)))
    assert lines.lines() == [] and lines.changes() == []


def test_the_servers_command_line() -> None:
    parser = build_parser(["servers", "add", "http://c:1", "--config", "j.toml"])
    args = parser.parse_args(
        ["servers", "add", "http://c:1", "--config", "j.toml", "--concurrency", "32"]
    )
    assert (args.servers_command, args.url, args.concurrency) == ("add", "http://c:1", 32)
    run = build_parser(["run"]).parse_args(
        ["run", "--config", "j.toml", "--server", "http://a:1", "--server", "http://b:1"]
    )
    assert run.server == ["http://a:1", "http://b:1"]
