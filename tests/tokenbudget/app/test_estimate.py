"""The plan's arithmetic: prompts a budget needs and their range, checked against
budgets filled by drawing answers (a seeded simulation is the oracle), the
outcome, the time, and nothing invented when answers are unknown."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from tokenbudget.app.estimate import (
    Known,
    busy_rate,
    estimate,
    ks_distance,
    prompts_needed,
    random_sample_distance,
    spread,
)


def known(**fields: object) -> Known:
    values: dict[str, object] = {
        "dataset": "d",
        "budget": 100_000,
        "unit": "completion_tokens",
        "available": 1000,
        "bad_rows": 0,
        "prompt_lengths": tuple(range(1000)),
        "prompt_tokens": None,
        "done": 0,
        "spent": 0,
        "completion_tokens": (),
        "server_prompt_tokens": (),
        "costs": (),
        "answers_from": "",
    }
    values.update(fields)
    return Known(**values)  # type: ignore[arg-type]


def answers(values: list[int]) -> dict[str, object]:
    return {
        "completion_tokens": tuple(values),
        "server_prompt_tokens": tuple(10 for _ in values),
        "costs": tuple(values),
        "answers_from": "pilot",
    }


def fill(budget: int, draw: random.Random, mean: float, sigma: float) -> int:
    """Answers drawn until their tokens reach ``budget`` (the last one cut): how
    many prompts a run of this budget needs."""
    mu = math.log(mean) - sigma * sigma / 2
    total = count = 0
    while total < budget:
        total += max(1, round(draw.lognormvariate(mu, sigma)))
        count += 1
    return count


def test_the_10_90_range_holds_the_prompts_a_budget_needs_about_80_times_in_100() -> None:
    draw = random.Random(7)
    mean, sigma, budget, pilot = 1500.0, 0.5, 400_000, 20
    mu = math.log(mean) - sigma * sigma / 2
    inside = below = 0
    trials = 300
    for _ in range(trials):
        sample = [max(1, round(draw.lognormvariate(mu, sigma))) for _ in range(pilot)]
        plan = estimate(known(budget=budget, available=10_000, **answers(sample)), None)
        needed = fill(budget, draw, mean, sigma)
        assert plan.needed_low is not None and plan.needed_high is not None
        inside += plan.needed_low <= needed <= plan.needed_high
        below += needed < plan.needed_low
    # 80% by construction; the normal approximation of a skewed 20-answer mean
    # is off by a few points (about 77% over seeds), not tens.
    assert 0.70 <= inside / trials <= 0.88
    assert below / trials <= 0.16


def test_needed_is_the_budget_over_the_mean_cost_and_narrows_with_more_answers() -> None:
    few = spread([900, 1000, 1100, 1000])
    many = spread([900, 1000, 1100, 1000] * 50)
    assert few is not None and many is not None
    m, low, high = prompts_needed(100_000, few, "completion_tokens")
    assert m == 100
    assert low < 100 < high
    m2, low2, high2 = prompts_needed(100_000, many, "completion_tokens")
    assert m2 == 100 and high2 - low2 < high - low
    assert prompts_needed(0, few, "completion_tokens") == (0, 0, 0)
    # every answer costs 1: exact
    assert prompts_needed(250, few, "samples") == (250, 250, 250)


def test_rows_already_kept_count_against_the_budget() -> None:
    plan = estimate(known(done=40, spent=40_000, **answers([1000] * 40)), 2000.0)
    assert (plan.needed, plan.needed_low, plan.needed_high) == (100, 100, 100)
    assert plan.outcome == "fills"
    assert plan.seconds == pytest.approx(60 * 1000 / 2000.0)  # 60 more answers
    full = estimate(known(done=101, spent=101_000, **answers([1000] * 101)), 2000.0)
    assert (full.outcome, full.needed, full.seconds) == ("full", 101, 0.0)


def test_a_dataset_without_enough_prompts_runs_out() -> None:
    plan = estimate(known(available=40, **answers([1000, 1200, 800] * 5)), 1000.0)
    assert plan.outcome == "runs out"
    assert plan.needed is not None and plan.needed > 40
    assert plan.keeps == 40_000  # 40 answers of 1000 on average
    assert plan.seconds == pytest.approx(40.0)  # 40 x 1000 tokens at 1000/s
    near = estimate(known(available=100, **answers([500, 1000, 1500])), None)
    assert near.outcome == "may run out"  # the range straddles the prompts there are


def test_without_answers_nothing_is_invented() -> None:
    plan = estimate(known(), 5000.0)
    assert plan.answers is None and plan.answers_from == "unknown"
    assert (plan.needed, plan.needed_low, plan.needed_high) == (None, None, None)
    assert (plan.outcome, plan.keeps, plan.seconds, plan.tokens_per_s) == (
        "unknown",
        None,
        None,
        None,
    )
    assert (plan.prompt_tokens, plan.prompt_tokens_from) == (None, "unknown")
    assert plan.kept_prompt_length is None
    # a budget in samples needs no answer length: one prompt each
    samples = estimate(known(unit="samples", budget=300), None)
    assert (samples.needed, samples.outcome, samples.seconds) == (300, "fills", None)


def test_prompt_tokens_come_from_the_tokenizer_else_the_servers_count() -> None:
    counted = estimate(known(available=3, prompt_tokens=(5, 6, 7)), None)
    assert (counted.prompt_tokens, counted.prompt_tokens_from) == (18, "tokenizer")
    served = estimate(known(available=3, **answers([100, 100])), None)
    assert (served.prompt_tokens, served.prompt_tokens_from) == (30, "server")


def test_total_tokens_budget_counts_the_prompts_too() -> None:
    plan = estimate(
        known(
            unit="total_tokens",
            budget=11_000,
            completion_tokens=(1000,) * 10,
            server_prompt_tokens=(100,) * 10,
            costs=(1100,) * 10,
            answers_from="pilot",
        ),
        None,
    )
    assert plan.needed == 10


def test_the_kept_prompts_are_the_first_the_budget_needs() -> None:
    # a file sorted by length: the budget keeps the shortest
    plan = estimate(known(**answers([1000] * 10)), None)
    assert plan.needed == 100
    assert plan.kept_prompt_length is not None and plan.kept_prompt_length.count == 100
    assert plan.kept_prompt_length.p50 == pytest.approx(49.5)
    assert plan.kept_distance == pytest.approx(0.9)
    assert plan.kept_distance > random_sample_distance(100, 1000)


def test_spread_and_ks_distance() -> None:
    s = spread(range(1, 101))
    assert s is not None
    assert (s.count, s.mean) == (100, 50.5)
    assert s.sd == pytest.approx(statistics.stdev(range(1, 101)))
    assert (s.p10, s.p50, s.p90) == pytest.approx((10.9, 50.5, 90.1))
    assert spread([]) is None
    one = spread([7])
    assert one is not None and (one.mean, one.sd, one.p90) == (7, 0.0, 7)
    assert ks_distance([1, 2, 3], [1, 2, 3]) == 0.0
    assert ks_distance([1, 2], [3, 4]) == 1.0
    assert ks_distance([1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8]) == pytest.approx(0.5)
    assert random_sample_distance(100, 100) == 0.0
    assert random_sample_distance(100, 10**9) == pytest.approx(0.1628, abs=1e-4)


def test_busy_rate_counts_the_time_requests_were_in_flight() -> None:
    # two overlapping requests, then a gap, then one more: 3 s busy, 600 tokens
    spans = [(0.0, 2.0, 200), (1.0, 2.0, 100), (10.0, 11.0, 300)]
    assert busy_rate(spans) == pytest.approx(200.0)
    assert busy_rate([]) is None
    assert busy_rate([(5.0, 5.0, 10)]) is None
