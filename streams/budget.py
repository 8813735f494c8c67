"""The budget policy, in one place: pure arithmetic and small tables, no I/O.

The ledger (:mod:`tokenbudget.streams.ledger`), the admission and the dispatcher
(:mod:`producers`), ``tokenbudget status``, the run report and the metrics call
these, so what a budget means is written once. The choices are named in the
config (:data:`tokenbudget.core.sections.Unit`, :data:`~tokenbudget.core.sections.BoundaryPolicy`,
:data:`~tokenbudget.core.sections.CutPolicy`, :data:`~tokenbudget.core.sections.AdmissionMode`);
what each does is a row of a table here. Adding a unit, a policy or a mode means a
row here and a name there.

Units (``[budget] unit``), :data:`UNITS`:

    completion_tokens  tokens generated; an answer can be cut at a token to fit
    total_tokens       prompt + completion tokens; a request reserves an upper
                       bound on its prompt's tokens too
    samples            completions, one each whatever their length

Boundary policies (``[budget] on_boundary``), :data:`BOUNDARY_POLICIES`: the
smallest request still worth sending when the budget's last part cannot cover a
whole one (the *floor*):

    truncate  the last tokens go out as a request with a lower max_new_tokens,
              down to ``min_new_tokens``
    finish    a request goes out whole or not at all

Cut policies (``[budget] cut``), :data:`CUT_POLICIES`: what a request does once
the ledger has no more to give and its lease holds less than the whole request
but at least its floor (:meth:`Ask.step`):

    last  wait for the leftovers of the requests in flight, unless what the lease
          holds likely covers an answer of the dataset (:class:`AnswerLengths`) or
          nothing is in flight: only the answer that straddles the line is cut
    any   go out at once with what the lease holds, however many answers that
          cuts while the requests in flight hand most of their room back

Reservations (``[budget] reserve``), :meth:`Ask.growing` and :meth:`Ask.step`:

    whole  a request reserves its whole max_new_tokens: a dataset with R left has
           at most R / max_new_tokens requests in flight
    grow   a request is sent with its whole max_new_tokens but reserves less
           (:meth:`Ask.growing`: what its dataset's answers take on average under
           ``cut = "last"``, the floor under ``any``), and its reservation grows
           from the lease as its answer comes (:func:`growth`). Once the ledger has
           no more to give, what is left grows the answers in flight first (as the
           cut policy says), and an answer that outgrows it is cut at the line

Admission modes (``[budget] admission``), :data:`ADMISSION_MODES`:

    reserve   every request reserves its cost before it is sent: nothing is kept
              beyond the budget
    halt      a dataset stops once a completion shows its budget reached: what is
              in flight then is kept beyond it (the overshoot allowance)
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from tokenbudget.core.sections import AdmissionMode, BoundaryPolicy, CutPolicy, Unit


class Counts(Protocol):
    """What the ledger has kept of a dataset (a ledger state, a snapshot, a result)."""

    @property
    def unit(self) -> Unit: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def samples(self) -> int: ...


@dataclass(frozen=True)
class UnitRule:
    """What a budget unit counts and how requests reserve it."""

    cost: Callable[[int, int], int]  # (prompt tokens, completion tokens) -> one answer's cost
    used: Callable[[Counts], int]  # what the kept answers cost together
    # A request reserves its tokens (max_new_tokens, plus the prompt's estimate when
    # ``prompt_reserved``), so a smaller reservation means a lower max_new_tokens;
    # otherwise it reserves 1 whatever its length.
    in_tokens: bool
    prompt_reserved: bool
    # An answer can be cut at a token to fit what is left (given its token ids).
    cuttable: bool


UNITS: Mapping[Unit, UnitRule] = {
    "completion_tokens": UnitRule(
        cost=lambda prompt, completion: completion,
        used=lambda counts: counts.completion_tokens,
        in_tokens=True,
        prompt_reserved=False,
        cuttable=True,
    ),
    "total_tokens": UnitRule(
        cost=lambda prompt, completion: prompt + completion,
        used=lambda counts: counts.completion_tokens + counts.prompt_tokens,
        in_tokens=True,
        prompt_reserved=True,
        cuttable=False,
    ),
    "samples": UnitRule(
        cost=lambda prompt, completion: 1,
        used=lambda counts: counts.samples,
        in_tokens=False,
        prompt_reserved=False,
        cuttable=False,
    ),
}


def unit_rule(unit: Unit) -> UnitRule:
    """The rule of ``unit``; ValueError for a name that is no unit."""
    try:
        return UNITS[unit]
    except KeyError:
        raise ValueError(f"unknown budget unit {unit!r}") from None


def unit_cost(unit: Unit, prompt_tokens: int, completion_tokens: int) -> int:
    """What one completion consumes of a budget in ``unit``."""
    return unit_rule(unit).cost(prompt_tokens, completion_tokens)


def used(counts: Counts, unit: Unit | None = None) -> int:
    """How much of the budget the kept answers used, in ``unit`` (default: their own)."""
    return unit_rule(unit or counts.unit).used(counts)


def unused(budget: int, spent: int) -> int:
    """What is left of ``budget`` once ``spent`` is kept (never below 0)."""
    return max(0, budget - spent)


def answers_left(budget: int | None, counts: Counts) -> int | None:
    """How many more answers the rest of ``budget`` buys at the mean cost of those
    kept so far (rounded up); None without a budget or before anything is kept."""
    if budget is None or counts.samples <= 0:
        return None
    spent = used(counts)
    if spent <= 0:
        return None
    return math.ceil(unused(budget, spent) * counts.samples / spent)


def overshoot(budget: int, spent: int) -> int:
    """What was kept beyond ``budget`` (0 within it)."""
    return max(0, spent - budget)


def full(budget: int, spent: int, floor: int) -> bool:
    """Whether what is left of the budget is below the smallest useful request."""
    return budget - spent < floor


def cuttable(unit: Unit, has_token_ids: bool) -> bool:
    """Whether an answer can be cut at a token to fit: only in a unit that allows it,
    and only with its token ids (text alone cannot be cut exactly)."""
    return unit_rule(unit).cuttable and has_token_ids


def fit(cost: int, left: int, can_cut: bool) -> int | None:
    """How much of an answer costing ``cost`` is kept when ``left`` may still be:
    all of it if it fits, else what is left when it can be cut (``can_cut``) and
    something is, else None (nothing of it)."""
    if cost <= left:
        return cost
    if not can_cut or left <= 0:
        return None
    return left


# -- boundary policies: the floor of a request -------------------------------------------


def _truncate_floor(want: int, overhead: int, min_new_tokens: int) -> int:
    """Cut at the line: the prompt and the fewest new tokens still worth asking for."""
    return overhead + min_new_tokens


def _finish_floor(want: int, overhead: int, min_new_tokens: int) -> int:
    """Whole or nothing: the request as it was asked for."""
    return want


#: policy -> floor(want, overhead, min_new_tokens), in the budget's unit
BOUNDARY_POLICIES: Mapping[BoundaryPolicy, Callable[[int, int, int], int]] = {
    "truncate": _truncate_floor,
    "finish": _finish_floor,
}


@dataclass(frozen=True)
class Step:
    """What admission does next for one request (:meth:`Ask.step`): ``reserve``
    ``amount`` from the lease, ``ask`` the ledger for more, or ``wait`` for the
    leftovers of the requests in flight. ``grows``: the reservation is less than the
    request's limit and grows as its answer comes (``[budget] reserve = "grow"``)."""

    action: Literal["reserve", "ask", "wait"]
    amount: int = 0
    grows: bool = False


ASK = Step("ask")
WAIT = Step("wait")


@dataclass(frozen=True)
class Ask:
    """What one request asks of a lease, in the budget's unit (see :func:`ask`)."""

    unit: Unit
    want: int  # what it reserves when it goes out whole
    floor: int  # the least worth sending: below it the request does not go out
    overhead: int  # what of ``want`` is not new tokens (the prompt's estimate)
    max_new_tokens: int  # the request's own limit
    grows: bool = False  # ``want`` is a typical answer's, grown as the answer comes
    spread: int = 0  # with ``grows``: the standard deviation of the dataset's answers

    def growing(self, typical: int | None, cut: CutPolicy, spread: int | None = None) -> Ask:
        """The request under ``[budget] reserve = "grow"``: it reserves little and
        grows from there as its answer comes. Under ``cut = "last"`` it reserves
        ``typical`` new tokens (what the dataset's answers take on average,
        :meth:`AnswerLengths.typical`; unchanged while that is unknown), so that few
        answers outgrow a budget's end; under ``any`` only the floor (the fewest new
        tokens worth asking for), so that the fleet stays full until the budget is
        spent and what is in flight then is cut. Unchanged when that is no less than
        the limit, or in a unit that does not count tokens. ``spread``: how far the
        dataset's answers stray from ``typical`` (their standard deviation), which
        :meth:`step` keeps room for at a budget's end."""
        start = self.floor - self.overhead if cut == "any" else typical
        if start is None or not unit_rule(self.unit).in_tokens:
            return self
        if start >= self.max_new_tokens:
            return self
        want = self.overhead + max(1, start)
        floor = min(self.floor, want)
        return Ask(self.unit, want, floor, self.overhead, self.max_new_tokens, True, spread or 0)

    def clamp(self, balance: int, ledger_short: bool) -> int | None:
        """What to reserve from a lease holding ``balance``: the whole request when
        it covers it; once the ledger has no more to give (``ledger_short``), the
        balance itself if it reaches the floor; else None (ask the ledger first)."""
        if balance >= self.want:
            return self.want
        if ledger_short and balance >= self.floor:
            return balance
        return None

    def enough(self, long_answer: int | None) -> int:
        """What likely covers the answer: its prompt's estimate and ``long_answer``
        (tokens a next answer of the dataset exceeds rarely, :meth:`AnswerLengths.high`),
        or the whole request while that is unknown."""
        if long_answer is None or not unit_rule(self.unit).in_tokens:
            return self.want
        return self.overhead + min(self.max_new_tokens, long_answer)

    def step(
        self,
        balance: int,
        *,
        ledger_short: bool,
        in_flight: int,
        long_answer: int | None,
        cut: CutPolicy,
        held: int = 0,
        more: int | None = None,
    ) -> Step:
        """What to do with a lease holding ``balance`` while ``in_flight`` requests
        of it are out (holding ``held`` between them): :meth:`clamp`, and when that
        would send less than the whole request, the cut policy's choice
        (:data:`CUT_POLICIES`). ``more``: what the ledger said it still had beyond
        the lease (None: not said), which a growing request counts on."""
        if self.grows:
            return self._grow_step(balance, ledger_short, in_flight, held, cut, more)
        reserved = self.clamp(balance, ledger_short)
        if reserved is None:
            return ASK
        if reserved == self.want:
            return Step("reserve", reserved)
        return CUT_POLICIES[cut](reserved, in_flight, self.enough(long_answer))

    def _grow_step(
        self,
        balance: int,
        ledger_short: bool,
        in_flight: int,
        held: int,
        cut: CutPolicy,
        more: int | None,
    ) -> Step:
        """:meth:`step` of a growing request: a typical answer's worth goes out and
        grows. Under ``cut = "any"`` it goes out at once, clamped to what is left once
        the ledger has no more and that is less. Under ``cut = "last"`` it goes out
        growing only while what the budget still has for this holder (``balance``,
        ``held`` by the requests in flight, and ``more`` at the ledger, none once it
        has run short) covers it and them at a typical answer each, with three
        standard deviations of their sum to spare (:func:`room_for`), so that answers
        outgrow the end rarely: a grant's ``more`` lets the gate close before the
        ledger first runs short, when the requests already in flight would otherwise
        need more than is left. Else it waits for their leftovers; with none in
        flight (nothing comes back) it asks the ledger for the rest, and once that
        is all there is, goes out with it as its max_new_tokens (the one cut)."""
        if cut == "any" or (more is None and not ledger_short):
            if balance >= self.want:
                return Step("reserve", self.want, grows=True)
            return ASK if not ledger_short or balance < self.floor else Step("reserve", balance)
        typical = self.want - self.overhead
        left = balance + held + (0 if ledger_short or more is None else max(0, more))
        if balance >= self.want and left >= room_for(in_flight + 1, typical, self.spread):
            return Step("reserve", self.want, grows=True)
        if not ledger_short:
            return ASK if balance < self.want or in_flight == 0 else WAIT
        if balance < self.floor:
            return ASK
        return Step("reserve", balance) if in_flight == 0 else WAIT

    def max_new_tokens_for(self, reserved: int, grows: bool = False) -> int:
        """The max_new_tokens to send for ``reserved`` (from :meth:`step`): what was
        reserved, so the server cannot generate more; the request's own limit when the
        reservation grows (``grows``), the budget then being kept by the growth."""
        if grows or not unit_rule(self.unit).in_tokens:
            return self.max_new_tokens
        return reserved - self.overhead

    def lease_request(self, lease_size: int) -> int:
        """What to ask the ledger for on the lease: a lease's worth, or more if this
        one request needs it."""
        return max(lease_size, self.want)


def room_for(answers: int, typical: int, spread: int) -> int:
    """What ``answers`` answers of a dataset likely need together, at most: a typical
    one's length each and three standard deviations of their sum (``spread`` is one
    answer's): their lengths add up to more about once in a thousand, for answers
    drawn alike and many of them."""
    return answers * typical + math.ceil(3 * math.sqrt(answers) * spread)


def growth(allowance: int, need: int, reserved: int, ceiling: int, balance: int) -> int:
    """What a growing reservation takes from its lease's ``balance`` when its answer
    needs ``need`` and it holds ``allowance`` (first ``reserved``, at most
    ``ceiling``, the request's limit): nothing while it covers the need, else the
    need and as much again as it first reserved, so that a long answer grows in a
    few steps, not one per chunk; at most what the balance holds."""
    if need <= allowance:
        return 0
    return max(0, min(balance, ceiling - allowance, need - allowance + reserved))


def ask(
    unit: Unit,
    policy: BoundaryPolicy,
    max_new_tokens: int,
    prompt_estimate: int = 0,
    min_new_tokens: int = 1,
) -> Ask:
    """What a request of ``max_new_tokens`` (its prompt at most ``prompt_estimate``
    tokens) reserves, and its floor under ``policy``. A request in a unit that is
    not tokens reserves 1, whole or nothing."""
    rule = unit_rule(unit)
    if not rule.in_tokens:
        return Ask(unit, want=1, floor=1, overhead=0, max_new_tokens=max_new_tokens)
    overhead = prompt_estimate if rule.prompt_reserved else 0
    want = overhead + max_new_tokens
    floor = BOUNDARY_POLICIES[policy](want, overhead, min_new_tokens)
    return Ask(unit, want=want, floor=floor, overhead=overhead, max_new_tokens=max_new_tokens)


# -- cut policies: which answers the line may cut -----------------------------------------


def _cut_last(balance: int, in_flight: int, enough: int) -> Step:
    """Only the answer that straddles the line is cut. Leftovers of requests in flight
    come back to this lease, so a request sent short now would be cut, and another
    after it with the leftovers: wait for them instead, unless the balance likely
    covers the answer anyway. With nothing in flight nothing comes back (the ledger
    was asked since the last request settled): the balance goes out, the one cut."""
    if balance >= enough or in_flight == 0:
        return Step("reserve", balance)
    return WAIT


def _cut_any(balance: int, in_flight: int, enough: int) -> Step:
    """The balance goes out at once, whatever it cuts."""
    return Step("reserve", balance)


#: policy -> step(balance, requests in flight, what likely covers the answer)
CUT_POLICIES: Mapping[CutPolicy, Callable[[int, int, int], Step]] = {
    "last": _cut_last,
    "any": _cut_any,
}


class AnswerLengths:
    """How long one dataset's answers get: a running high quantile of the lengths
    of answers seen (those the budget did not cut), the last ``window`` of them.

    :meth:`high` is the length a next answer exceeds with probability at most
    1 / ``one_in``, for answers drawn alike, whatever their distribution: of ``n``
    lengths sorted, a next one exceeds the ``j``-th largest with probability
    ``j / (n + 1)``, so ``j = (n + 1) // one_in``. Below ``one_in - 1`` answers no
    length seen is high enough, and it is None.
    """

    def __init__(self, one_in: int = 100, window: int = 1000) -> None:
        self.one_in = one_in
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: list[int] = []
        self._sum = 0  # of the recent lengths
        self._squares = 0  # of their squares

    def observe(self, tokens: int) -> None:
        if len(self._recent) == self._recent.maxlen:
            del self._sorted[bisect.bisect_left(self._sorted, self._recent[0])]
            self._sum -= self._recent[0]
            self._squares -= self._recent[0] ** 2
        self._recent.append(tokens)
        self._sum += tokens
        self._squares += tokens**2
        bisect.insort(self._sorted, tokens)

    def high(self) -> int | None:
        n = len(self._sorted)
        j = (n + 1) // self.one_in
        return self._sorted[n - j] if j else None

    def typical(self, least: int = 10) -> int | None:
        """The mean length of the answers seen (rounded up), what a growing
        reservation starts at; None below ``least`` of them."""
        n = len(self._recent)
        return -(-self._sum // n) if n >= least else None

    def spread(self, least: int = 10) -> int | None:
        """The standard deviation of the lengths of the answers seen (rounded up);
        None below ``least`` of them."""
        n = len(self._recent)
        if n < least:
            return None
        variance = max(0.0, self._squares / n - (self._sum / n) ** 2)
        return math.ceil(math.sqrt(variance))


# -- leases and admission modes ----------------------------------------------------------


def lease_size(unit: Unit, configured: int, concurrency: int, max_new_tokens: int) -> int:
    """What a dispatcher asks the ledger for at a time: ``configured`` when set (not
    0), else a quarter of what its requests in flight can reserve together."""
    if configured:
        return configured
    if not unit_rule(unit).in_tokens:
        return max(1, concurrency // 4)
    return max(1, concurrency * max_new_tokens // 4)


@dataclass(frozen=True)
class AdmissionRule:
    """How requests are admitted under a mode."""

    reserves: bool  # requests reserve before they are sent (a lease per dispatcher)
    # (requests that may be in flight at once, each's largest cost) -> the overshoot
    allowance: Callable[[int, int], int]


ADMISSION_MODES: Mapping[AdmissionMode, AdmissionRule] = {
    # Nothing is sent that the ledger has not granted.
    "reserve": AdmissionRule(reserves=True, allowance=lambda in_flight, each: 0),
    # The halt comes after the fact: whatever is in flight then is kept.
    "halt": AdmissionRule(reserves=False, allowance=lambda in_flight, each: in_flight * each),
}


def reserves(admission: AdmissionMode) -> bool:
    """Whether requests reserve budget before they are sent under ``admission``."""
    return ADMISSION_MODES[admission].reserves


def overshoot_allowance(
    unit: Unit,
    admission: AdmissionMode,
    concurrency: int,
    max_new_tokens: int,
    dispatchers: int = 1,
) -> int:
    """The overshoot the admission mode allows, in the budget's unit.

    Reservations (``reserve``) send nothing the ledger has not granted: 0. With
    ``halt``, what every dispatcher may still have in flight when the halt comes; for
    ``total_tokens`` the prompt tokens of those requests come on top (unknown before
    they are sent), so this is a lower bound there."""
    each = max_new_tokens if unit_rule(unit).in_tokens else 1
    return ADMISSION_MODES[admission].allowance(max(1, dispatchers) * concurrency, each)
