"""The run's report: bad rows (rows that are not prompts) and answers the budget cut,
in the table and --json."""

from __future__ import annotations

import pytest

from tokenbudget.app.report import print_table, run_table
from tokenbudget.app.run_report import DatasetResult, RunReport
from tokenbudget.dev.demo import comparison_columns
from tokenbudget.producers.prompts.producer import ProduceReport


def report() -> RunReport:
    result = DatasetResult(
        budget=1000,
        completion_tokens=900,
        prompt_tokens=50,
        samples=9,
        skipped=0,
        failed=0,
        status="exhausted",
        unit="completion_tokens",
        cut=1,
    )
    return RunReport(
        datasets={"a": result, "b": result},
        produced={"a": ProduceReport("a", produced=9, bad_rows=2), "b": ProduceReport("b")},
    )


def test_bad_rows_are_in_the_json_per_dataset_and_in_all() -> None:
    data = report().to_json()
    datasets = data["datasets"]
    assert isinstance(datasets, dict)
    assert datasets["a"]["bad_rows"] == 2
    assert datasets["b"]["bad_rows"] == 0
    assert data["bad_rows"] == 2


def test_bad_rows_are_a_column_of_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    print_table(report())
    header, _, row_a, row_b = capsys.readouterr().out.splitlines()[:4]
    columns = header.split("  ")
    assert "bad rows" in [c.strip() for c in columns if c.strip()]
    at = header.index("bad rows") + len("bad rows")
    assert row_a[:at].rstrip().endswith("2")
    assert row_b[:at].rstrip().endswith("0")


def test_answers_cut_by_the_budget_are_in_the_json_and_a_column_of_the_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    datasets = report().to_json()["datasets"]
    assert isinstance(datasets, dict)
    assert datasets["a"]["cut"] == 1
    print_table(report())
    header, _, row_a = capsys.readouterr().out.splitlines()[:3]
    at = header.index("cut by budget") + len("cut by budget")
    assert row_a[:at].rstrip().endswith("1")


def test_more_columns_follow_the_run_tables_own_per_dataset() -> None:
    table = run_table(report(), [("avg_answer", {"a": "100", "b": "90"})])
    header, _, row_a, row_b = table.splitlines()
    assert header.split()[-2:] == ["status", "avg_answer"]
    assert row_a.split()[-2:] == ["exhausted", "100"]
    assert row_b.split()[-2:] == ["exhausted", "90"]


def test_the_demo_prints_the_run_table_with_what_a_sample_cap_would_keep() -> None:
    cap, columns = comparison_columns(report())
    assert cap == 10  # a budget of 1,000 over answers of 100 tokens on average
    header = run_table(report(), columns).splitlines()[0]
    assert header.split()[:3] == ["dataset", "budget", "completion_tokens"]
    assert header.split()[-3:] == ["avg_answer", "cap_10_tokens", "cap_overshoot"]
    assert dict(columns)["cap_10_tokens"] == {"a": "1,000", "b": "1,000"}
