"""Which server of the fleet a request goes to, and how many each may have at once:
the policy, as pure functions (:mod:`tokenbudget.producers.inference.fleet` applies them).

* :func:`pick`: among the servers that may take a request now (up, under their
  window, past any ``Retry-After``), a conversation's turn goes back to the server
  that answered its previous turn (its prefix may still be cached there); any other
  request goes to the server with the least outstanding work for its speed: the
  tokens reserved for its requests in flight and not answered yet, this one's
  included, over its weight times the decode speed its answers showed (the fleet's
  median until it has answered). Ties are broken at random. A server that failed
  this prompt before is taken only when no other can take it.
* :class:`Window`: each server's concurrency, additive increase and multiplicative
  decrease between a floor and its configured ceiling (TCP's congestion window, in
  requests): one more per window of answers while it is kept full, halved when it
  answers 429 or 503 or its answers slow down (:class:`Pace`), at most once per
  :data:`CUT_HOLD_S` so that one burst of refusals counts once.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

# The window is halved (at most) once per this many seconds: the requests in flight
# when a server starts refusing all come back refused, and that is one signal.
CUT_HOLD_S = 2.0
# A cut keeps this share of the window.
CUT_TO = 0.5
# Answers slower than this share of a server's usual decode speed say it is
# overloaded (a queue builds in front of its batch).
SLOW_SHARE = 0.5
# Answers a server must have given before its slowness is judged.
PACE_SAMPLES = 20
# Weights of the newest answer in the recent and the usual speed.
RECENT_ALPHA = 0.2
USUAL_ALPHA = 0.02


@dataclass(frozen=True)
class Candidate:
    """One server as routing sees it when a request is to be sent."""

    url: str
    weight: float  # its configured share against the others
    speed: float  # its answers' decode speed (tokens/s per request); 0: none seen yet
    in_flight: int
    limit: int  # its window now
    outstanding: int  # tokens reserved for its requests in flight, not answered yet
    ready: bool = True  # up, not draining, past any Retry-After

    @property
    def has_room(self) -> bool:
        return self.ready and self.in_flight < self.limit


def pick(
    candidates: Sequence[Candidate],
    tokens: int,
    rng: random.Random,
    *,
    prefer: str | None = None,
    avoid: Collection[str] = (),
) -> str | None:
    """The URL of the server a request reserving ``tokens`` goes to, None when no
    server can take it now. ``prefer``: the server that answered the conversation's
    previous turn; ``avoid``: servers that failed this prompt already."""
    open_ = [c for c in candidates if c.has_room]
    fresh = [c for c in open_ if c.url not in avoid]
    pool = fresh or open_
    if not pool:
        return None
    if prefer is not None and any(c.url == prefer for c in pool):
        return prefer
    seen = [c.speed for c in candidates if c.speed > 0]
    usual = statistics.median(seen) if seen else 1.0

    def work(c: Candidate) -> float:
        return (c.outstanding + tokens) / (c.weight * (c.speed or usual))

    least = min(work(c) for c in pool)
    tied = [c.url for c in pool if math.isclose(work(c), least, rel_tol=1e-9)]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def round_robin(candidates: Sequence[Candidate], turn: int) -> str | None:
    """The peers' way, for comparison (bench/fleet.py): the servers in turn, each
    taking its share whatever its speed; None when the one whose turn it is has no
    room (the request waits for it)."""
    if not candidates:
        return None
    chosen = candidates[turn % len(candidates)]
    return chosen.url if chosen.has_room else None


@dataclass(frozen=True)
class Window:
    """A server's concurrency: ``limit`` requests at once (a float, so that it grows
    by a fraction per answer), between ``floor`` and ``ceiling``."""

    ceiling: int
    limit: float
    floor: int = 1
    cut_at: float = -math.inf  # when it was last cut (monotonic seconds)

    @classmethod
    def full(cls, ceiling: int) -> Window:
        """A server's window as it starts: trusted with its configured concurrency."""
        return cls(ceiling, float(ceiling))

    @functools.cached_property
    def size(self) -> int:
        """Requests the server may have at once now (worked out once per window: it
        is asked of every server for every request routed)."""
        return max(self.floor, min(self.ceiling, int(self.limit)))

    def grown(self, in_flight: int) -> Window:
        """After an answer: one more request per window of answers, while the server
        was kept full (an idle window says nothing about what it can take)."""
        if self.limit >= self.ceiling or in_flight + 1 < self.size:
            return self
        return replace(self, limit=min(float(self.ceiling), self.limit + 1.0 / self.limit))

    def cut(self, now: float) -> Window:
        """After a refusal (429, 503) or slow answers: halved, down to the floor, at
        most once per :data:`CUT_HOLD_S`."""
        if now - self.cut_at < CUT_HOLD_S:
            return self
        return replace(self, limit=max(float(self.floor), self.limit * CUT_TO), cut_at=now)

    def resized(self, ceiling: int) -> Window:
        """The same window under a new ceiling (the server added again with another
        concurrency)."""
        return replace(self, ceiling=ceiling, limit=min(float(ceiling), self.limit))


@dataclass(frozen=True)
class Pace:
    """How fast a server's answers decode: recently and usually (moving averages of
    tokens/s per request), and how many answers it has given."""

    recent: float = 0.0
    usual: float = 0.0
    samples: int = 0

    def observed(self, tokens: int, seconds: float) -> Pace:
        """With one more answer of ``tokens`` tokens that took ``seconds``."""
        if tokens <= 0 or seconds <= 0:
            return self
        speed = tokens / seconds
        if not self.samples:
            return Pace(speed, speed, 1)
        return Pace(
            self.recent + RECENT_ALPHA * (speed - self.recent),
            self.usual + USUAL_ALPHA * (speed - self.usual),
            self.samples + 1,
        )

    @property
    def slow(self) -> bool:
        """Its recent answers decode at less than :data:`SLOW_SHARE` of its usual
        speed (judged after :data:`PACE_SAMPLES` answers)."""
        return self.samples >= PACE_SAMPLES and self.recent < SLOW_SHARE * self.usual
