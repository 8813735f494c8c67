"""How long the ``tokenbudget`` command takes to start, importing only the named
command's module (what ``tokenbudget.cli`` does) against importing every command's
module (the baseline: one parser built from all of them).

    .venv/bin/python bench/cli_startup.py [--runs 7]

Each measurement is a fresh interpreter that builds the parser and exits, so it
includes Python's own start. Prints the median seconds per command and for the
baseline. No broker needed.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from tokenbudget.cli import COMMANDS

ONE_COMMAND = "from tokenbudget import cli; cli.build_parser([{name!r}])"
EVERY_COMMAND = "from tokenbudget import cli; cli.build_parser()"


def seconds(code: str, runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    baseline = seconds(EVERY_COMMAND, args.runs)
    print(f"every command's module (baseline): {baseline:.3f} s")
    for name in COMMANDS:
        own = seconds(ONE_COMMAND.format(name=name), args.runs)
        print(f"{name:<10} own module only: {own:.3f} s ({baseline - own:+.3f} s saved)")


if __name__ == "__main__":
    main()
