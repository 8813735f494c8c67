"""How long the ``tokenbudget`` command takes to start, importing only the named
command's module (what ``tokenbudget.cli`` does) against importing every command's
module (the baseline: one parser built from all of them).

    .venv/bin/python bench/cli_startup.py [--runs 7]

Each measurement is a fresh interpreter that builds the parser and exits, so it
includes Python's own start. Prints the median seconds per command and for the
baseline. No broker needed.

Then how long ``tokenbudget run`` takes to refuse a config that cannot run (a
dataset file that does not exist): the whole command, against the same check made
after importing the pipeline's modules first (the baseline: how ``run`` did it
before its check moved ahead of those imports).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tokenbudget.cli import COMMANDS

ONE_COMMAND = "from tokenbudget import cli; cli.build_parser([{name!r}])"
EVERY_COMMAND = "from tokenbudget import cli; cli.build_parser()"


REFUSED_CONFIG = """
[kafka]
bootstrap = "127.0.0.1:1"
[inference]
url = "http://127.0.0.1:1"
[[datasets]]
name = "A"
path = "missing.jsonl"
budget = "3k"
"""
# The check as run made it before: with the runner (and so Faust, aiokafka, the
# dispatcher) imported first.
CHECK_AFTER_IMPORTS = (
    "import sys; import tokenbudget.app.runner, tokenbudget.app.plan; "
    "from tokenbudget import cli; sys.exit(cli.main(['run', '--config', {path!r}]))"
)
CHECK_FIRST = (
    "import sys; from tokenbudget import cli; sys.exit(cli.main(['run', '--config', {path!r}]))"
)


def seconds(code: str, runs: int, expect: int = 0) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True)
        times.append(time.perf_counter() - started)
        if done.returncode != expect:
            raise SystemExit(f"exit {done.returncode}, not {expect}: {done.stderr.decode()}")
    return statistics.median(times)


def refusal(runs: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "job.toml")
        Path(path).write_text(REFUSED_CONFIG)
        after = seconds(CHECK_AFTER_IMPORTS.format(path=path), runs, expect=2)
        now = seconds(CHECK_FIRST.format(path=path), runs, expect=2)
    print(f"run refusing a missing dataset file: {now:.3f} s (after the imports: {after:.3f} s)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    baseline = seconds(EVERY_COMMAND, args.runs)
    print(f"every command's module (baseline): {baseline:.3f} s")
    for name in COMMANDS:
        own = seconds(ONE_COMMAND.format(name=name), args.runs)
        print(f"{name:<10} own module only: {own:.3f} s ({baseline - own:+.3f} s saved)")
    refusal(args.runs)


if __name__ == "__main__":
    main()
