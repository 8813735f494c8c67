"""What the steps of a prompt's path through the dispatcher share: their contract,
the report they count into, and how log lines name a prompt.

The path, composed in one place
(:meth:`tokenbudget.producers.dispatch.dispatcher.Dispatcher.compose`), in
``producers/dispatch/``::

    Dispatcher (consume a prompt, give it a Slot, commit once it has an outcome)
      -> ConversationTurns   what follows a turn of a conversation (turns.py)
      -> Tries               admit, attempt, retry, or record it failed (tries.py)
      -> Route               each attempt to a server of the fleet (route.py)
      -> Attempt             one request: generate, fit, publish (attempt.py)

beside the parts they use: Admission (budget leases), InFlight (requests at the
servers, caps of revoked leases), Publisher (outcomes to Kafka), Fleet (the servers:
their places, health and pace), Places (how many at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tokenbudget.producers.dispatch.slots import Slot
from tokenbudget.streams import events as ev


class Step(Protocol):
    """One step of a prompt's path (arroyo's ``ProcessingStrategy.submit``, for one
    prompt at a time and awaited rather than polled)."""

    async def submit(self, prompt: ev.PromptEvent, slot: Slot | None = None) -> None:
        """Take ``prompt`` to its outcome, the prompt holding ``slot`` (None: no
        place is lent or handed over); which server answers it is the route step's
        choice, made anew for each attempt.

        Returns once the prompt's outcome (a completion, a skip or a failure) is on
        Kafka, or once it is known to have one already. Raises
        :class:`asyncio.CancelledError` when stopped (the prompt then has no outcome
        and its offset stays uncommitted) and
        :class:`~tokenbudget.core.errors.ServerOutageError` when every server of the fleet
        stays away past ``[inference] outage_timeout_s``; what else a step may raise,
        its own contract says."""
        ...


@dataclass(frozen=True)
class Dispatched:
    """A request sent (kept with ``keep_log``, for tests and benchmarks)."""

    dataset: str
    rid: str
    sent_at: float


@dataclass
class DispatchReport:
    """What one dispatcher did, counted by the steps as they publish."""

    completed: int = 0
    skipped: int = 0
    failed: int = 0
    dead_lettered: int = 0
    already_completed: int = 0  # handed over again, already completed: not generated
    sent: list[Dispatched] = field(default_factory=list)


def about(prompt: ev.PromptEvent) -> str:
    """A prompt as log lines name it: its dataset and row, then its id (the hash
    alone says nothing to whoever reads the log)."""
    row = f", {prompt.source}" if prompt.source else ""
    return f"{prompt.dataset}{row} (prompt {prompt.prompt_id})"
