"""The fleet's routing policy (producers/inference/placement.py), pure: which server a request
goes to, and how each server's window grows and shrinks."""

from __future__ import annotations

import random
from collections import Counter

from tokenbudget.producers.inference.placement import (
    CUT_HOLD_S,
    PACE_SAMPLES,
    Candidate,
    Pace,
    Window,
    pick,
    round_robin,
)


def server(url: str, **fields: object) -> Candidate:
    values: dict[str, object] = {
        "url": url,
        "weight": 1.0,
        "speed": 100.0,
        "in_flight": 0,
        "limit": 8,
        "outstanding": 0,
    }
    values.update(fields)
    return Candidate(**values)  # type: ignore[arg-type]


RNG = random.Random(0)


def test_the_least_outstanding_work_for_its_speed_wins() -> None:
    busy = server("a", in_flight=4, outstanding=4000)
    idle = server("b", in_flight=1, outstanding=1000)
    assert pick([busy, idle], 1000, RNG) == "b"
    # Four times as fast, it clears four times the work in the same time.
    fast = server("a", in_flight=4, outstanding=4000, speed=400.0)
    assert pick([fast, idle], 1000, RNG) == "a"
    # A weight says the same from the config.
    heavy = server("a", in_flight=4, outstanding=4000, weight=4.0)
    assert pick([heavy, server("b", outstanding=1500)], 1000, RNG) == "a"


def test_a_server_not_seen_answering_counts_at_the_fleets_median_speed() -> None:
    new = server("new", speed=0.0, outstanding=500)
    seen = [server("a", speed=100.0, outstanding=1000), server("b", speed=300.0, outstanding=3000)]
    # median 200: new's work is 1500/200 against a's 2000/100 and b's 4000/300
    assert pick([*seen, new], 1000, RNG) == "new"


def test_a_server_full_or_not_ready_is_not_picked_and_none_when_none_can_take_it() -> None:
    full = server("a", in_flight=8, limit=8)
    held = server("b", ready=False)  # away, draining or held by its Retry-After
    assert pick([full, held, server("c", outstanding=10**9)], 1, RNG) == "c"
    assert pick([full, held], 1, RNG) is None


def test_a_conversation_goes_back_to_the_server_of_its_previous_turn_while_it_has_room() -> None:
    loaded = server("a", in_flight=7, outstanding=7000)
    idle = server("b")
    assert pick([loaded, idle], 100, RNG, prefer="a") == "a"
    assert pick([server("a", in_flight=8), idle], 100, RNG, prefer="a") == "b"
    assert pick([server("a", ready=False), idle], 100, RNG, prefer="a") == "b"


def test_a_server_that_failed_the_prompt_is_taken_only_when_no_other_can() -> None:
    failed = server("a")
    other = server("b", outstanding=5000)
    assert pick([failed, other], 100, RNG, avoid={"a"}) == "b"
    assert pick([failed, server("b", in_flight=8)], 100, RNG, avoid={"a"}) == "a"


def test_ties_are_broken_at_random_so_equal_servers_share_the_work() -> None:
    rng = random.Random(1)
    fleet = [server(url) for url in "abcd"]
    chosen = Counter(pick(fleet, 100, rng) for _ in range(400))
    assert set(chosen) == set("abcd") and min(chosen.values()) > 50


def test_round_robin_takes_turns_whatever_the_load() -> None:
    fleet = [server("a", outstanding=10**6), server("b"), server("c", in_flight=8)]
    assert [round_robin(fleet, turn) for turn in range(4)] == ["a", "b", None, "a"]
    assert round_robin([], 0) is None


def test_a_window_grows_by_one_per_window_of_answers_while_kept_full() -> None:
    window = Window(ceiling=16, limit=4.0)
    assert window.grown(in_flight=2) == window  # not full: says nothing
    for _ in range(5):  # about a window's worth of answers (+1/limit each)
        window = window.grown(in_flight=window.size)
    assert window.size == 5
    for _ in range(1000):
        window = window.grown(in_flight=window.size)
    assert window.size == 16 and window.limit == 16.0  # never past its ceiling


def test_a_window_is_halved_once_per_burst_of_refusals_down_to_its_floor() -> None:
    window = Window.full(64)
    cut = window.cut(now=100.0)
    assert cut.size == 32
    assert cut.cut(now=100.0 + CUT_HOLD_S / 2) == cut  # the same burst counts once
    again = cut.cut(now=100.0 + CUT_HOLD_S)
    assert again.size == 16
    for i in range(20):
        again = again.cut(now=200.0 + i * CUT_HOLD_S)
    assert again.size == again.floor == 1


def test_a_window_under_a_new_ceiling() -> None:
    assert Window.full(64).resized(32).size == 32
    assert Window(ceiling=64, limit=10.0).resized(128).size == 10


def test_answers_slowing_to_under_half_their_usual_speed_say_the_server_is_overloaded() -> None:
    pace = Pace()
    for _ in range(PACE_SAMPLES):
        pace = pace.observed(1000, 1.0)  # 1,000 tokens/s each
    assert not pace.slow
    for _ in range(10):
        pace = pace.observed(1000, 4.0)  # 250 tokens/s: a queue in front of its batch
    assert pace.slow
    assert not Pace().observed(1000, 10.0).slow  # too few answers to judge
    assert Pace().observed(0, 1.0) == Pace()  # an empty answer says nothing
