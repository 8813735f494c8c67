"""Records no tokenbudget process wrote, on every topic of a job, before its run: forged
halts, grants, servers and budgets, events on topics they do not travel on, counts of
2**63, a dataset that is a path, JSON nested 1,000 deep, 1.5 MB of binary. The run
ends exact and says nothing died; each bad record is dead-lettered by the role that
reads it, or refused. Graded from outside: the servers' own request logs, the
dataset files, the Parquet files, the folders on disk and the dead-letter topic."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from kafka import KafkaProducer

from tokenbudget import cli
from tokenbudget.core.kafka_admin import ensure_topics
from tokenbudget.dev import oracle
from tokenbudget.dev.jobs import start_simulator, write_job
from tokenbudget.sinks.reading import read_to_end
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics

pytestmark = pytest.mark.integration

NESTED = b'{"type":"completion","v":6,"input_columns":{"a":' + b"[" * 1000 + b"]" * 1000 + b"}}"
BINARY = bytes(range(256)) * (1_500_000 // 256)
BUDGETS = {"a": 1500, "b": 1200}


def completion(dataset: str, **counts: int) -> ev.CompletionEvent:
    return ev.CompletionEvent(
        request_id=f"forged-{dataset[:8]}",
        prompt_id="forged",
        dataset=dataset,
        prompt_tokens=counts.get("prompt_tokens", 1),
        completion_tokens=counts.get("completion_tokens", 1),
        output_ids=[],
        finish_reason="stop",
        max_new_tokens=counts.get("max_new_tokens", 1),
        count_source="usage",
    )


def hostile(topics: Topics, evil_url: str, real_url: str) -> dict[str, list[bytes]]:
    """What a plain Kafka client writes on each topic."""
    return {
        topics.budgets: [
            # One halt at the highest epoch would win over every real one, for ever.
            codec.encode(ev.BudgetExceeded(dataset="a", budget=1, used=1, epoch=2**64 - 1)),
            # Operators' commands, on the ledger's topic: the fleet redirected, drained.
            codec.encode(ev.ServerAdded(url=evil_url, api_key_env="TOKENBUDGET_API_KEY")),
            codec.encode(ev.ServerDrained(url=real_url)),
            BINARY,
        ],
        topics.control: [
            codec.encode(ev.BudgetSet(dataset="b", budget=-5)),
            codec.encode(
                ev.BudgetExceeded(dataset="b", budget=1, used=1)
            ),  # not the ledger's topic
            NESTED,
            BINARY,
        ],
        topics.reservations: [
            codec.encode(
                ev.LeaseRequested(dataset="a", lease_id="l", holder="h", want=-500, ttl_s=1e308)
            ),
            NESTED,
            BINARY,
        ],
        topics.completions: [
            codec.encode(completion("x/../../../escaped")),
            codec.encode(completion("a", completion_tokens=2**63, max_new_tokens=0)),
            codec.encode(completion("a", prompt_tokens=2**63)),
            NESTED,
            BINARY,
        ],
        topics.prompts: [
            codec.encode(ev.PromptEvent(prompt_id="p", dataset="not_this_jobs", text="hi")),
            codec.encode(ev.PromptEvent(prompt_id="p", dataset="../../x", text="hi")),
            NESTED,
            BINARY,
        ],
        topics.outcomes: [NESTED, BINARY],
    }


def test_records_no_process_of_ours_wrote_on_every_topic_leave_the_job_exact(
    tmp_path: Path,
    kafka_bootstrap: str,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("TOKENBUDGET_API_KEY", "the-jobs-own-key")
    files = {}
    for name in BUDGETS:
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text(
            "".join(json.dumps({"prompt": f"#short {name} {i}"}) + "\n" for i in range(80))
        )
    sim = start_simulator(tmp_path, "--tokens-per-second", "50000")
    evil = start_simulator(tmp_path, name="evil")
    try:
        datasets = {name: (files[name], BUDGETS[name]) for name in BUDGETS}
        config = write_job(tmp_path, kafka_bootstrap, namespace, sim.url, datasets)
        topics = Topics(namespace)
        ensure_topics(kafka_bootstrap, topics.specs())
        writer = KafkaProducer(
            bootstrap_servers=kafka_bootstrap, acks="all", max_request_size=8 * 1024 * 1024
        )
        written = hostile(topics, evil.url, sim.url)
        for topic, values in written.items():
            for value in values:
                writer.send(topic, key=b"a", value=value)
        writer.flush()
        writer.close()

        with caplog.at_level(logging.DEBUG, logger="tokenbudget.streams.budget_board"):
            assert cli.main(["run", "--config", str(config), "--json"]) == 0
    finally:
        sim.stop()
        evil.stop()

    # Exact, from the server's log and the files: the forged halt halted nothing, the
    # forged budget and counts moved no budget, nothing was kept twice.
    verdict = oracle.judge(tmp_path / "out", sim.log, datasets)
    assert verdict.ok, "\n".join(verdict.lines())
    assert {n: d.kept_tokens for n, d in verdict.datasets.items()} == BUDGETS
    # The evil server never heard from the job, nor got its key.
    assert not evil.log.exists() or evil.log.read_text() == ""
    # Nothing was written outside the sink's folder, and only the job's datasets in it.
    folders = sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir())
    assert folders == ["dataset=a", "dataset=b"]
    assert not (tmp_path.parent / "escaped").exists() and not (tmp_path / "escaped").exists()

    # Each bad record that a role reads is dead-lettered by it, and every letter fits.
    letters: list[ev.Event] = []
    read_to_end(kafka_bootstrap, topics.dead_letter, letters.append)
    by_topic: dict[str, list[ev.DeadLetter]] = {}
    for letter in letters:
        assert isinstance(letter, ev.DeadLetter)
        by_topic.setdefault(letter.source_topic, []).append(letter)
    for topic in (topics.completions, topics.control, topics.reservations, topics.outcomes):
        # the ledger reads them all; the sink the completions too
        offsets = {letter.offset for letter in by_topic[topic]}
        assert offsets == set(range(len(written[topic]))), (topic, by_topic[topic])
    assert {d.offset for d in by_topic[topics.prompts]} == set(range(len(written[topics.prompts])))
    big = [d for d in letters if isinstance(d, ev.DeadLetter) and d.size == len(BINARY)]
    assert len(big) >= 5 and all(len(codec.encode(d)) < 200_000 for d in big)
    reasons = " ".join(d.reason for d in letters if isinstance(d, ev.DeadLetter))
    assert "is not one of this job's" in reasons  # the prompt of another job
    assert "at `$.dataset`" in reasons and "at `$.completion_tokens`" in reasons
    # The forged events on the budgets topic (which only the ledger reads no more:
    # every process reads it, none dead-letters) are refused, not applied.
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    on_budgets = [m for m in refused if f"{topics.budgets}[0]@" in m]
    assert len(on_budgets) == len(written[topics.budgets]), refused
    assert "at `$.epoch`" in on_budgets[0]
    assert all("does not travel on" in m for m in on_budgets[1:3])
