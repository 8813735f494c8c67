"""What the tests took when last recorded, and the order ``make test``'s workers take
them in: the longest work units first.

``tests/durations.json`` holds the seconds of each test module (keyed by its path
from the repository's top, summed over its tests) and of each test that took a
second or more (keyed by node id); ``bench/test_suite_time.py --record`` writes it.
A module or test the file does not know (new, or moved since the last record) is
looked up by its file's name, so a module moved to another folder keeps its place;
failing that it gets a default: an integration test the median of the recorded slow
tests, a unit test's module nothing (it runs after the known ones, in collection
order).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path, PurePosixPath

DURATIONS = Path(__file__).with_name("durations.json")
# Tests quicker than this are not recorded one by one: their module's mean stands in.
SLOW_TEST_S = 1.0


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _name(key: str) -> str:
    """A module path or node id with the module's folders left out."""
    path, _, rest = key.partition("::")
    return "::".join((PurePosixPath(path).name, rest))


def _by_name(keys: Iterable[str]) -> dict[str, str]:
    """The recorded keys by their module file's name, for the names recorded once."""
    found: dict[str, list[str]] = {}
    for key in keys:
        found.setdefault(_name(key), []).append(key)
    return {name: keys[0] for name, keys in found.items() if len(keys) == 1}


@dataclass(frozen=True)
class Durations:
    """Recorded seconds per module path and per slow test's node id."""

    modules: dict[str, float] = field(default_factory=dict)
    tests: dict[str, float] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path = DURATIONS) -> Durations:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls()
        return cls(dict(data["modules"]), dict(data["tests"]))

    def write(self, path: Path = DURATIONS) -> None:
        data = {
            "modules": dict(sorted(self.modules.items())),
            "tests": dict(sorted(self.tests.items())),
        }
        path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")

    @classmethod
    def from_run(cls, seconds: dict[str, float]) -> Durations:
        """From one run's seconds per node id (setup, call and teardown summed)."""
        modules: dict[str, float] = {}
        for nodeid, s in seconds.items():
            modules[module_of(nodeid)] = modules.get(module_of(nodeid), 0.0) + s
        tests = {nodeid: round(s, 1) for nodeid, s in seconds.items() if s >= SLOW_TEST_S}
        return cls({m: round(s, 1) for m, s in modules.items()}, tests)

    def updated(self, run: Durations, exists: Collection[str]) -> Durations:
        """This record with ``run``'s modules replaced by what they took in it, and the
        modules no longer in ``exists`` (module paths) dropped."""
        keep = set(exists) - set(run.modules)
        return Durations(
            {**{m: s for m, s in self.modules.items() if m in keep}, **run.modules},
            {**{t: s for t, s in self.tests.items() if module_of(t) in keep}, **run.tests},
        )

    @cached_property
    def _moved_modules(self) -> dict[str, str]:
        return _by_name(self.modules)

    @cached_property
    def _moved_tests(self) -> dict[str, str]:
        return _by_name(self.tests)

    def module(self, path: str) -> float | None:
        if path in self.modules:
            return self.modules[path]
        moved = self._moved_modules.get(_name(path))
        return None if moved is None else self.modules[moved]

    def test(self, nodeid: str) -> float | None:
        if nodeid in self.tests:
            return self.tests[nodeid]
        moved = self._moved_tests.get(_name(nodeid))
        return None if moved is None else self.tests[moved]

    def typical_test(self) -> float:
        """What an integration test nothing is known of is taken to take."""
        return statistics.median(self.tests.values()) if self.tests else SLOW_TEST_S


@dataclass(frozen=True)
class Collected:
    nodeid: str
    integration: bool


def order(
    tests: Sequence[Collected], durations: Durations, one_worker: Collection[str]
) -> list[str]:
    """The node ids in the order the workers should take them: integration tests
    first, each work unit (a module of ``one_worker`` module stems whole, any other
    integration test alone) by its expected seconds, longest first; then the unit
    tests, module by module, the longest modules first. Ties keep collection order,
    and so does every module's own order of its tests within one unit."""
    counts: dict[str, int] = {}
    for t in tests:
        counts[module_of(t.nodeid)] = counts.get(module_of(t.nodeid), 0) + 1

    def alone(t: Collected) -> float:
        known = durations.test(t.nodeid)
        if known is not None:
            return known
        module = durations.module(module_of(t.nodeid))
        if module is not None:
            return module / counts[module_of(t.nodeid)]
        return durations.typical_test() if t.integration else 0.0

    units: dict[str, float] = {}
    first: dict[str, int] = {}
    unit_of: dict[str, str] = {}
    for i, t in enumerate(tests):
        path = module_of(t.nodeid)
        whole = PurePosixPath(path).stem in one_worker or not t.integration
        unit = ("" if t.integration else "unit ") + path if whole else t.nodeid
        unit_of[t.nodeid] = unit
        first.setdefault(unit, i)
        if whole and not t.integration:
            units[unit] = durations.module(path) or 0.0
        elif whole:
            units.setdefault(unit, durations.module(path) or 0.0)
            if durations.module(path) is None:
                units[unit] += alone(t)
        else:
            units[unit] = alone(t)

    def key(t: Collected) -> tuple[int, float, int]:
        unit = unit_of[t.nodeid]
        return (0 if t.integration else 1, -units[unit], first[unit])

    return [t.nodeid for t in sorted(tests, key=key)]
