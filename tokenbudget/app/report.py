"""The table ``run`` prints at the end; ``--json`` output is built by the report objects."""

from __future__ import annotations

from tokenbudget.app.runner import RunReport
from tokenbudget.app.tables import format_table, percent


def print_table(report: RunReport) -> None:
    rows = []
    for name, r in report.datasets.items():
        rows.append(
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
            ]
        )
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
    ]
    print(format_table(headers, rows))
    done = {name: report.already_done(name) for name in report.datasets}
    if any(done.values()):
        per = ", ".join(f"{name} {n}" for name, n in done.items() if n)
        print(f"\nskipped {sum(done.values())} prompts already done by an earlier run ({per})")
    print(f"\n{report.seconds:.1f} s")
