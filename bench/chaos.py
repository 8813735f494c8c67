"""Chaos: kill every component at random moments, restart the broker, break the server.

    .venv/bin/python bench/chaos.py [--cycles 20] [--seed 7] [--budget 300000]
                                    [--fault-share 0.08] [--dispatchers 2] [--json]

Runs the demo's eight datasets as separate processes (ledger, dispatchers, sink,
producer) on a broker of its own (temporary home, free ports), against the
simulator failing ``--fault-share`` of requests (5xx, hang, reset, cut-off JSON,
evenly). Every few seconds one component is SIGKILLed and started again; halfway,
the broker is restarted. Then it checks and prints, per dataset and in total:
prompts in, outcomes out per kind, lost, duplicated request_ids in Parquet, ledger
totals against Parquet totals, overshoot. Exits 1 unless lost = 0, duplicates = 0,
overshoot = 0 and every component stopped cleanly on SIGTERM at the end.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

from tokenbudget.chaos import ChaosSettings, report_json, run_chaos


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=20)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--budget", type=int, default=300_000, help="per dataset")
    parser.add_argument("--fault-share", type=float, default=0.08)
    parser.add_argument("--dispatchers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32, help="per dispatcher")
    parser.add_argument("--workdir", help="keep data, logs and Parquet here")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", stream=sys.stderr)
    logging.getLogger("tokenbudget.chaos").setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="tokenbudget-chaos-") as scratch:
        settings = ChaosSettings(
            workdir=Path(args.workdir or scratch),
            cycles=args.cycles,
            seed=args.seed,
            budget=args.budget,
            fault_share=args.fault_share,
            dispatchers=args.dispatchers,
            concurrency=args.concurrency,
        )
        report = run_chaos(settings)
    print(report_json(report) if args.json else "\n".join(report.lines()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
