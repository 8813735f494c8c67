"""The budget policy: units, boundary policies (ask, floor, clamp, fit), allowances."""

from __future__ import annotations

from typing import get_args

import pytest

from tokenbudget.core.sections import AdmissionMode, BoundaryPolicy, CutPolicy, Unit
from tokenbudget.streams import budget
from tokenbudget.streams.budget import ask, unit_cost, used
from tokenbudget.streams.events import BudgetUnit, LedgerSnapshot
from tokenbudget.streams.ledger import DatasetLedger

# ---- every name the config accepts has its row -------------------------------------


def test_each_configured_name_has_a_rule() -> None:
    assert set(budget.UNITS) == set(get_args(Unit))
    assert set(budget.BOUNDARY_POLICIES) == set(get_args(BoundaryPolicy))
    assert set(budget.CUT_POLICIES) == set(get_args(CutPolicy))
    assert set(budget.ADMISSION_MODES) == set(get_args(AdmissionMode))


# ---- units ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("unit", "expected"),
    [("completion_tokens", 10), ("total_tokens", 13), ("samples", 1)],
)
def test_unit_cost(unit: BudgetUnit, expected: int) -> None:
    assert unit_cost(unit, 3, 10) == expected


def test_unit_cost_rejects_an_unknown_unit() -> None:
    with pytest.raises(ValueError):
        unit_cost("bytes", 1, 1)  # type: ignore[arg-type]


def test_used_per_unit() -> None:
    state = DatasetLedger(dataset="ds", completion_tokens=100, prompt_tokens=40, samples=3)
    assert used(state) == 100
    assert used(state, "completion_tokens") == 100
    assert used(state, "total_tokens") == 140
    assert used(state, "samples") == 3


def test_used_reads_a_snapshot_in_its_own_unit() -> None:
    snap = LedgerSnapshot(
        dataset="ds",
        budget=500,
        unit="total_tokens",
        completion_tokens=100,
        prompt_tokens=40,
        samples=3,
        skipped=0,
        failed=0,
        produced=None,
        halted=False,
        status="open",
        at=1.0,
    )
    assert used(snap) == 140


def test_used_rejects_an_unknown_unit() -> None:
    with pytest.raises(ValueError):
        used(DatasetLedger(dataset="ds"), "bytes")  # type: ignore[arg-type]


def test_answers_left_at_the_mean_cost_so_far_in_the_budgets_unit() -> None:
    def counts(unit: BudgetUnit, completion: int, prompt: int, samples: int) -> DatasetLedger:
        return DatasetLedger(
            dataset="ds",
            unit=unit,
            completion_tokens=completion,
            prompt_tokens=prompt,
            samples=samples,
        )

    # 10 answers of 90 tokens each: 100 tokens left buy 2 more (1.1, rounded up)
    assert budget.answers_left(1000, counts("completion_tokens", 900, 50, 10)) == 2
    assert budget.answers_left(1000, counts("total_tokens", 900, 50, 10)) == 1
    assert budget.answers_left(25, counts("samples", 900, 50, 10)) == 15
    assert budget.answers_left(800, counts("completion_tokens", 900, 50, 10)) == 0
    # nothing to judge by, or nothing to spend
    assert budget.answers_left(1000, counts("completion_tokens", 0, 0, 0)) is None
    assert budget.answers_left(None, counts("completion_tokens", 900, 50, 10)) is None


def test_unused_overshoot_and_full_at_their_boundaries() -> None:
    assert budget.unused(100, 60) == 40
    assert budget.unused(100, 130) == 0
    assert budget.overshoot(100, 100) == 0
    assert budget.overshoot(100, 130) == 30
    # Full once what is left is below the smallest useful request, not at it.
    assert not budget.full(100, 90, 10)
    assert budget.full(100, 91, 10)
    assert budget.full(100, 120, 1)


# ---- the ask and the floor of each policy ---------------------------------------------


def test_truncate_asks_for_the_whole_request_down_to_min_new_tokens() -> None:
    request = ask("completion_tokens", "truncate", 4096, prompt_estimate=500, min_new_tokens=16)
    # A completion-token budget does not reserve the prompt.
    assert (request.want, request.floor, request.overhead) == (4096, 16, 0)


def test_truncate_in_total_tokens_reserves_the_prompt_too() -> None:
    request = ask("total_tokens", "truncate", 4096, prompt_estimate=500, min_new_tokens=16)
    assert (request.want, request.floor, request.overhead) == (4596, 516, 500)


@pytest.mark.parametrize(("unit", "want"), [("completion_tokens", 4096), ("total_tokens", 4596)])
def test_finish_asks_for_the_whole_request_or_nothing(unit: Unit, want: int) -> None:
    request = ask(unit, "finish", 4096, prompt_estimate=500, min_new_tokens=16)
    assert request.want == request.floor == want


@pytest.mark.parametrize("policy", get_args(BoundaryPolicy))
def test_a_sample_is_one_whole_request_under_any_policy(policy: BoundaryPolicy) -> None:
    request = ask("samples", policy, 4096, prompt_estimate=500, min_new_tokens=16)
    assert (request.want, request.floor, request.overhead) == (1, 1, 0)


# ---- the clamp: what a lease's balance admits -------------------------------------------


def test_clamp_takes_the_whole_request_when_the_balance_covers_it() -> None:
    request = ask("completion_tokens", "truncate", 100, min_new_tokens=10)
    assert request.clamp(100, ledger_short=False) == 100
    assert request.clamp(5000, ledger_short=True) == 100


def test_clamp_cuts_only_once_the_ledger_has_no_more_to_give() -> None:
    request = ask("completion_tokens", "truncate", 100, min_new_tokens=10)
    assert request.clamp(99, ledger_short=False) is None  # ask the ledger first
    assert request.clamp(99, ledger_short=True) == 99
    assert request.clamp(10, ledger_short=True) == 10  # at the floor
    assert request.clamp(9, ledger_short=True) is None  # below it


def test_clamp_under_finish_never_cuts() -> None:
    request = ask("completion_tokens", "finish", 100)
    assert request.clamp(99, ledger_short=True) is None
    assert request.clamp(100, ledger_short=True) == 100


# ---- the step: reserve, ask the ledger, or wait for leftovers ---------------------------


def step(
    balance: int,
    *,
    short: bool = True,
    in_flight: int = 3,
    long_answer: int | None = None,
    cut: CutPolicy = "last",
    policy: BoundaryPolicy = "truncate",
) -> budget.Step:
    request = ask("completion_tokens", policy, 100, min_new_tokens=10)
    return request.step(
        balance, ledger_short=short, in_flight=in_flight, long_answer=long_answer, cut=cut
    )


@pytest.mark.parametrize("cut", get_args(CutPolicy))
def test_step_takes_a_whole_request_or_asks_the_ledger_under_either_cut(cut: CutPolicy) -> None:
    assert step(100, short=False, cut=cut) == budget.Step("reserve", 100)
    assert step(5000, cut=cut) == budget.Step("reserve", 100)
    assert step(99, short=False, cut=cut) == budget.ASK  # the ledger may have more
    assert step(9, cut=cut) == budget.ASK  # below the floor


def test_step_any_sends_what_the_lease_holds_at_once() -> None:
    assert step(40, cut="any") == budget.Step("reserve", 40)


def test_step_last_waits_while_requests_in_flight_will_hand_back_their_room() -> None:
    assert step(40) == budget.WAIT
    assert step(99, in_flight=1) == budget.WAIT  # while unknown, only a whole one will do


def test_step_last_sends_the_one_request_cut_once_nothing_is_in_flight() -> None:
    # Nothing can come back any more: waiting would never end.
    assert step(40, in_flight=0) == budget.Step("reserve", 40)
    assert step(10, in_flight=0) == budget.Step("reserve", 10)


def test_step_last_sends_short_what_likely_covers_an_answer_of_the_dataset() -> None:
    assert step(40, long_answer=40) == budget.Step("reserve", 40)
    assert step(39, long_answer=40) == budget.WAIT
    # Answers longer than the request's limit: the whole request is what covers them.
    assert step(99, long_answer=400) == budget.WAIT


def test_step_under_finish_never_sends_short_whatever_the_cut() -> None:
    for cut in get_args(CutPolicy):
        assert step(99, in_flight=0, cut=cut, policy="finish") == budget.ASK


def test_enough_is_the_prompt_and_a_long_answer_or_the_whole_request() -> None:
    request = ask("total_tokens", "truncate", 4096, prompt_estimate=500)
    assert request.enough(None) == 4596
    assert request.enough(1000) == 1500
    assert request.enough(9000) == 4596  # never more than the request
    assert ask("samples", "truncate", 4096).enough(1000) == 1


# ---- the lengths a dataset's answers reach ----------------------------------------------


def test_answer_lengths_know_no_tail_before_99_answers() -> None:
    lengths = budget.AnswerLengths()
    for tokens in range(1, 99):
        lengths.observe(tokens)
    assert lengths.high() is None
    lengths.observe(500)
    # Of 99 answers, the next exceeds the longest with probability 1 / 100.
    assert lengths.high() == 500


def test_answer_lengths_take_the_order_statistic_a_next_answer_exceeds_one_in_100() -> None:
    lengths = budget.AnswerLengths()
    for tokens in range(1, 200):  # 199 answers: 1..199
        lengths.observe(tokens)
    assert lengths.high() == 198  # the second longest: exceeded with probability 2 / 200
    lengths.observe(1000)
    assert lengths.high() == 199


def test_answer_lengths_keep_the_last_window_of_answers() -> None:
    lengths = budget.AnswerLengths(one_in=4, window=3)
    for tokens in (900, 10, 20):
        lengths.observe(tokens)
    assert lengths.high() == 900
    lengths.observe(30)  # 900 leaves the window
    assert lengths.high() == 30


def test_max_new_tokens_sent_is_what_was_reserved_for_new_tokens() -> None:
    assert ask("completion_tokens", "truncate", 100).max_new_tokens_for(40) == 40
    total = ask("total_tokens", "truncate", 100, prompt_estimate=30)
    assert total.max_new_tokens_for(70) == 40  # the prompt's estimate is not new tokens
    # A sample reserves 1, whatever max_new_tokens it is sent with.
    assert ask("samples", "truncate", 100).max_new_tokens_for(1) == 100


def test_lease_request_is_a_lease_or_the_one_request_that_needs_more() -> None:
    assert ask("completion_tokens", "truncate", 100).lease_request(4096) == 4096
    assert ask("completion_tokens", "truncate", 8192).lease_request(4096) == 8192


# ---- the fit: what of a generated answer is kept -----------------------------------------


def test_fit_keeps_an_answer_whole_when_it_fits() -> None:
    assert budget.fit(30, 100, can_cut=False) == 30
    assert budget.fit(100, 100, can_cut=False) == 100  # exactly at the line


def test_fit_cuts_at_the_line_only_when_the_answer_can_be_cut() -> None:
    assert budget.fit(140, 100, can_cut=True) == 100
    assert budget.fit(140, 100, can_cut=False) is None
    assert budget.fit(140, 0, can_cut=True) is None  # nothing left to cut to


def test_only_completion_token_answers_with_ids_can_be_cut() -> None:
    assert budget.cuttable("completion_tokens", has_token_ids=True)
    assert not budget.cuttable("completion_tokens", has_token_ids=False)
    assert not budget.cuttable("total_tokens", has_token_ids=True)
    assert not budget.cuttable("samples", has_token_ids=True)


# ---- lease size and admission modes ----------------------------------------------------


def test_lease_size() -> None:
    assert budget.lease_size("completion_tokens", 20_000, 64, 8192) == 20_000  # configured
    # Automatic: a quarter of what the requests in flight can reserve together.
    assert budget.lease_size("completion_tokens", 0, 64, 8192) == 64 * 8192 // 4
    assert budget.lease_size("total_tokens", 0, 8, 100) == 200
    assert budget.lease_size("samples", 0, 64, 8192) == 16
    assert budget.lease_size("samples", 0, 2, 8192) == 1  # never 0


def test_only_reserve_reserves() -> None:
    assert budget.reserves("reserve")
    assert not budget.reserves("halt")


def test_overshoot_allowance() -> None:
    # Reservations never send what the ledger has not granted: nothing to allow.
    assert budget.overshoot_allowance("completion_tokens", "reserve", 64, 8192, 3) == 0
    # Halting after the fact: whatever every dispatcher has in flight.
    assert budget.overshoot_allowance("completion_tokens", "halt", 64, 8192) == 524_288
    assert budget.overshoot_allowance("completion_tokens", "halt", 64, 8192, 3) == 3 * 524_288
    assert budget.overshoot_allowance("samples", "halt", 64, 8192, 2) == 128


# ---- growing reservations ([budget] reserve = "grow") ------------------------------------


def test_typical_is_the_mean_of_the_recent_answers_once_enough_were_seen() -> None:
    lengths = budget.AnswerLengths(window=4)
    for tokens in (10, 20, 30):
        lengths.observe(tokens)
    assert lengths.typical(least=4) is None
    lengths.observe(41)
    assert lengths.typical(least=4) == 26  # 101 / 4, rounded up
    lengths.observe(100)  # 10 leaves the window
    assert lengths.typical(least=4) == 48  # 191 / 4, rounded up


def test_a_growing_request_reserves_a_typical_answer_and_is_sent_with_its_limit() -> None:
    request = ask("completion_tokens", "truncate", 4096).growing(1500, "last")
    assert (request.want, request.max_new_tokens, request.grows) == (1500, 4096, True)
    step = request.step(10_000, ledger_short=False, in_flight=3, long_answer=None, cut="last")
    assert step == budget.Step("reserve", 1500, grows=True)
    assert request.max_new_tokens_for(step.amount, step.grows) == 4096
    # Short of a typical answer while the ledger has more: ask it.
    short = request.step(1499, ledger_short=False, in_flight=3, long_answer=None, cut="last")
    assert short == budget.ASK


def test_a_request_does_not_grow_before_its_datasets_answers_are_known() -> None:
    whole = ask("completion_tokens", "truncate", 4096)
    assert whole.growing(None, "last") == whole
    assert whole.growing(5000, "last") == whole  # answers as long as the limit
    samples = ask("samples", "truncate", 4096)
    assert samples.growing(10, "last") == samples
    assert samples.growing(10, "any") == samples


def test_under_cut_any_a_growing_request_reserves_only_its_floor() -> None:
    request = ask("completion_tokens", "truncate", 4096, min_new_tokens=16).growing(None, "any")
    assert (request.want, request.grows) == (16, True)
    step = request.step(100, ledger_short=True, in_flight=900, long_answer=None, cut="any")
    assert step == budget.Step("reserve", 16, grows=True)  # the fleet stays full
    assert request.step(15, ledger_short=True, in_flight=900, long_answer=None, cut="any") == (
        budget.ASK
    )


def test_typical_answers_and_their_spread_say_what_answers_in_flight_need() -> None:
    lengths = budget.AnswerLengths()
    for tokens in (100, 300) * 5:
        lengths.observe(tokens)
    assert (lengths.typical(), lengths.spread()) == (200, 100)
    assert budget.room_for(4, 200, 100) == 800 + 600  # 3 x sqrt(4) x 100
    assert budget.room_for(1, 200, 0) == 200


def test_at_the_budgets_end_what_is_left_grows_the_answers_in_flight_first() -> None:
    request = ask("completion_tokens", "truncate", 4096).growing(1000, "last", 100)

    def step(balance: int, in_flight: int, cut: CutPolicy = "last") -> budget.Step:
        # each in flight holds a typical answer
        return request.step(
            balance,
            ledger_short=True,
            in_flight=in_flight,
            long_answer=None,
            cut=cut,
            held=in_flight * 1000,
        )

    growing = budget.Step("reserve", 1000, grows=True)
    # The ledger has no more: a new one goes out while what the lease holds covers
    # it and the three in flight at a typical answer each, with 3 x sqrt(4) x 100
    # to spare; else it waits for their leftovers.
    assert step(1600, 3) == growing
    assert step(1599, 3) == budget.WAIT
    assert step(1599, 3, "any") == growing  # at once, whatever that cuts
    # Less than a typical answer and nothing in flight: the rest goes out clamped,
    # the one answer cut at the line.
    assert step(700, 0) == budget.Step("reserve", 700)
    assert request.max_new_tokens_for(700, False) == 700
    assert step(700, 3) == budget.WAIT
    assert step(700, 3, "any") == budget.Step("reserve", 700)
    # Room for a typical answer but not for its spread, and nothing in flight to
    # hand anything back: the rest goes out clamped rather than wait for ever.
    assert step(1200, 0) == budget.Step("reserve", 1200)
    assert request.max_new_tokens_for(1200, False) == 1200
    assert step(0, 3) == budget.ASK  # below the floor: the ledger is asked again


def test_what_the_ledger_still_has_closes_the_growing_gate_before_it_runs_short() -> None:
    request = ask("completion_tokens", "truncate", 4096).growing(1000, "last", 100)

    def step(balance: int, in_flight: int, more: int | None) -> budget.Step:
        return request.step(
            balance,
            ledger_short=False,
            in_flight=in_flight,
            long_answer=None,
            cut="last",
            held=in_flight * 1000,
            more=more,
        )

    growing = budget.Step("reserve", 1000, grows=True)
    # Four answers want 4,000 + 3 x sqrt(4) x 100 = 4,600: the lease's 1,000, the
    # 3,000 held and 600 more at the ledger cover them; 599 more do not.
    assert step(1000, 3, 600) == growing
    assert step(1000, 3, 599) == budget.WAIT
    assert step(1000, 3, None) == growing  # the ledger did not say: as before
    assert step(999, 3, 10**6) == budget.ASK  # short of a typical answer: ask
    # Nothing in flight to hand back: ask the ledger for the rest (it then runs short).
    assert step(1000, 0, 0) == budget.ASK
    assert request.step(
        1000, ledger_short=True, in_flight=0, long_answer=None, cut="last", more=0
    ) == budget.Step("reserve", 1000)
    # Under cut = "any" nothing waits for the answers in flight.
    assert request.step(
        1000, ledger_short=False, in_flight=3, long_answer=None, cut="any", held=3000, more=0
    ) == budget.Step("reserve", 1000, grows=True)


def test_growth_takes_the_need_and_a_first_reservation_more_within_the_limit() -> None:
    # allowance, need, reserved, ceiling, balance
    assert budget.growth(1000, 900, 1000, 4096, 10_000) == 0  # still covered
    assert budget.growth(1000, 1100, 1000, 4096, 10_000) == 1100
    assert budget.growth(3000, 3100, 1000, 4096, 10_000) == 1096  # up to the limit
    assert budget.growth(1000, 1100, 1000, 4096, 300) == 300  # what the lease holds
    assert budget.growth(1000, 1100, 1000, 4096, 0) == 0
