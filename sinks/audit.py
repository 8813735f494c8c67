"""What a replay found, and what it checks: the summary of a replay, its totals per
dataset, the ledger's totals recomputed from the topics and compared with the live
ledger's (``--ledger``), and the tokens recounted with a tokenizer
(``--recount-with``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenbudget.sinks.reading import read_to_end
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard
from tokenbudget.streams.counts import COUNTS, DatasetCounts
from tokenbudget.streams.ledger import Outcome, outcome_change
from tokenbudget.streams.topics import Topics

# ---------------------------------------------------------------------------- results


@dataclass(frozen=True, kw_only=True)
class Totals(DatasetCounts):
    """A dataset's counts as the replay recomputes them, with what only it counts."""

    output_ids: int = 0
    recounted_tokens: int = 0
    recounted_rows: int = 0
    rows_without_text: int = 0

    def plus(self, **more: int) -> Totals:
        """These totals with ``more`` of some of them."""
        return replace(self, **{name: getattr(self, name) + n for name, n in more.items()})


@dataclass
class ReplaySummary:
    topic: str
    partitions: dict[int, tuple[int, int]] = field(default_factory=dict)  # start, end
    events: int = 0  # read from the topic (after the time/offset range)
    bytes: int = 0
    filtered: int = 0  # other datasets (--dataset) or outside --since/--until
    kept: int = 0
    duplicates: int = 0
    already_in_parquet: int = 0
    undecodable: int = 0
    seconds: float = 0.0
    datasets: dict[str, Totals] = field(default_factory=dict)
    parquet: dict[str, Any] | None = None
    to_topic: dict[str, Any] | None = None
    ledger: dict[str, Any] | None = None
    recount: dict[str, Any] | None = None
    # busy seconds per stage: read (Kafka), decode (JSON), build (rule + columns),
    # write (Parquet files, fsync included); stages overlap in three threads
    stages: dict[str, float] = field(
        default_factory=lambda: {"read": 0.0, "decode": 0.0, "build": 0.0, "write": 0.0}
    )

    @property
    def ok(self) -> bool:
        return self.ledger is None or bool(self.ledger["match"])

    def to_json(self) -> dict[str, Any]:
        seconds = max(self.seconds, 1e-9)
        return {
            "topic": self.topic,
            "partitions": {str(p): list(r) for p, r in sorted(self.partitions.items())},
            "events": self.events,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 3),
            "events_per_s": round(self.events / seconds, 1),
            "mb_per_s": round(self.bytes / seconds / 1e6, 2),
            "kept": self.kept,
            "duplicates": self.duplicates,
            "already_in_parquet": self.already_in_parquet,
            "undecodable": self.undecodable,
            "filtered": self.filtered,
            "datasets": {
                name: {
                    "samples": t.samples,
                    "completion_tokens": t.completion_tokens,
                    "prompt_tokens": t.prompt_tokens,
                    "output_ids": t.output_ids,
                }
                for name, t in sorted(self.datasets.items())
            },
            "parquet": self.parquet,
            "to_topic": self.to_topic,
            "ledger": self.ledger,
            "recount": self.recount,
            "stage_seconds": {k: round(v, 3) for k, v in self.stages.items()},
            "ok": self.ok,
        }


# ----------------------------------------------------------------------------- ledger


def live_snapshots(bootstrap: str, topics: Topics) -> dict[str, ev.LedgerSnapshot]:
    """The latest ledger snapshot of every dataset on the budgets topic."""
    board = BudgetBoard()
    read_to_end(bootstrap, topics.budgets, board.apply)
    return {name: view.snapshot for name, view in board.views.items() if view.snapshot is not None}


def outcome_counts(
    bootstrap: str,
    topics: Topics,
    completed: set[str],
    datasets: frozenset[str],
    rejected: dict[str, str] | None = None,
) -> dict[str, tuple[int, int]]:
    """(skipped, failed) per dataset with the ledger's rule: a prompt's first skip
    or failure counts unless the prompt has a completion. An answer no one kept
    because its lease was fenced (``rejected``: prompt -> dataset) counts as a skip
    of a prompt with no other outcome."""
    first: dict[str, tuple[str, Outcome]] = {}  # prompt_id -> (dataset, outcome)

    def record(prompt_id: str, dataset: str, outcome: Outcome) -> None:
        previous = first.get(prompt_id)
        if outcome_change(None if previous is None else previous[1], outcome):
            first[prompt_id] = (dataset, outcome)

    def apply(event: ev.Event) -> None:
        if isinstance(event, ev.PromptSkipped | ev.PromptFailed):
            if datasets and event.dataset not in datasets:
                return
            kind: Outcome = "skipped" if isinstance(event, ev.PromptSkipped) else "failed"
            record(event.prompt_id, event.dataset, kind)

    read_to_end(bootstrap, topics.outcomes, apply)
    for prompt_id, dataset in (rejected or {}).items():
        if not datasets or dataset in datasets:
            record(prompt_id, dataset, "skipped")
    counts: dict[str, list[int]] = {}
    for prompt_id, (dataset, kind) in first.items():
        if prompt_id in completed:
            continue  # a completion replaces a skip or a failure (outcome_change)
        entry = counts.setdefault(dataset, [0, 0])
        entry[0 if kind == "skipped" else 1] += 1
    return {name: (c[0], c[1]) for name, c in counts.items()}


def compare_ledger(
    replayed: dict[str, Totals],
    snapshots: dict[str, ev.LedgerSnapshot],
    datasets: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Field-by-field differences between replayed totals and live snapshots."""
    names = set(replayed) | set(snapshots)
    if datasets:
        names &= datasets
    differences = []
    for name in sorted(names):
        mine = replayed.get(name, Totals())
        snap = snapshots.get(name)
        if snap is None:
            differences.append({"dataset": name, "field": "snapshot", "replay": None, "live": None})
            continue
        for key in COUNTS:
            a, b = getattr(mine, key), getattr(snap, key)
            if a != b:
                differences.append({"dataset": name, "field": key, "replay": a, "live": b})
    return {
        "match": not differences,
        "datasets": sorted(names),
        "differences": differences,
        "live": {
            name: asdict(DatasetCounts.of(snap)) | {"at": snap.at}
            for name, snap in sorted(snapshots.items())
            if name in names
        },
    }


def recount_report(tokenizer_path: Path | None, datasets: dict[str, Totals]) -> dict[str, Any]:
    """``--recount-with``: per dataset, the stored and recounted tokens and their
    ratio (None for a dataset with no stored tokens)."""
    return {
        "tokenizer": str(tokenizer_path),
        "datasets": {
            name: {
                "stored_completion_tokens": t.completion_tokens,
                "recounted_tokens": t.recounted_tokens,
                "ratio": (
                    round(t.recounted_tokens / t.completion_tokens, 4)
                    if t.completion_tokens
                    else None
                ),
                "rows_without_text": t.rows_without_text,
            }
            for name, t in sorted(datasets.items())
        },
    }
