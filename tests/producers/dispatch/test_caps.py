"""What the requests in flight on a revoked lease may still keep between them
(producers/dispatch/caps.py ``RevokedCap``); how the dispatcher aborts and cuts them is in
``test_dispatcher_caps``."""

from __future__ import annotations

from tokenbudget.producers.dispatch.caps import RevokedCap


def test_revoked_cap_aborts_all_once_what_they_generated_reaches_it() -> None:
    cap = RevokedCap(left=100)
    assert not cap.progress("a", 40)
    assert not cap.progress("b", 50)
    assert cap.progress("a", 51)  # 51 + 50 > 100: nothing more of either can be kept
    assert not cap.progress("b", 60)  # told once
    assert cap.aborting


def test_revoked_cap_with_nothing_left_aborts_at_the_first_token() -> None:
    cap = RevokedCap(left=0)
    assert cap.check()


def test_revoked_cap_keeps_answers_in_arrival_order_and_cuts_the_one_at_the_line() -> None:
    cap = RevokedCap(left=100)
    cap.progress("a", 30)
    cap.progress("b", 60)
    cap.progress("c", 40)
    assert cap.fit("a", 30, cuttable=True) == 30
    assert cap.generated == {"b": 60, "c": 40}
    assert cap.fit("b", 60, cuttable=True) == 60
    assert cap.fit("c", 40, cuttable=True) == 10  # cut at the line
    assert cap.left == 0
    assert cap.fit("d", 5, cuttable=True) is None


def test_revoked_cap_never_cuts_what_cannot_be_cut() -> None:
    cap = RevokedCap(left=50)
    assert cap.fit("a", 80, cuttable=False) is None
    assert cap.left == 50  # left for an answer that fits whole
    assert cap.fit("b", 50, cuttable=False) == 50


def test_revoked_cap_forgets_requests_that_ended_with_nothing_kept() -> None:
    cap = RevokedCap(left=100)
    cap.progress("a", 90)
    cap.forget("a")
    assert not cap.progress("b", 99)
