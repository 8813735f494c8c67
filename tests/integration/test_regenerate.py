"""Conversations regenerated turn by turn (``turns = "regenerate"``) on the real
broker, as a user runs them: ``tokenbudget run`` and a thinking simulator that calls
tools as processes of their own, ``run`` SIGKILLed mid-job and run again.

Graded from outside: the simulator's request log says what history each request
held (a crc32 per message, the calls' ids, whether reasoning came back) and what it
answered; the dataset files say which conversation a request belongs to (its first
user turn) and the Parquet rows which answer was kept. Every turn after the first
is sent on the model's own kept answers, never with their reasoning; no turn whose
answer was kept before the kill is generated again; the budget is kept to the
token; a conversation cut by the budget is not continued; tool results come back
after the model's own call, and a call other than recorded ends its conversation,
marked. Every turn of every conversation ends with exactly one outcome.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer, OffsetAndMetadata, TopicPartition

from tokenbudget.core import kafka_admin
from tokenbudget.core.kafka import consumer_options
from tokenbudget.dev.jobs import (
    Watch,
    conversations,
    end_run,
    kill_tree_root,
    run_output,
    snapshots,
    start_run,
    start_simulator,
    survivors,
    wait_until,
    write_job,
)
from tokenbudget.dev.oracle import text_crc
from tokenbudget.producers.prompts.datasets import read_prompts
from tokenbudget.producers.prompts.ids import turn_prompt_id
from tokenbudget.producers.prompts.resume import OutcomeView, outcome_records
from tokenbudget.sinks.export import ExportOptions, export
from tokenbudget.sinks.parquet import read_rows
from tokenbudget.streams import events as ev
from tokenbudget.streams.ledger_worker import partition_of
from tokenbudget.streams.publisher import publish_events
from tokenbudget.streams.topics import Topics

pytestmark = pytest.mark.integration

CONVERSATIONS = 12
TURNS = 4
CHAT_BUDGET = 7_000  # about half of what the twelve conversations' turns take
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {}}}


def tool_rows(path: Path) -> Path:
    """Two conversations that call a tool first: one recorded with the call the model
    makes (the first tool offered, on the user's words), one with another function."""
    rows = []
    for name, recorded in (("match", "search"), ("mismatch", "lookup")):
        question = f"#short weather in {name}ville"
        call = {"id": "rec_1", "type": "function",
                "function": {"name": recorded, "arguments": {"query": question}}}  # fmt: skip
        rows.append({
            "id": name,
            "tools": [SEARCH, LOOKUP],
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "rec_1", "content": f"sunny in {name}ville"},
                {"role": "assistant", "content": "It is sunny."},
            ],
        })  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def server_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def first_user(record: dict[str, Any]) -> int:
    return next(m["crc"] for m in record["messages"] if m["role"] == "user")


def turn_of(record: dict[str, Any]) -> int:
    """Which turn a request asks for: the answers already in its history."""
    return sum(m["role"] == "assistant" for m in record["messages"])


@pytest.mark.timeout(600)
def test_conversations_go_on_from_the_models_own_answers_across_a_killed_run(
    tmp_path: Path, kafka_bootstrap: str, namespace: str
) -> None:
    kafka_admin.ensure_topics(kafka_bootstrap, Topics(namespace).specs())
    data = tmp_path / "data"
    data.mkdir()
    jobs = {
        "chat": (conversations(data / "chat.jsonl", CONVERSATIONS, TURNS), CHAT_BUDGET),
        "tools": (tool_rows(data / "tools.jsonl"), 1_000_000),
    }
    sim = start_simulator(
        tmp_path,
        "--tokens-per-second", "1500", "--reasoning-style", "reasoning_content", "--tool-calls",
    )  # fmt: skip
    config = write_job(
        tmp_path,
        kafka_bootstrap,
        namespace,
        sim.url,
        jobs,
        dataset_keys={
            "chat": {"turns": "regenerate", "reasoning": "save"},
            "tools": {"turns": "regenerate"},
        },
        inference={"api": "openai-chat"},
        metrics={"port": 0},
    )
    watch = Watch(kafka_bootstrap, namespace)
    log = tmp_path / "run.out"
    run = None
    try:
        run = start_run(config, log=log)
        # some turns answered, the chat dataset still open: killed mid-conversations
        wait_until(lambda: watch.samples() >= 8 or run.poll() is not None, "8 answers kept")
        assert run.poll() is None, log.read_text()[-3000:]
        children = kill_tree_root(run)
        killed_at = time.time()
        assert survivors(children) == {}
        run = start_run(config, log=log)
        assert run.wait(300) == 0, log.read_text()[-3000:]
        report = run_output(run, log)
    finally:
        end_run(run)
        watch.close()
        sim.stop()

    served = [r for r in server_log(sim.log) if r["finish"] != "fault"]
    by_rid = {r["rid"]: r for r in served}
    rows = read_rows(tmp_path / "out").to_pylist()
    assert len({r["prompt_id"] for r in rows}) == len(rows)  # nothing kept twice
    kept = {r["request_id"]: r for r in rows}
    assert set(kept) <= set(by_rid)  # every kept answer is one the server gave
    # Which conversation a request is of: its first user turn, from the dataset files.
    owner = {}
    for name, (path, _) in jobs.items():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            owner[text_crc(row["messages"][0]["content"])] = (name, row["id"])
    requests: dict[tuple[str, str], dict[int, list[dict[str, Any]]]] = {}
    for record in served:
        turns = requests.setdefault(owner[first_user(record)], {})
        turns.setdefault(turn_of(record), []).append(record)
    answers: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for row in rows:
        conversation = owner[first_user(by_rid[row["request_id"]])]
        answers.setdefault(conversation, {})[row["turn"]] = row

    for conversation, turns in answers.items():
        # the turns kept are the first ones, each on the kept answers before it
        assert sorted(turns) == list(range(len(turns))), conversation
        for k, row in turns.items():
            history = by_rid[row["request_id"]]["messages"]
            said = [m for m in history if m["role"] == "assistant"]
            assert [m["crc"] for m in said] == [
                by_rid[turns[j]["request_id"]]["content_crc"] for j in range(k)
            ], (conversation, k)
            assert not any(m.get("reasoning") for m in history)  # never sent back
            # no turn generated again once its answer was kept; only what was in
            # flight when run was killed is asked for again
            again = [r for r in requests[conversation][k] if r["rid"] != row["request_id"]]
            assert all(r["received_at"] < killed_at for r in again), (conversation, k)
            assert all(r["received_at"] < by_rid[row["request_id"]]["finished_at"] for r in again)
        # a conversation whose answer did not end on its own is not continued
        last = max(turns)
        if turns[last]["stop_reason"] != "stop" or turns[last]["tool_mismatch"]:
            assert max(requests[conversation]) == last, conversation

    chat = [r for r in rows if r["dataset"] == "chat"]
    assert sum(r["completion_tokens"] for r in chat) == CHAT_BUDGET  # to the token
    assert report["datasets"]["chat"]["completion_tokens"] == CHAT_BUDGET
    assert report["datasets"]["chat"]["status"] == "halted"
    assert any(r["reasoning"] for r in chat)  # it thought, and that was kept apart
    chat_answers = [a for (name, _), a in answers.items() if name == "chat"]
    assert any(len(a) > 1 for a in chat_answers) and any(len(a) < TURNS for a in chat_answers)

    # Tool use: the model's own call, then the recorded result pointing at it.
    match, mismatch = answers[("tools", "match")], answers[("tools", "mismatch")]
    called = by_rid[match[0]["request_id"]]
    assert called["tool_calls"] == 1 and match[0]["tool_mismatch"] is False
    [regenerated] = called["call_ids"]
    history = by_rid[match[1]["request_id"]]["messages"]
    assert history[1] == {"role": "assistant", "crc": 0, "calls": [regenerated]}
    assert history[2] == {
        "role": "tool", "crc": text_crc("sunny in matchville"), "tool_call_id": regenerated
    }  # fmt: skip
    assert match[1]["text"] and not match[1]["tool_calls"]
    assert list(mismatch) == [0] and mismatch[0]["tool_mismatch"] is True
    assert sorted(requests[("tools", "mismatch")]) == [0]  # its result answers no call
    assert snapshots(kafka_bootstrap, namespace)["tools"].status == "exhausted"

    # Every turn of every conversation has exactly one recorded outcome.
    outcomes = outcome_records(kafka_bootstrap, Topics(namespace))
    for name, (path, _) in jobs.items():
        for first in read_prompts(name, path, turns="regenerate"):
            ids = [turn_prompt_id(name, first.conversation_id or "", k) for k in range(first.turns)]
            assert all(i in outcomes for i in ids), (name, first.row_id)
            completed = sum(outcomes[i] == "completed" for i in ids)
            assert completed == len(answers.get((name, first.row_id or ""), {}))
    assert outcomes[turn_prompt_id("tools", mismatch[0]["conversation_id"], 1)] == "skipped"

    # The export: one record per conversation, incomplete ones marked or left out.
    summary = export(ExportOptions("messages", tmp_path / "train.jsonl", tmp_path / "out"))
    records = {
        (r["dataset"], r["id"]): r for r in map(json.loads, (tmp_path / "train.jsonl").open())
    }
    assert set(records) == set(answers)
    for key, record in records.items():
        said = [m for m in record["messages"] if m["role"] == "assistant"]
        assert len(said) == record["turns"] == len(answers[key])
        assert [m.get("reasoning_content") for m in said] == [
            answers[key][k]["reasoning"] for k in range(len(said))
        ]
        whole = len(said) == record["turns_in_dataset"] and all(
            answers[key][k]["stop_reason"] == "stop" for k in range(len(said))
        )
        assert record["complete"] is (whole and not record["tool_mismatch"]), key
    assert records[("tools", "match")]["complete"] is True
    assert records[("tools", "mismatch")]["tool_mismatch"] is True
    incomplete = Counter(name for (name, _), r in records.items() if not r["complete"])
    dropped = export(
        ExportOptions("messages", tmp_path / "whole.jsonl", tmp_path / "out", drop_incomplete=True)
    )
    assert dropped.incomplete == incomplete and summary.conversations == Counter(
        name for name, _ in records
    )


def test_a_dispatcher_takes_for_done_what_its_ledger_had_not_applied_when_killed(
    kafka_bootstrap: str, namespace: str
) -> None:
    """A run killed after a turn's answer was published but before its ledger applied
    it: the prompt comes back to a dispatcher, which must not generate it again (the
    rerun's producer already goes on from that answer)."""
    topics = Topics(namespace)
    kafka_admin.ensure_topics(kafka_bootstrap, topics.specs())

    def answer(prompt_id: str, lease: str = "") -> ev.CompletionEvent:
        return ev.CompletionEvent(
            request_id=f"r{prompt_id}", prompt_id=prompt_id, dataset="d", prompt_tokens=1,
            completion_tokens=1, output_ids=[7], finish_reason="stop", max_new_tokens=4,
            lease_id=lease,
        )  # fmt: skip

    answers = [
        answer("applied"),
        answer("late", "L1"),
        ev.LeaseFenced(dataset="d", lease_id="L1"),  # a frozen ledger's lease expired
        answer("after its fence", "L1"),  # kept by no one: to be generated again
        answer("later", "L2"),
    ]
    asyncio.run(publish_events(kafka_bootstrap, topics.completions, answers, "none"))
    # the ledger applied the first, committed, and was killed (its table written
    # before the commit; here it holds nothing)
    ledger = KafkaConsumer(
        **consumer_options(kafka_bootstrap), group_id=topics.ledger_app_id,
        enable_auto_commit=False,
    )  # fmt: skip
    partition = TopicPartition(topics.completions, partition_of("d", topics.partitions))
    ledger.assign([partition])
    ledger.commit({partition: OffsetAndMetadata(1, "", -1)})
    ledger.close(autocommit=False)

    view = OutcomeView(kafka_bootstrap, topics)
    try:
        view.refresh()
    finally:
        view.close()
    assert view.completed == {"late", "later"}
