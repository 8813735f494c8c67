"""The table ``run`` prints at the end (the demo prints it too, with columns of its
own); ``--json`` output is built by the report objects."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tokenbudget.app.run_report import RunReport
from tokenbudget.app.tables import format_table, percent

# A column more: its header, and its cell per dataset name.
Column = tuple[str, Mapping[str, object]]


def run_table(report: RunReport, more: Sequence[Column] = ()) -> str:
    """A row per dataset: what it kept of its budget and how it ended, then the
    ``more`` columns."""
    headers = [
        "dataset",
        "budget",
        "completion_tokens",
        "overshoot",
        "samples",
        "cut by budget",
        "skipped",
        "failed",
        "bad rows",
        "status",
        *(header for header, _ in more),
    ]
    rows = [
        [
            name,
            f"{r.budget:,}",
            f"{r.completion_tokens:,}",
            percent(r.overshoot, r.budget),
            r.samples,
            r.cut,
            r.skipped,
            r.failed,
            report.bad_rows(name),
            r.status,
            *(cells[name] for _, cells in more),
        ]
        for name, r in report.datasets.items()
    ]
    return format_table(headers, rows)


def print_table(report: RunReport) -> None:
    print(run_table(report))
    done = {name: report.already_done(name) for name in report.datasets}
    if any(done.values()):
        per = ", ".join(f"{name} {n}" for name, n in done.items() if n)
        print(f"\nskipped {sum(done.values())} prompts already done by an earlier run ({per})")
    print(f"\n{report.seconds:.1f} s")
