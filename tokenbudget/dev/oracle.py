"""An independent judge of a job's output: the inference servers' own request logs
(one per server of the fleet) and the dataset files say what was generated and what
should have been; the Parquet files say what was kept. Nothing here reads the
ledger's books, except the optional cross-check that every row has exactly one
recorded outcome.

Used by the fault tests and the chaos harness (developer tools; the product does not
import it). What it checks, per dataset:

* every Parquet row is an answer the server produced (same request id), with the
  server's count and token ids (a crc32 of them): a row cut shorter (a claim or a
  lowered budget cut it at the line) is counted apart;
* no request id and no prompt id is kept twice;
* tokens kept never exceed the budget (overshoot);
* a dataset that kept less than its budget had nothing to stop it: every valid row of
  its file is kept (else it is *lost*);
* waste: tokens the server generated (aborted, reset or dropped answers included)
  that are not kept.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from tokenbudget.core.errors import DatasetError
from tokenbudget.producers.prompts.datasets import read_prompts


@dataclass(frozen=True)
class ServerAnswer:
    rid: str
    completion_tokens: int
    output_crc: int
    finish: str
    fault: str
    received_at: float
    finished_at: float


def read_server_log(path: Path | Sequence[Path]) -> dict[str, ServerAnswer]:
    """The simulator's request log (``--log-file``), or several servers' together, by
    request id; a request id a server saw twice (a retry that reused it) keeps its
    answer, not its fault."""
    answers: dict[str, ServerAnswer] = {}
    paths = [path] if isinstance(path, Path) else list(path)
    for line in (line for p in paths if p.exists() for line in p.read_text().splitlines()):
        if not line.strip():
            continue
        raw = json.loads(line)
        answer = ServerAnswer(
            rid=raw["rid"],
            completion_tokens=int(raw["completion_tokens"]),
            output_crc=int(raw.get("output_crc", 0)),
            finish=raw["finish"],
            fault=raw.get("fault", ""),
            received_at=float(raw["received_at"]),
            finished_at=float(raw["finished_at"]),
        )
        previous = answers.get(answer.rid)
        if previous is None or previous.finish == "fault":
            answers[answer.rid] = answer
    return answers


@dataclass(frozen=True)
class Room:
    """A request as the server saw it: the room it was sent with and what it needed."""

    rid: str
    text_head: str
    max_new_tokens: int  # as sent
    natural_tokens: int  # the answer's length had nothing stopped it


def rooms(path: Path) -> list[Room]:
    """Every generation request in the simulator's log (``--log-file``), faults left out."""
    found = []
    for line in path.read_text().splitlines():
        raw = json.loads(line) if line.strip() else None
        if raw is None or raw.get("finish") == "fault":
            continue
        found.append(
            Room(raw["rid"], raw["text_head"], raw["max_new_tokens"], raw["natural_tokens"])
        )
    return found


def cut_by_budget(requests: list[Room], max_new_tokens: int) -> list[Room]:
    """Requests sent with less room than their answer needed, below the dataset's own
    ``max_new_tokens`` (which would have cut them anyway): the answers the budget cut."""
    return [r for r in requests if r.max_new_tokens < min(r.natural_tokens, max_new_tokens)]


def peak_in_flight(path: Path, marker: str = "") -> int:
    """The most requests the simulator had at once (those whose text starts with
    ``marker``), from its request log (``--log-file``), faults left out."""
    edges = []
    for line in path.read_text().splitlines():
        raw = json.loads(line) if line.strip() else None
        if raw is None or raw.get("finish") == "fault" or not raw["text_head"].startswith(marker):
            continue
        edges += [(raw["received_at"], 1), (raw["finished_at"], -1)]
    peak = now = 0
    for _, step in sorted(edges):
        now += step
        peak = max(peak, now)
    return peak


def text_crc(text: str | None) -> int:
    """The crc32 of a text's UTF-8, as the simulator logs a prompt, an answer or a
    reasoning (0 for none)."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) if text else 0


def ids_crc(ids: Any) -> int:
    array = np.asarray(ids, dtype="<i4")
    return zlib.crc32(array.tobytes()) if array.size else 0


def valid_prompt_ids(name: str, path: Path) -> set[str]:
    bad: list[DatasetError] = []
    return {row.prompt_id for row in read_prompts(name, path, on_bad_row=bad.append)}


@dataclass
class DatasetVerdict:
    budget: int
    rows: int  # valid rows in the file
    kept_rows: int = 0
    kept_tokens: int = 0
    lost: int = 0  # rows never kept although the budget was not reached

    @property
    def overshoot(self) -> int:
        return max(0, self.kept_tokens - self.budget)


@dataclass
class Verdict:
    datasets: dict[str, DatasetVerdict] = field(default_factory=dict)
    rows_not_from_server: int = 0  # no server answer with the row's request id
    rows_unlike_server: int = 0  # count or ids differ from the server's answer
    cut_rows: int = 0  # kept shorter than the server's answer, at the line
    duplicate_requests: int = 0
    duplicate_prompts: int = 0
    unknown_prompts: int = 0  # kept rows whose prompt is in no dataset file
    generated_tokens: int = 0  # by the server, every answer included
    outcome_problems: int | None = None  # rows without exactly one recorded outcome

    @property
    def kept_tokens(self) -> int:
        return sum(d.kept_tokens for d in self.datasets.values())

    @property
    def waste(self) -> int:
        return max(0, self.generated_tokens - self.kept_tokens)

    @property
    def overshoot(self) -> int:
        return sum(d.overshoot for d in self.datasets.values())

    @property
    def lost(self) -> int:
        return sum(d.lost for d in self.datasets.values())

    @property
    def duplicates(self) -> int:
        return self.duplicate_requests + self.duplicate_prompts

    @property
    def ok(self) -> bool:
        return (
            self.overshoot == 0
            and self.lost == 0
            and self.duplicates == 0
            and self.rows_not_from_server == 0
            and self.rows_unlike_server == 0
            and self.unknown_prompts == 0
            and not self.outcome_problems
        )

    def lines(self) -> list[str]:
        out = [
            f"{'dataset':<22}{'budget':>10}{'rows':>7}{'kept':>7}{'tokens':>10}{'over':>7}"
            f"{'lost':>6}"
        ]
        for name, d in self.datasets.items():
            out.append(
                f"{name:<22}{d.budget:>10,}{d.rows:>7}{d.kept_rows:>7}{d.kept_tokens:>10,}"
                f"{d.overshoot:>7,}{d.lost:>6}"
            )
        out.append(
            f"from the server log: lost {self.lost}, duplicated {self.duplicates}, "
            f"overshoot {self.overshoot:,}, rows not from the server {self.rows_not_from_server}, "
            f"rows unlike the server's answer {self.rows_unlike_server}, cut at the line "
            f"{self.cut_rows}; generated {self.generated_tokens:,}, kept {self.kept_tokens:,}, "
            f"waste {self.waste:,}"
            + (
                f"; rows without exactly one outcome {self.outcome_problems}"
                if self.outcome_problems is not None
                else ""
            )
        )
        return out


def kept_request_ids(parquet_root: Path) -> set[str]:
    """The request ids of every kept row."""
    return {
        rid
        for file in sorted(parquet_root.glob("dataset=*/*.parquet"))
        for rid in pq.read_table(file, columns=["request_id"]).column("request_id").to_pylist()
    }


def judge(
    parquet_root: Path,
    server_log: Path | Sequence[Path],
    datasets: dict[str, tuple[Path, int]],
    outcomes: dict[str, str] | None = None,
) -> Verdict:
    """``datasets``: name -> (file, budget); ``server_log``: the server's request log,
    or every server's of the fleet. ``outcomes`` (optional): the ledger's prompt ->
    outcome records, to check every valid row has exactly one."""
    answers = read_server_log(server_log)
    verdict = Verdict(generated_tokens=sum(a.completion_tokens for a in answers.values()))
    valid = {name: valid_prompt_ids(name, path) for name, (path, _) in datasets.items()}
    rows: list[dict[str, Any]] = []
    for file in sorted(parquet_root.glob("dataset=*/*.parquet")):
        rows += pq.read_table(
            file,
            columns=["request_id", "prompt_id", "dataset", "completion_tokens", "output_ids"],
        ).to_pylist()
    verdict.duplicate_requests = _repeats(r["request_id"] for r in rows)
    verdict.duplicate_prompts = _repeats(r["prompt_id"] for r in rows)
    for row in rows:
        _check_row(verdict, row, answers.get(row["request_id"]))
    for name, (_, budget) in datasets.items():
        mine = [r for r in rows if r["dataset"] == name]
        kept = {r["prompt_id"] for r in mine}
        d = DatasetVerdict(budget=budget, rows=len(valid[name]), kept_rows=len(mine))
        d.kept_tokens = sum(r["completion_tokens"] for r in mine)
        verdict.unknown_prompts += len(kept - valid[name])
        if d.kept_tokens < budget:
            d.lost = len(valid[name] - kept)
        verdict.datasets[name] = d
    if outcomes is not None:
        every = set().union(*valid.values()) if valid else set()
        verdict.outcome_problems = len(every - set(outcomes)) + len(set(outcomes) - every)
    return verdict


def _repeats(values: Any) -> int:
    return sum(n - 1 for n in Counter(values).values())


def _check_row(verdict: Verdict, row: dict[str, Any], answer: ServerAnswer | None) -> None:
    if answer is None or (answer.finish == "fault" and answer.completion_tokens == 0):
        verdict.rows_not_from_server += 1
        return
    tokens, ids = row["completion_tokens"], row["output_ids"] or []
    if tokens < answer.completion_tokens:
        verdict.cut_rows += 1
        if ids and len(ids) != tokens:
            verdict.rows_unlike_server += 1
        return
    same_ids = not ids or ids_crc(ids) == answer.output_crc
    if tokens != answer.completion_tokens or not same_ids:
        verdict.rows_unlike_server += 1
