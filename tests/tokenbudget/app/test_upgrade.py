"""A namespace an older build made, with its operators' commands on the budgets
topic, resumed by today's ``run``: the commands are moved to the control topic once,
and the job resumes as they say. Graded from the Parquet files and the topics."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from kafka import KafkaProducer

from tokenbudget import cli
from tokenbudget.app.identity import RECORD_KEY, RECORD_PARTITION, identity_of
from tokenbudget.app.precedence import SET_BY_COMMAND
from tokenbudget.core import config as config_module
from tokenbudget.core.kafka_admin import ensure_topics
from tokenbudget.dev.jobs import start_simulator, write_job
from tokenbudget.sinks.parquet import read_rows
from tokenbudget.sinks.reading import read_to_end
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics

pytestmark = pytest.mark.integration


def test_an_older_namespace_resumes_with_its_commands_moved_to_the_control_topic(
    tmp_path: Path, kafka_bootstrap: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"#short q{i}"}) + "\n" for i in range(60)))
    sim = start_simulator(tmp_path, "--tokens-per-second", "50000")
    try:
        path = write_job(tmp_path, kafka_bootstrap, namespace, sim.url, {"d": (data, 1_000_000)})
        config = config_module.load(path)
        topics = Topics(namespace)
        ensure_topics(kafka_bootstrap, topics.specs())
        # What an older build left on the budgets topic: the job's record, and a
        # budget set by hand while the config's 1,000,000 stood.
        older = KafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
        job = identity_of(config, by="run (an older build)")
        older.send(topics.budgets, codec.encode(job), key=RECORD_KEY, partition=RECORD_PARTITION)
        by_hand = ev.BudgetSet(
            dataset="d",
            budget=500,
            set_at=time.time(),
            set_by=SET_BY_COMMAND,
            config_budget=1_000_000,
        )
        older.send(topics.budgets, codec.encode(by_hand), key=b"d")
        older.flush()
        older.close()

        assert cli.main(["run", "--config", str(path), "--json"]) == 0
        err = capsys.readouterr().err
        assert f"namespace {namespace}: moved 2 operators' commands" in err
        assert "resuming the job unchanged" in err  # its record was found on control
        kept = read_rows(tmp_path / "out").column("completion_tokens").to_pylist()
        assert sum(kept) == 500  # the budget set by hand held

        moved: list[ev.Event] = []
        read_to_end(kafka_bootstrap, topics.control, moved.append)
        assert sorted(type(e).__name__ for e in moved) == ["BudgetSet", "JobIdentity"]

        assert cli.main(["run", "--config", str(path), "--json"]) == 0
        assert "moved" not in capsys.readouterr().err  # once
    finally:
        sim.stop()
