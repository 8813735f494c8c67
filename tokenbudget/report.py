"""Plain-text tables for people; ``--json`` output is built by the report objects."""

from __future__ import annotations

from collections.abc import Sequence

from tokenbudget.runner import RunReport


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for n, row in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def percent(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:+.1f}%" if whole else "n/a"


def print_table(report: RunReport) -> None:
    rows = []
    for name, r in report.datasets.items():
        used = r.completion_tokens if r.unit == "completion_tokens" else r.overshoot + r.budget
        rows.append(
            [
                name,
                f"{r.budget:,}",
                f"{r.completion_tokens:,}",
                percent(max(0, used - r.budget), r.budget),
                r.samples,
                r.skipped,
                r.failed,
                r.status,
            ]
        )
    headers = [
        "dataset",
        "budget",
        "completion_tokens",
        "overshoot",
        "samples",
        "skipped",
        "failed",
        "status",
    ]
    print(format_table(headers, rows))
    done = {name: report.already_done(name) for name in report.datasets}
    if any(done.values()):
        per = ", ".join(f"{name} {n}" for name, n in done.items() if n)
        print(f"\nskipped {sum(done.values())} prompts already done by an earlier run ({per})")
    print(f"\n{report.seconds:.1f} s")
