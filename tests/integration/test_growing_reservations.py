"""Growing reservations (``[budget] reserve = "grow"``) on the real broker, graded
from the simulator's own log (a module of its own, so that the test workers share
the integration tests more evenly)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_reservations import run_one_dataset
from tokenbudget.dev import jobs, oracle

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)
@pytest.mark.parametrize("cut", ["last", "any"])
def test_growing_reservations_fill_the_server_and_keep_the_budget_to_the_token(
    tmp_path: Path, kafka_bootstrap: str, namespace: str, cut: str
) -> None:
    """``[budget] reserve = "grow"``: requests of max_new_tokens 4096 whose answers
    take ~1,200 tokens reserve that much (``last``) or their floor (``any``) and grow
    as they stream. Whole reservations would allow at most budget / 4096 of them in
    flight at once; the server's own log shows more, and the budget is still kept to
    the token, the answers that outgrew its end cut at the line."""
    data = jobs.rows(tmp_path / "code.jsonl", "#code", 600)
    budget = 200_000
    done, verdict, log = run_one_dataset(
        tmp_path,
        kafka_bootstrap,
        namespace,
        ("code", data, budget),
        ("--tokens-per-second", "400"),
        inference={"max_new_tokens": 4096, "concurrency": 64, "stream": True},
        budget={"reserve": "grow", "cut": cut},
    )
    printed = "\n".join(verdict.lines())
    assert verdict.ok, printed  # overshoot 0, each answer kept once, rows as served
    assert verdict.datasets["code"].kept_tokens == budget, printed  # used to the token
    peak = oracle.peak_in_flight(log, "#code")
    assert peak > budget // 4096, peak  # beyond what whole reservations allow
    report = json.loads(done.stdout)["datasets"]["code"]
    assert (report["completion_tokens"], report["status"]) == (budget, "halted")
    if cut == "any":
        # The budget was spent with the server full: what was in flight then is cut.
        aborted = log.read_text().count('"finish":"abort"')
        assert aborted >= 1 and report["cut"] >= 1, (aborted, report["cut"])
