"""How long the test suite takes on one pytest process (the baseline: how ``make
test`` ran before) against several (pytest-xdist, ``make test``'s ``-n
TEST_WORKERS --dist loadscope``), in one run, on this machine.

    .venv/bin/python bench/test_suite_time.py [--workers 1,3] [-- PYTEST ARGS]

Each variant runs the same selection (by default the whole suite; after ``--``,
anything pytest takes, e.g. ``-m integration`` or a few files) in a fresh pytest
process and prints its wall time, the CPU seconds it used (its children, brokers
and simulators included) and pytest's last line. A variant whose tests fail is
reported as such: a time of a suite that did not pass proves nothing. Out of ``make
bench``'s loop: the whole suite takes many minutes per variant.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time


def one(workers: int, pytest_args: list[str]) -> tuple[float, float, int, str]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    if workers > 1:
        command += ["-n", str(workers), "--dist", "loadscope"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command + pytest_args, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return wall, cpu, done.returncode, lines[-1] if lines else done.stderr[-300:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,3", help="comma-separated; 1 is the baseline")
    parser.add_argument("pytest_args", nargs="*", help="after --: what pytest runs")
    args = parser.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    print(f"{os.cpu_count()} cores; pytest {' '.join(args.pytest_args) or '(whole suite)'}")
    results = {}
    for workers in counts:
        wall, cpu, code, last = one(workers, args.pytest_args)
        results[workers] = wall
        verdict = "passed" if code == 0 else f"FAILED (exit {code})"
        print(f"{workers} worker(s): {wall:7.1f} s wall, {cpu:7.1f} s CPU, {verdict}: {last}")
    if 1 in results:
        for workers, wall in results.items():
            if workers != 1:
                print(f"{workers} workers vs 1: {wall / results[1]:.2f}x the time")


if __name__ == "__main__":
    main()
