"""How long the test suite takes on one pytest process (the baseline: how ``make
test`` ran before) against several (pytest-xdist, ``make test``'s ``-n
TEST_WORKERS --dist loadscope``), in one run, on this machine; and where the time
goes: the slowest modules (their tests' seconds summed) and tests of a run.

    .venv/bin/python bench/test_suite_time.py [--workers 1,3] [-- PYTEST ARGS]
    .venv/bin/python bench/test_suite_time.py --slowest [--workers 4] [-- PYTEST ARGS]
    .venv/bin/python bench/test_suite_time.py --record [--workers 4] [-- PYTEST ARGS]

Each variant runs the same selection (by default the whole suite; after ``--``,
anything pytest takes, e.g. ``-m integration`` or a few files) in a fresh pytest
process and prints its wall time, the CPU seconds it used (its children, brokers
and simulators included) and pytest's last line. A variant whose tests fail is
reported as such: a time of a suite that did not pass proves nothing.
``--slowest`` prints each variant's slowest modules and tests too (from pytest's
JUnit XML report: setup, call and teardown of each test); ``--record`` runs one
variant and writes what its modules and slow tests took into
``tests/durations.json`` (the modules it ran replaced, those gone dropped, the
rest kept), the order ``make test``'s workers take the tests in. Out of ``make
bench``'s loop: the whole suite takes many minutes per variant.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.durations import DURATIONS, Durations, module_of  # noqa: E402


@dataclass(frozen=True)
class Variant:
    workers: int
    wall: float
    cpu: float
    code: int
    last: str
    seconds: dict[str, float]  # per test node id, setup + call + teardown


def test_seconds(junit: Path) -> dict[str, float]:
    """Seconds per node id from a JUnit XML report (``junit_family=xunit1``: each
    test case names its file)."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit).iter("testcase"):
        path = case.get("file") or ""
        module = path.removesuffix(".py").replace("/", ".")
        # classname is the module's dotted path, a test class's name after it
        inner = (case.get("classname") or "").removeprefix(module).strip(".")
        nodeid = "::".join(
            part for part in (path, inner.replace(".", "::"), case.get("name")) if part
        )
        seconds[nodeid] = seconds.get(nodeid, 0.0) + float(case.get("time") or 0)
    return seconds


def one(workers: int, pytest_args: list[str]) -> Variant:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if workers > 1:
        command += ["-n", str(workers), "--dist", "loadscope"]
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command += [f"--junitxml={junit}", "-o", "junit_family=xunit1"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run(command + pytest_args, capture_output=True, text=True, cwd=ROOT)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        seconds = test_seconds(junit) if junit.exists() else {}
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    last = lines[-1] if lines else done.stderr[-300:]
    return Variant(workers, wall, cpu, done.returncode, last, seconds)


def print_slowest(variant: Variant, top: int) -> None:
    modules: dict[str, float] = {}
    for nodeid, s in variant.seconds.items():
        modules[module_of(nodeid)] = modules.get(module_of(nodeid), 0.0) + s
    total = sum(modules.values())
    print(f"  {total:.0f} test-seconds in all; the slowest modules (tests summed):")
    for module, s in sorted(modules.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {s:8.1f} s  {module}")
    print("  the slowest tests:")
    for nodeid, s in sorted(variant.seconds.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {s:8.1f} s  {nodeid}")


def record(variant: Variant) -> None:
    exists = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    run = Durations.from_run(variant.seconds)
    Durations.read().updated(run, exists).write()
    print(f"recorded {len(run.modules)} modules, {len(run.tests)} slow tests: {DURATIONS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workers",
        help="comma-separated; 1 is the baseline (default 1,3; with --slowest or --record "
        "TEST_WORKERS, 4)",
    )
    parser.add_argument("--slowest", action="store_true", help="print the slowest modules, tests")
    parser.add_argument("--record", action="store_true", help=f"write {DURATIONS.name}")
    parser.add_argument("--top", type=int, default=25, help="how many slowest to print")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs")
    args = parser.parse_args()
    one_run = os.environ.get("TEST_WORKERS", "4")
    counts = [
        int(n)
        for n in (args.workers or (one_run if args.record or args.slowest else "1,3")).split(",")
    ]
    if args.record and len(counts) != 1:
        parser.error("--record runs one variant: give one --workers")
    print(f"{os.cpu_count()} cores; pytest {' '.join(args.pytest_args) or '(whole suite)'}")
    results = {}
    for workers in counts:
        variant = one(workers, args.pytest_args)
        results[workers] = variant.wall
        verdict = "passed" if variant.code == 0 else f"FAILED (exit {variant.code})"
        print(
            f"{workers} worker(s): {variant.wall:7.1f} s wall, {variant.cpu:7.1f} s CPU, "
            f"{verdict}: {variant.last}"
        )
        if args.slowest or args.record:
            print_slowest(variant, args.top)
        if args.record:
            if variant.code != 0:
                sys.exit("not recorded: the tests did not pass")
            record(variant)
    if 1 in results:
        for workers, wall in results.items():
            if workers != 1:
                print(f"{workers} workers vs 1: {wall / results[1]:.2f}x the time")


if __name__ == "__main__":
    main()
