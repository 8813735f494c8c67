"""What a budget will buy, estimated before it is spent: arithmetic only, no I/O.

:mod:`tokenbudget.app.plan` gathers what is known of each dataset (its prompts, the
answers earlier rows or a pilot gave, the server's measured speed) as a
:class:`Known`; :func:`estimate` turns it into a :class:`DatasetPlan`. Nothing that
is not known is filled in: without answers, the prompts needed, the outcome and the
time are None, shown as "unknown".

The method, per dataset, with B the budget, and d rows already kept costing S in the
budget's unit (the job resumes past them: they count against B):

* **Cost of an answer**, in the budget's unit (:func:`tokenbudget.streams.budget.unit_cost`: its
  completion tokens, prompt + completion tokens, or 1), from the answers that ended
  on their own: one cut at a budget's line or aborted tells only that it was longer.
  k answers, mean μ, standard deviation σ.
* **Prompts needed**: what is left, R = B - S, takes m = R / μ more answers (rounded
  up); in all d + m.
* **Its 10-90% range**: the true count differs from m for two reasons. The answers
  to come are random: the number of them whose sum reaches R has a standard
  deviation of (σ/μ)·√m (renewal theory). And μ was measured on k answers: its
  standard error σ/√k moves m by (σ/μ)·m/√k. Together sd = (σ/μ)·√(m·(1 + m/k)),
  and the range is m ± 1.2816·sd (the 10th and 90th percentiles of a normal), plus d.
  In ``samples`` every answer costs 1: m = R exactly.
* **Fills or runs out**: with A prompts available, ``fills`` when the range's high
  end is at most A, ``runs out`` when its low end is above A (the budget then keeps
  about (A - d)·μ + S), ``may run out`` between; ``full`` when S ≥ B already.
* **Time to fill**: the completion tokens still to generate (the prompts still to
  send times the mean completion tokens of an answer) over the server's measured
  throughput: the completion tokens of the rows over the time some request of them
  was in flight (:func:`busy_rate`), so the gaps between runs do not count.
* **Not modelled**: with ``on_boundary = "truncate"`` the answer at the budget's
  line is cut there and kept in part, so a run keeps one more (shorter) answer than
  m per dispatcher; with ``cut = "any"`` so are the answers still in flight when the
  budget runs out: about half of them more.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from tokenbudget.core.sections import Unit
from tokenbudget.streams import budget as policy

# The normal distribution's 90th percentile: m ± Z90·sd spans 10% to 90%.
Z90 = 1.2815515655446004

Outcome = Literal["fills", "may run out", "runs out", "full", "unknown"]


@dataclass(frozen=True)
class Spread:
    """A sample's size, mean, standard deviation and quantiles (p10 ... p90)."""

    count: int
    mean: float
    sd: float
    p10: float
    p25: float
    p50: float
    p75: float
    p90: float

    @property
    def quartiles(self) -> tuple[float, float, float]:
        return (self.p25, self.p50, self.p75)


def spread(values: Iterable[float]) -> Spread | None:
    """The :class:`Spread` of ``values`` (None for none). Quantiles interpolate
    between the sorted values (``statistics.quantiles``, inclusive)."""
    data = sorted(values)
    if not data:
        return None
    if len(data) == 1:
        only = float(data[0])
        return Spread(1, only, 0.0, only, only, only, only, only)
    cuts = statistics.quantiles(data, n=20, method="inclusive")  # 5%, 10%, ... 95%
    return Spread(
        count=len(data),
        mean=statistics.fmean(data),
        sd=statistics.stdev(data),
        p10=cuts[1],
        p25=cuts[4],
        p50=cuts[9],
        p75=cuts[14],
        p90=cuts[17],
    )


def ks_distance(sample: Sequence[float], population: Sequence[float]) -> float:
    """Kolmogorov-Smirnov distance: the largest gap between the two empirical
    distribution functions (0: the same distribution; 1: disjoint)."""
    a, b = sorted(sample), sorted(population)
    if not a or not b:
        return 0.0
    i = j = 0
    gap = 0.0
    while i < len(a) and j < len(b):
        x = min(a[i], b[j])
        while i < len(a) and a[i] == x:
            i += 1
        while j < len(b) and b[j] == x:
            j += 1
        gap = max(gap, abs(i / len(a) - j / len(b)))
    return gap


# The Kolmogorov-Smirnov distance 99% of random samples stay within, times
# sqrt(1/k): c(0.01) of the KS distribution.
KS_C99 = 1.628


def random_sample_distance(k: int, n: int) -> float:
    """How far (KS) the lengths of k prompts drawn at random from n may be from all
    n's, in 99 samples of 100: c(0.01)·√(1/k − 1/n), the limit of a sample drawn
    without replacement (0 when k = n: the sample is the whole)."""
    if k <= 0 or n <= 0:
        return 1.0
    return KS_C99 * math.sqrt(max(0.0, 1 / k - 1 / n))


def busy_rate(spans: Iterable[tuple[float, float, int]]) -> float | None:
    """Tokens per second of ``(start, end, tokens)`` requests: their tokens over the
    time at least one of them was in flight (None without any time)."""
    ordered = sorted((start, end, tokens) for start, end, tokens in spans if end >= start)
    busy = 0.0
    tokens = 0
    open_start = open_end = None
    for start, end, count in ordered:
        tokens += count
        if open_end is None or start > open_end:
            if open_end is not None and open_start is not None:
                busy += open_end - open_start
            open_start, open_end = start, end
        else:
            open_end = max(open_end, end)
    if open_end is not None and open_start is not None:
        busy += open_end - open_start
    return tokens / busy if busy > 0 and tokens > 0 else None


@dataclass(frozen=True)
class Known:
    """What is known of a dataset before its run."""

    dataset: str
    budget: int
    unit: Unit
    available: int  # prompts a run would send (after turns, n, bad rows, limit)
    bad_rows: int
    # Characters of each available prompt, in the order they would be sent.
    prompt_lengths: tuple[int, ...]
    # Tokens of each available prompt by the configured tokenizer (None: no tokenizer).
    prompt_tokens: tuple[int, ...] | None
    # Answers already kept for the dataset: how many, and their cost in the unit.
    done: int
    spent: int
    # Answers that ended on their own (not cut at a budget's line), from the rows:
    # their completion tokens, prompt tokens (the server's count) and cost.
    completion_tokens: tuple[int, ...]
    server_prompt_tokens: tuple[int, ...]
    costs: tuple[int, ...]
    answers_from: str  # "earlier rows", "pilot" or "" (none)


@dataclass(frozen=True)
class DatasetPlan:
    dataset: str
    budget: int
    unit: Unit
    available: int
    bad_rows: int
    prompt_tokens: int | None  # of the available prompts (an estimate when from the server)
    prompt_tokens_from: str  # "tokenizer", "server" (mean of the rows' counts) or "unknown"
    answers: Spread | None  # completion tokens per answer
    answers_from: str  # "earlier rows", "pilot" or "unknown"
    done: int
    spent: int
    needed: int | None  # prompts to fill the budget, done ones included
    needed_low: int | None  # 10%
    needed_high: int | None  # 90%
    outcome: Outcome
    keeps: int | None  # what the budget keeps, in its unit, when the prompts run out first
    tokens_per_s: float | None
    seconds: float | None  # to fill (or to run out), at tokens_per_s
    prompt_length: Spread | None  # characters, of every available prompt
    kept_prompt_length: Spread | None  # of the prompts the budget keeps
    kept_distance: float | None  # Kolmogorov-Smirnov distance between the two


def prompts_needed(remaining: int, costs: Spread, unit: Unit) -> tuple[int, int, int]:
    """(m, 10%, 90%): the answers ``remaining`` of the budget takes, from the cost
    of the answers seen (the module docstring says how)."""
    if remaining <= 0:
        return 0, 0, 0
    if unit == "samples":
        return remaining, remaining, remaining
    m = remaining / costs.mean
    cv = costs.sd / costs.mean
    sd = cv * math.sqrt(m * (1 + m / costs.count))
    return math.ceil(m), max(0, math.ceil(m - Z90 * sd)), math.ceil(m + Z90 * sd)


def _outcome(known: Known, low: int, high: int) -> Outcome:
    if known.spent >= known.budget:
        return "full"
    if known.done + high <= known.available:
        return "fills"
    if known.done + low > known.available:
        return "runs out"
    return "may run out"


def estimate(known: Known, tokens_per_s: float | None) -> DatasetPlan:
    answers = spread(known.completion_tokens)
    costs = spread(known.costs)
    needed = low = high = None
    outcome: Outcome = "unknown"
    keeps = seconds = None
    if known.unit == "samples" or (costs is not None and costs.mean > 0):
        unit_costs = costs or Spread(1, 1.0, 0.0, 1, 1, 1, 1, 1)
        remaining = policy.unused(known.budget, known.spent)
        m, m_low, m_high = prompts_needed(remaining, unit_costs, known.unit)
        needed, low, high = known.done + m, known.done + m_low, known.done + m_high
        outcome = _outcome(known, m_low, m_high)
        to_send = max(0, min(needed, known.available) - known.done)
        if outcome == "runs out" and costs is not None:
            keeps = known.spent + round(to_send * costs.mean)
        if answers is not None and tokens_per_s:
            seconds = to_send * answers.mean / tokens_per_s
    prompt_tokens, tokens_from = _prompt_tokens(known)
    lengths = known.prompt_lengths
    kept = lengths[: min(needed, len(lengths))] if needed is not None else ()
    return DatasetPlan(
        dataset=known.dataset,
        budget=known.budget,
        unit=known.unit,
        available=known.available,
        bad_rows=known.bad_rows,
        prompt_tokens=prompt_tokens,
        prompt_tokens_from=tokens_from,
        answers=answers,
        answers_from=known.answers_from if answers is not None else "unknown",
        done=known.done,
        spent=known.spent,
        needed=needed,
        needed_low=low,
        needed_high=high,
        outcome=outcome,
        keeps=keeps,
        tokens_per_s=tokens_per_s if answers is not None else None,
        seconds=seconds,
        prompt_length=spread(lengths),
        kept_prompt_length=spread(kept),
        kept_distance=ks_distance(kept, lengths) if kept else None,
    )


def _prompt_tokens(known: Known) -> tuple[int | None, str]:
    """The available prompts' tokens: counted with the tokenizer, else the server's
    mean count over the rows times the prompts, else unknown."""
    if known.prompt_tokens is not None:
        return sum(known.prompt_tokens), "tokenizer"
    if known.server_prompt_tokens:
        mean = statistics.fmean(known.server_prompt_tokens)
        return round(mean * known.available), "server"
    return None, "unknown"
