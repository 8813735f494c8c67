"""Plain-text tables for people, and text read from Kafka as it may be printed."""

from __future__ import annotations

from collections.abc import Sequence


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


def printable(text: str) -> str:
    """``text`` read from Kafka (a dataset's name, a server's URL) as a terminal may be
    shown it: every character that is not printable (an escape code, a newline, a
    direction override) written as Python's ``repr`` writes it (``\\x1b``), so no
    event can move the cursor, clear the screen or fake a line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
