"""``tokenbudget plan`` without a pilot: from the dataset files and the rows already
under the sink path, with no broker and no server touched; "unknown" where nothing
is known. (With a pilot, against the simulator and graded by a real run:
tests/integration/test_plan.py.)"""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenbudget import cli
from tokenbudget.app import plan, saved_plan
from tokenbudget.app.status import StatusRow, plain_table
from tokenbudget.core import config as config_module

MAX_NEW_TOKENS = 4000


def write_job(tmp_path: Path, url: str, bootstrap: str, **extra: Any) -> Path:
    for name, count in (("long", 300), ("small", 6)):
        with (tmp_path / f"{name}.jsonl").open("w") as handle:
            for i in range(count):
                handle.write(json.dumps({"id": i, "prompt": f"{name} task {i}"}) + "\n")
    (tmp_path / "small.jsonl").open("a").write("not json\n")
    lines = [
        "[kafka]",
        f'bootstrap = "{bootstrap}"',
        "[inference]",
        f'url = "{url}"',
        f"max_new_tokens = {MAX_NEW_TOKENS}",
        "[[datasets]]",
        'name = "long"',
        'path = "long.jsonl"',
        'budget = "100k"',
        "[[datasets]]",
        'name = "small"',
        'path = "small.jsonl"',
        'budget = "100k"',
        "n = 2",
        *(f"{k} = {json.dumps(v)}" for k, v in extra.items()),
    ]
    path = tmp_path / "job.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_rows(root: Path, dataset: str, rows: list[dict[str, Any]]) -> None:
    folder = root / f"dataset={dataset}"
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(
        [
            {
                "prompt_id": f"{dataset}-{i}",
                "prompt_tokens": 20,
                "finish_reason": "stop",
                "max_new_tokens": MAX_NEW_TOKENS,
                "dispatched_at": 100.0 + i,
                "finished_at": 101.0 + i,
                **row,
            }
            for i, row in enumerate(rows)
        ]
    )
    pq.write_table(table, folder / f"part-{len(list(folder.iterdir()))}.parquet")


@pytest.fixture
def untouched() -> Any:
    """A Kafka bootstrap and a server URL that record any connection."""
    with (
        socket.create_server(("127.0.0.1", 0)) as kafka,
        socket.create_server(("127.0.0.1", 0)) as server,
    ):
        kafka.setblocking(False)
        server.setblocking(False)
        yield kafka, server
        for sock in (kafka, server):
            with pytest.raises(BlockingIOError):
                sock.accept()


def test_without_history_or_pilot_the_plan_says_unknown(
    tmp_path: Path, untouched: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    kafka, server = untouched
    job = write_job(
        tmp_path,
        f"http://127.0.0.1:{server.getsockname()[1]}",
        f"127.0.0.1:{kafka.getsockname()[1]}",
    )
    assert cli.main(["plan", "--config", str(job)]) == 0
    out = capsys.readouterr().out
    table = {line.split()[0]: line for line in out.splitlines()[2:4]}
    # prompts available: 300; small: 6 good rows, one bad, two answers each
    assert table["long"].split()[1:5] == ["100,000", "300", "unknown", "unknown"]
    assert table["small"].split()[1:3] == ["100,000", "12"]
    for name in ("long", "small"):
        assert table[name].split()[-3:] == ["unknown"] * 3, table[name]  # needed, outcome, time
    assert "time: unknown" in out and "--pilot N" in out
    assert "bad rows, skipped: small 1" in out
    assert cli.main(["plan", "--config", str(job), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    long = data["datasets"]["long"]
    assert (long["available"], long["needed"], long["outcome"], long["seconds"]) == (
        300,
        None,
        "unknown",
        None,
    )
    assert long["answers"] is None and data["tokens_per_s"] is None
    assert saved_plan.planned(config_module.load(job)) == {"long": "unknown", "small": "unknown"}


def test_a_plan_from_earlier_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = write_job(tmp_path, "http://127.0.0.1:1", "127.0.0.1:1")
    config = config_module.load(job)
    # 20 answers of 1,000 tokens over 20 s, of which two were cut at a budget's line
    # and one aborted: kept (they count against the budget), not lengths
    rows = [{"completion_tokens": 1000} for _ in range(17)]
    rows += [{"completion_tokens": 300, "finish_reason": "length", "max_new_tokens": 300}] * 2
    rows += [{"completion_tokens": 10, "finish_reason": "abort"}]
    write_rows(config.sink_path, "long", rows)
    write_rows(config.sink_path, "small", [{"completion_tokens": 5000}] * 2)  # capped at 4,000
    result = asyncio.run(plan.make_plan(config))
    long, small = result.datasets
    assert long.answers is not None and long.answers.count == 17
    assert (long.done, long.spent) == (20, 17_610)
    # (100,000 - 17,610) / 1,000 more, all lengths alike: exact
    assert (long.needed, long.needed_low, long.needed_high) == (20 + 83, 103, 103)
    assert long.outcome == "fills" and long.answers_from == "earlier rows"
    # every row's tokens over the 20 s some request was in flight (100 s to 120 s)
    assert result.tokens_per_s == pytest.approx((17_610 + 10_000) / 20)
    assert long.seconds == pytest.approx(83 * 1000 / result.tokens_per_s)
    assert small.answers is not None and small.answers.mean == MAX_NEW_TOKENS
    assert (small.available, small.outcome) == (12, "runs out")
    assert small.keeps == 10_000 + 10 * MAX_NEW_TOKENS
    text = plan.table(result)
    assert "runs out at 12" in text
    # 83,000 + 10 x 4,000 tokens still to generate at 1,380.5 tokens/s
    assert "the job, its datasets sharing the server: ~1m29s" in text
    line = plan.line(long, result.tokens_per_s)
    assert "need 103 at 1,000 tokens per answer (earlier rows: 17): fills" in line
    # run's plan: the same, one line per dataset, saved for status
    plan.announce(config)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == line and lines[1].startswith("tokenbudget: plan: small: 12 prompts")
    assert "runs out at 12" in lines[1]
    assert saved_plan.planned(config) == {"long": "103", "small": "25"}  # 2 + 90,000 / 4,000


def test_a_pilot_is_the_job_limited_to_n_requests_of_each_dataset(tmp_path: Path) -> None:
    job = write_job(tmp_path, "http://127.0.0.1:1", "127.0.0.1:1")
    config = config_module.load(job)
    limited = plan.pilot_config(config, config.datasets[1:], 5)
    assert [d.name for d in limited.datasets] == ["small"]
    assert limited.datasets[0].limit == 3  # n = 2: 3 prompts, 6 requests
    assert limited.datasets[0].budget == config.datasets[1].budget  # counted against it
    assert limited.kafka == config.kafka and limited.sink == config.sink


def test_status_shows_the_planned_prompts_beside_the_samples() -> None:
    row = StatusRow("long", 100, "completion_tokens", 50, 0, 50, 50.0, 0.0, None, "open", samples=7)
    text = plain_table([row], 0.0, {"long": "103 (99-107)"})
    header, _, body = text.splitlines()[:3]
    assert header.split()[-2:] == ["samples", "planned"]
    assert body.split()[-3:] == ["7", "103", "(99-107)"]
    assert "planned" not in plain_table([row], 0.0)


def test_after_a_run_the_kept_rows_are_shown_beside_their_source(tmp_path: Path) -> None:
    job = write_job(tmp_path, "http://127.0.0.1:1", "127.0.0.1:1")
    config = config_module.load(job)
    ids = plan.read_dataset(config, config.datasets[0], count_tokens=False).ids
    # the file's first 50 prompts ("long task 0" ... "long task 49"): its shortest
    rows = [{"prompt_id": ids[i], "completion_tokens": 100 + i} for i in range(49)]
    rows += [
        {
            "prompt_id": ids[49],
            "completion_tokens": 7,
            "finish_reason": "length",
            "max_new_tokens": 7,
        }
    ]
    write_rows(config.sink_path, "long", rows)
    long, small = plan.kept_report(config)
    assert (long.prompts, long.kept, long.cut) == (300, 50, 1)
    assert long.kept_prompt_length is not None and long.kept_prompt_length.p75 == 12
    assert long.prompt_length is not None and long.prompt_length.p50 == 13
    assert long.distance is not None and long.distance > long.random_within
    assert long.answers is not None and long.answers.count == 50
    assert (small.kept, small.distance, small.answers) == (0, None, None)
    text = plan.kept_table([long, small])
    assert "50/300" in text and "12/12/12" in text


@pytest.mark.parametrize(
    ("budget", "says"),
    [
        ({}, "the one answer at a budget's line is cut"),
        ({"cut": "any"}, "the answers in flight when a budget runs out are cut"),
        ({"on_boundary": "finish"}, "stops short"),
        ({"admission": "halt"}, "kept beyond the budget"),
        ({"unit": "samples"}, ""),
        ({"reserve": "grow"}, "the answers that outgrow a budget's end (few) are cut"),
        ({"reserve": "grow", "cut": "any"}, "every answer in flight when a budget is spent"),
    ],
)
def test_the_plan_says_how_the_end_of_a_budget_moves_the_count(
    tmp_path: Path, budget: dict[str, str], says: str
) -> None:
    inference = {"stream": True} if budget.get("reserve") == "grow" else {}
    config = config_module.build(
        {"budget": budget, "inference": inference}, base_dir=tmp_path, environ={}
    )
    effect = plan.boundary_effect(config)
    assert says in effect and (effect == "") == (says == "")
