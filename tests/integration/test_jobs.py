"""A job is its config: two configs are two jobs on one broker with nothing to type,
a rerun of each resumes its own, a copy under another file name is another job, and
``tokenbudget jobs`` lists them. On the real broker, with ``tokenbudget run`` as a
user types it; graded from outside: the simulator's own request log, the dataset
files and the Parquet folders."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tokenbudget import cli
from tokenbudget.app import identity
from tokenbudget.dev import oracle
from tokenbudget.dev.jobs import Simulator, write_job
from tokenbudget.sinks.parquet import read_rows

pytestmark = pytest.mark.integration


def unnamed_job(folder: Path, bootstrap: str, url: str, marker: str, budget: int) -> Path:
    """``folder/job.toml``, naming neither its job nor a namespace, as a user writes it."""
    folder.mkdir()
    data = folder / "prompts.jsonl"
    data.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"#short {marker} {i}"}) + "\n" for i in range(60)
        )
    )
    written = write_job(folder, bootstrap, "unused", url, {"d": (data, budget)})
    config = folder / "job.toml"
    config.write_text(re.sub(r'(?m)^namespace = "unused"\n', "", written.read_text()))
    if written != config:
        written.unlink()
    return config


def run(config: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = cli.main(["run", "--config", str(config), "--json"])
    return code, capsys.readouterr().err


def kept(folder: Path) -> int:
    return int(sum(read_rows(folder).column("completion_tokens").to_pylist()))


def test_two_jobs_in_two_folders_each_resume_their_own_and_are_listed(
    tmp_path: Path,
    kafka_bootstrap: str,
    sim: Simulator,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a = unnamed_job(tmp_path / "a", kafka_bootstrap, sim.url, "A", 900)
    b = unnamed_job(tmp_path / "b", kafka_bootstrap, sim.url, "B", 700)
    # Before jobs had names, the second stopped: "for a new job set another [kafka]
    # namespace" (the two shared the namespace "tokenbudget").
    assert run(a, capsys)[0] == 0
    assert run(b, capsys)[0] == 0
    for config in (a, b):
        code, err = run(config, capsys)
        assert code == 0 and "resuming the job unchanged" in err, err
    for config, budget in ((a, 900), (b, 700)):
        datasets = {"d": (config.parent / "prompts.jsonl", budget)}
        verdict = oracle.judge(config.parent / "out", sim.log, datasets)
        assert verdict.ok and verdict.datasets["d"].kept_tokens == budget, verdict.lines()

    # A copy in the same folder under another name is another job (its own folder).
    copy = a.with_name("job-copy.toml")
    shutil.copy(a, copy)
    copy.write_text(copy.read_text().replace('path = "out"', 'path = "out-copy"'))
    code, err = run(copy, capsys)
    assert code == 0 and "resuming" not in err, err
    assert kept(a.parent / "out-copy") == 900

    # The same file edited into another job is the one case the record still catches.
    a.write_text(a.read_text().replace('path = "out"', 'path = "out-moved"'))
    code, err = run(a, capsys)
    assert code == 2
    assert "for a new job, give it another name: [job] name, or save the config" in err
    assert not (a.parent / "out-moved").exists()

    # Every job on the broker, read from Kafka alone; the kept tokens are the folders'.
    assert cli.main(["jobs", "--bootstrap", kafka_bootstrap, "--json"]) == 0
    listed = {j["config"]: j for j in json.loads(capsys.readouterr().out)["jobs"]}
    ours = {str(p.resolve()): p for p in (a, b, copy)}
    assert set(ours) <= set(listed)
    folders = {a: "out", b: "out", copy: "out-copy"}
    for config_file, config in ours.items():
        job: dict[str, Any] = listed[config_file]
        assert job["kept"] == kept(config.parent / folders[config])
        assert job["state"] == "halted" and [d["name"] for d in job["datasets"]] == ["d"]
        assert job["first_run"] <= job["last_run"]
    assert len({listed[c]["name"] for c in ours}) == 3

    # A job's status by its name alone, without its config.
    name = listed[str(b.resolve())]["name"]
    assert cli.main(["status", name, "--bootstrap", kafka_bootstrap, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["datasets"]["d"]
    assert row["kept"] == 700 and row["budget"] == 700


def test_a_job_that_ran_before_jobs_had_names_is_not_started_again_unasked(
    tmp_path: Path,
    kafka_bootstrap: str,
    sim: Simulator,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    namespace: str,
) -> None:
    """Every config that named no namespace ran in "tokenbudget" before; run again
    now, it would be a new job of its file's name and spend its budgets again."""
    monkeypatch.setattr(identity, "UNNAMED_NAMESPACE", namespace)  # the shared default
    config = unnamed_job(tmp_path / "old", kafka_bootstrap, sim.url, "O", 600)
    text = config.read_text()
    config.write_text(text.replace("[kafka]\n", f'[kafka]\nnamespace = "{namespace}"\n', 1))
    assert run(config, capsys)[0] == 0  # as it ran then, in the shared namespace
    served = len(oracle.read_server_log(sim.log))

    config.write_text(text)  # the config as its user wrote it: no namespace
    code, err = run(config, capsys)
    assert code == 2
    [line] = [line for line in err.splitlines() if "error" in line]
    assert "this config's job ran before jobs had names, in namespace" in line
    assert f'to resume it, set [kafka] namespace = "{namespace}"' in line
    assert len(oracle.read_server_log(sim.log)) == served  # nothing sent

    config.write_text(text.replace("[kafka]\n", f'[kafka]\nnamespace = "{namespace}"\n', 1))
    code, err = run(config, capsys)
    assert code == 0 and "resuming the job unchanged" in err
    assert kept(config.parent / "out") == 600
