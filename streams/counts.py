"""The per-dataset counts, declared once: what the ledger counted of a dataset, the
answers kept (``samples``) and their tokens, and the prompts skipped and failed.

The ledger's state and its snapshots carry them on the wire under these names
(:class:`tokenbudget.streams.ledger.DatasetLedger`,
:class:`tokenbudget.streams.events.LedgerSnapshot`); the records built from them
(``run``'s result per dataset, ``status``'s row, the replay's recount) hold a
:class:`DatasetCounts` and the reports print it. The budget arithmetic reads the
same fields through :class:`tokenbudget.streams.budget.Counts`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Self


@dataclass(frozen=True, kw_only=True)
class DatasetCounts:
    samples: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    skipped: int = 0
    failed: int = 0

    @classmethod
    def of(cls, counted: object, **rest: Any) -> Self:
        """The counts of anything that carries them by name (a ledger state or
        snapshot, a result); ``rest``: a subclass's own fields."""
        return cls(**{name: getattr(counted, name) for name in COUNTS}, **rest)

    def outcomes(self) -> dict[str, int]:
        """How its prompts ended: answered and kept, skipped, failed."""
        return {"samples": self.samples, "skipped": self.skipped, "failed": self.failed}


# Their names, in the order the replay's audit compares and prints them.
COUNTS = tuple(f.name for f in fields(DatasetCounts))
