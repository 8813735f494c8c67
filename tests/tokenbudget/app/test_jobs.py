"""A job's state and its row, as ``tokenbudget jobs`` shows them."""

from __future__ import annotations

import pytest

from tokenbudget.app.jobs import DatasetKept, Job, state_of, table, to_json


def kept(status: str, name: str = "d") -> DatasetKept:
    return DatasetKept(
        name=name,
        budget=100,
        kept=100 if status == "halted" else 40,
        unit="completion_tokens",
        status=status,
    )


@pytest.mark.parametrize(
    ("statuses", "running", "state"),
    [
        (["halted", "open"], True, "running"),
        (["halted", "halted"], False, "halted"),
        (["halted", "exhausted"], False, "finished"),
        (["halted", "open"], False, "interrupted"),
        (["-"], False, "interrupted"),  # recorded, never counted: a rerun starts it
        ([], False, "interrupted"),
    ],
)
def test_a_jobs_state(statuses: list[str], running: bool, state: str) -> None:
    assert state_of([kept(s, f"d{i}") for i, s in enumerate(statuses)], running) == state


def test_a_jobs_row_and_json_add_up_its_datasets_and_show_names_escaped() -> None:
    job = Job(
        name="job-3f9a1c2e",
        datasets=[kept("halted", "a"), kept("open", "b\x1b[2J")],
        state="interrupted",
        first_run=1_700_000_000.0,
        last_run=1_700_000_600.0,
        config="/data/jobs/job.toml",
    )
    shown = table([job])
    assert "\x1b" not in shown and "b\\x1b[2J" in shown
    assert "140" in shown and "200" in shown and "/data/jobs/job.toml" in shown
    [out] = to_json([job])["jobs"]
    assert (out["kept"], out["budget"], out["state"]) == (140, 200, "interrupted")
    assert [d["name"] for d in out["datasets"]] == ["a", "b\x1b[2J"]
