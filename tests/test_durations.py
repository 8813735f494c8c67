"""The order ``make test``'s workers take the tests in, from recorded durations."""

from __future__ import annotations

from pathlib import Path

from tests.durations import DURATIONS, Collected, Durations, module_of, order

INTEGRATION = "tests/integration"


def it(nodeid: str) -> Collected:
    return Collected(nodeid, integration=True)


def unit(nodeid: str) -> Collected:
    return Collected(nodeid, integration=False)


RECORDED = Durations(
    modules={
        f"{INTEGRATION}/test_long.py": 300.0,
        f"{INTEGRATION}/test_shared.py": 200.0,
        f"{INTEGRATION}/test_quick.py": 20.0,
        "tests/core/test_big.py": 9.0,
        "tests/core/test_small.py": 1.0,
        "tests/producers/test_caps.py": 5.0,
    },
    tests={
        f"{INTEGRATION}/test_long.py::test_a": 250.0,
        f"{INTEGRATION}/test_long.py::test_b": 50.0,
        f"{INTEGRATION}/test_quick.py::test_q": 20.0,
    },
)


def test_integration_units_run_first_longest_first_and_unit_modules_stay_whole() -> None:
    tests = [
        unit("tests/core/test_small.py::test_1"),
        unit("tests/core/test_big.py::test_1"),
        unit("tests/core/test_small.py::test_2"),
        unit("tests/core/test_big.py::test_2"),
        it(f"{INTEGRATION}/test_quick.py::test_q"),
        it(f"{INTEGRATION}/test_long.py::test_b"),
        it(f"{INTEGRATION}/test_shared.py::test_2"),
        it(f"{INTEGRATION}/test_shared.py::test_1"),
        it(f"{INTEGRATION}/test_long.py::test_a"),
    ]
    assert order(tests, RECORDED, one_worker={"test_shared"}) == [
        f"{INTEGRATION}/test_long.py::test_a",  # 250 s alone
        # one unit of 200 s, its tests in the module's own order
        f"{INTEGRATION}/test_shared.py::test_2",
        f"{INTEGRATION}/test_shared.py::test_1",
        f"{INTEGRATION}/test_long.py::test_b",
        f"{INTEGRATION}/test_quick.py::test_q",
        # unit tests after, module by module, longest module first
        "tests/core/test_big.py::test_1",
        "tests/core/test_big.py::test_2",
        "tests/core/test_small.py::test_1",
        "tests/core/test_small.py::test_2",
    ]


def test_a_moved_module_keeps_its_recorded_seconds() -> None:
    """Keyed by path, found by file name when the path is gone: a module moved to
    another folder keeps its place."""
    moved = "tests/producers/dispatch/test_caps.py"
    assert RECORDED.module(moved) == 5.0
    assert RECORDED.test(f"{INTEGRATION}/elsewhere/test_long.py::test_a") == 250.0
    tests = [unit("tests/core/test_small.py::test_1"), unit(f"{moved}::test_1")]
    assert order(tests, RECORDED, one_worker=()) == [
        f"{moved}::test_1",
        "tests/core/test_small.py::test_1",
    ]


def test_a_file_name_recorded_twice_is_not_guessed_at() -> None:
    twice = Durations(modules={"tests/a/test_x.py": 1.0, "tests/b/test_x.py": 2.0})
    assert twice.module("tests/c/test_x.py") is None
    assert twice.module("tests/b/test_x.py") == 2.0


def test_unknown_tests_get_defaults() -> None:
    """A new integration test of a known module: the module's mean; of a new module:
    the median of the recorded slow tests (50 s here, above the 20 s one). A new unit
    module: after the known ones, in collection order."""
    tests = [
        unit("tests/core/test_new.py::test_1"),
        unit("tests/core/test_small.py::test_1"),
        it(f"{INTEGRATION}/test_quick.py::test_q"),
        it(f"{INTEGRATION}/test_new.py::test_1"),
        it(f"{INTEGRATION}/test_long.py::test_c"),  # 300 s over 2 tests collected: 150
        it(f"{INTEGRATION}/test_long.py::test_b"),
        it(f"{INTEGRATION}/test_fresh_shared.py::test_1"),  # 2 x 50 s, one unit
        it(f"{INTEGRATION}/test_fresh_shared.py::test_2"),
    ]
    assert order(tests, RECORDED, one_worker={"test_fresh_shared"}) == [
        f"{INTEGRATION}/test_long.py::test_c",
        f"{INTEGRATION}/test_fresh_shared.py::test_1",
        f"{INTEGRATION}/test_fresh_shared.py::test_2",
        f"{INTEGRATION}/test_new.py::test_1",  # 50 s, as test_b, but collected first
        f"{INTEGRATION}/test_long.py::test_b",
        f"{INTEGRATION}/test_quick.py::test_q",
        "tests/core/test_small.py::test_1",
        "tests/core/test_new.py::test_1",
    ]


def test_no_record_keeps_collection_order() -> None:
    tests = [unit("tests/test_b.py::t"), it("tests/test_a.py::t"), unit("tests/test_a.py::u")]
    assert order(tests, Durations(), one_worker=()) == [
        "tests/test_a.py::t",
        "tests/test_b.py::t",
        "tests/test_a.py::u",
    ]


def test_a_record_replaces_what_it_ran_and_drops_modules_gone(tmp_path: Path) -> None:
    run = Durations.from_run(
        {
            f"{INTEGRATION}/test_quick.py::test_q": 12.34,
            f"{INTEGRATION}/test_quick.py::test_r": 0.5,
        }
    )
    assert run == Durations(
        {f"{INTEGRATION}/test_quick.py": 12.8}, {f"{INTEGRATION}/test_quick.py::test_q": 12.3}
    )
    exists = set(RECORDED.modules) - {"tests/core/test_small.py"}
    updated = RECORDED.updated(run, exists)
    assert updated.modules == {
        **{m: s for m, s in RECORDED.modules.items() if m in exists},
        f"{INTEGRATION}/test_quick.py": 12.8,
    }
    assert updated.tests == {
        f"{INTEGRATION}/test_long.py::test_a": 250.0,
        f"{INTEGRATION}/test_long.py::test_b": 50.0,
        f"{INTEGRATION}/test_quick.py::test_q": 12.3,
    }
    path = tmp_path / "durations.json"
    updated.write(path)
    assert Durations.read(path) == updated
    assert Durations.read(tmp_path / "none.json") == Durations()


def test_the_committed_record_reads() -> None:
    recorded = Durations.read(DURATIONS)
    assert recorded.modules and recorded.tests
    assert all(module_of(t) in recorded.modules for t in recorded.tests)
