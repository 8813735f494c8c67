"""Chaos: jobs hit by faults from outside, graded by the server's own request log.

    .venv/bin/python bench/chaos.py [--faults 100] [--per-job 6] [--outage-every 25]
                                    [--outage-s 60] [--seed 7] [--workdir DIR] [--json]

Runs ``tokenbudget run --dispatchers 2`` jobs on a broker of its own against the
simulator failing 10% of requests (429, 503, 500, streams reset half way). Job 0
runs without faults (the baseline). In the others, faults are placed one at a time,
spread over each job's phases: SIGKILL of ``run`` itself (then the same command
again), of its ledger, of an extra dispatcher, of the broker's JVM; the ledger
frozen (SIGSTOP) for twice the lease TTL; and every ``--outage-every`` faults a
server outage of ``--outage-s`` seconds. Prints, from the server's request log and
the dataset files: lost, duplicated, overshoot; orphans; unexpected crashes; faults
per phase; waste against the work in flight at the faults. Exits 1 unless all are 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
from pathlib import Path

from tokenbudget.dev.chaos import ChaosSettings, run_chaos


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--per-job", type=int, default=6)
    parser.add_argument("--outage-every", type=int, default=25)
    parser.add_argument("--outage-s", type=float, default=60.0)
    parser.add_argument("--fault-share", type=float, default=0.10)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--workdir", help="keep data, logs and Parquet here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    # Stopped from outside: clean up (the broker, the jobs' processes) on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("tokenbudget.dev.chaos").setLevel(logging.INFO)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # the broker is killed on purpose
    with tempfile.TemporaryDirectory(prefix="tokenbudget-chaos-") as scratch:
        settings = ChaosSettings(
            workdir=Path(args.workdir or scratch),
            faults=args.faults,
            per_job=args.per_job,
            outage_every=args.outage_every,
            outage_s=args.outage_s,
            fault_share=args.fault_share,
            seed=args.seed,
        )
        report = run_chaos(settings)
    print(report.to_json() if args.json else "\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
