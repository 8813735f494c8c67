"""The short chaos run: one job hit by every kind of fault (SIGKILL of run, of its
ledger, of a dispatcher, of the broker; a frozen ledger; a server outage) on top of a
server failing a tenth of its requests, graded by the server's own request log.
``bench/chaos.py`` is the long version."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenbudget.dev.chaos import FAULTS, PHASES, ChaosSettings, run_chaos

pytestmark = pytest.mark.integration


@pytest.mark.timeout(900)
def test_every_fault_from_outside_loses_nothing_and_overshoots_nothing(tmp_path: Path) -> None:
    settings = ChaosSettings(
        workdir=tmp_path,
        faults=len(FAULTS) + 1,
        per_job=len(FAULTS) + 1,
        outage_every=len(FAULTS) + 1,
        outage_s=6.0,
        baseline=False,
        seed=3,
    )

    report = run_chaos(settings)

    printed = "\n".join(report.lines())
    assert report.ok, printed
    assert set(report.faults) == {*FAULTS, "outage"}, printed
    assert set(report.phases) == set(PHASES), printed
    [job] = report.jobs
    for name, dataset in job.verdict.datasets.items():
        if name != "small":
            assert dataset.kept_tokens == dataset.budget, printed  # used to the token
        else:
            assert dataset.kept_rows == dataset.rows, printed  # every valid row kept
