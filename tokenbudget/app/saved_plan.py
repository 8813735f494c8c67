"""The plan ``run`` and ``plan`` save beside the output, and ``status`` reads: what
each dataset's budget was said to need, next to what it kept."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenbudget.core.config import Config
from tokenbudget.core.files import write_atomic

PLAN_FILE = ".tokenbudget-plan.json"


def save(config: Config, plan: dict[str, Any]) -> Path | None:
    """Write ``plan`` (:meth:`tokenbudget.app.plan.Plan.to_json`) under the sink
    path; None when it cannot be written (the plan was printed all the same)."""
    path = config.sink_path / PLAN_FILE
    try:
        write_atomic(path, json.dumps(plan, indent=1))
    except OSError:
        return None
    return path


def needed_text(needed: int | None, low: int | None, high: int | None) -> str:
    """Prompts needed, with the 10-90% range when there is one."""
    if needed is None:
        return "unknown"
    if low is None or high is None or low == high == needed:
        return f"{needed:,}"
    return f"{needed:,} ({low:,}-{high:,})"


def planned(config: Config) -> dict[str, str]:
    """Per dataset, the prompts the saved plan said its budget needs; {} when no
    plan was saved."""
    try:
        saved = json.loads((config.sink_path / PLAN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    datasets = saved.get("datasets") if isinstance(saved, dict) else None
    return {
        name: needed_text(p.get("needed"), p.get("needed_low"), p.get("needed_high"))
        for name, p in (datasets or {}).items()
        if isinstance(p, dict)
    }
