"""``tokenbudget plan``: what each budget will buy, told before it is spent.

Per dataset it reads every prompt a run would send (in the order it would send
them), the answers already kept under ``[sink] path`` (earlier runs of the job,
which a run resumes past), and, with ``--pilot N``, sends up to N prompts of each
dataset that has no such answers yet, as a real job: the pilot is
:func:`~tokenbudget.app.runner.run_async` on the same config with ``limit``
lowered, so its answers are counted by the ledger against the budget, kept as
ordinary rows, and skipped by the run that follows (it resumes past them).
:mod:`tokenbudget.app.estimate` does the arithmetic; this gathers and prints.

``run`` prints the same plan, one line per dataset, from the earlier rows only (no
pilot, no tokenizer), and saves it beside the output for ``status``; when it ends,
:func:`kept_report` shows what the budgets kept beside their sources.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from tokenbudget.app import estimate
from tokenbudget.app.estimate import DatasetPlan, Known, Spread
from tokenbudget.app.runner import run_async
from tokenbudget.app.saved_plan import needed_text, save
from tokenbudget.app.status import format_eta
from tokenbudget.app.tables import format_table
from tokenbudget.core.config import Config, Dataset
from tokenbudget.core.errors import DatasetError
from tokenbudget.producers.prompts.dataset_checks import check_datasets
from tokenbudget.producers.prompts.datasets import read_options, read_prompts
from tokenbudget.producers.prompts.order import prompt_length
from tokenbudget.producers.templates import config_tokenizer
from tokenbudget.sinks.parquet import output_files
from tokenbudget.streams import budget as policy

ROW_COLUMNS = (
    "prompt_id",
    "prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "max_new_tokens",
    "dispatched_at",
    "finished_at",
)


# ---- what is known -------------------------------------------------------------------


@dataclass(frozen=True)
class Prompts:
    """Every prompt a run of a dataset would send, in order: ids, characters, and
    tokens when a tokenizer counted them."""

    ids: tuple[str, ...]
    lengths: tuple[int, ...]
    tokens: tuple[int, ...] | None
    bad_rows: int


def read_dataset(config: Config, dataset: Dataset, *, count_tokens: bool) -> Prompts:
    """Read the prompts as the producer would (turns, n, limit, order; bad rows
    skipped and counted, whatever ``on_bad_row`` says: a plan reports them, and with
    ``"fail"`` the producer stops the run at the first, naming its dataset). ``count_tokens``:
    count each prompt with ``[inference] tokenizer`` (the chat template applied for
    ``template = true``), when one is configured; else no tokenizer is loaded."""
    bad = 0

    def bad_row(exc: DatasetError) -> None:
        nonlocal bad
        bad += 1

    tokenizer = None
    if count_tokens:
        tokenizer = config_tokenizer(config)
    if tokenizer is None:
        dataset = msgspec.structs.replace(dataset, template=False)
    ids: list[str] = []
    lengths: list[int] = []
    tokens: list[int] = []
    rows = read_prompts(
        dataset.name,
        dataset.path,
        on_bad_row=bad_row,
        limit=dataset.limit,
        **read_options(config, dataset),
    )
    for row in rows:
        ids.append(row.prompt_id)
        lengths.append(prompt_length(row.text, row.messages))
        if row.input_ids is not None:
            tokens.append(len(row.input_ids))
        elif tokenizer is not None:
            tokens.append(tokenizer.count_prompt(row.text, row.messages))
    counted = tuple(tokens) if tokenizer is not None else None
    return Prompts(tuple(ids), tuple(lengths), counted, bad)


def earlier_rows(root: Path, dataset: str) -> pa.Table:
    """The rows kept for ``dataset`` under the sink's ``root`` (only the columns a
    plan reads)."""
    files = output_files(root, dataset)
    tables = [pq.read_table(file, columns=list(ROW_COLUMNS)) for file in files]
    if not tables:
        return pa.table({name: pa.array([], pa.float64()) for name in ROW_COLUMNS})
    return pa.concat_tables(tables, promote_options="permissive")


@dataclass(frozen=True)
class Answers:
    """What a dataset's kept rows say: how many, their cost, and the answers among
    them that ended on their own."""

    done: int = 0
    spent: int = 0
    completion_tokens: tuple[int, ...] = ()
    prompt_tokens: tuple[int, ...] = ()
    costs: tuple[int, ...] = ()
    spans: tuple[tuple[float, float, int], ...] = ()  # (dispatched, finished, tokens)


def answers_of(config: Config, dataset: Dataset, rows: pa.Table) -> Answers:
    """An answer cut short (finish ``length`` under a max_new_tokens the budget
    lowered, or ``abort``) only says it was longer: it counts as kept, not as a
    length. Lengths are capped at the dataset's max_new_tokens (a config that
    lowered it since)."""
    unit = config.budget.unit
    cap = dataset.max_new_tokens
    done = spent = 0
    completion: list[int] = []
    prompt: list[int] = []
    costs: list[int] = []
    spans: list[tuple[float, float, int]] = []
    for row in rows.to_pylist():
        tokens, prompt_tokens = int(row["completion_tokens"]), int(row["prompt_tokens"])
        done += 1
        spent += policy.unit_cost(unit, prompt_tokens, tokens)
        if row["dispatched_at"] is not None and row["finished_at"] is not None:
            spans.append((float(row["dispatched_at"]), float(row["finished_at"]), tokens))
        finish, asked = row["finish_reason"], row["max_new_tokens"]
        if finish == "abort" or (finish == "length" and asked is not None and asked < cap):
            continue
        completion.append(min(tokens, cap))
        prompt.append(prompt_tokens)
        costs.append(policy.unit_cost(unit, prompt_tokens, min(tokens, cap)))
    return Answers(done, spent, tuple(completion), tuple(prompt), tuple(costs), tuple(spans))


def known(
    config: Config, dataset: Dataset, prompts: Prompts, answers: Answers, source: str
) -> Known:
    return Known(
        dataset=dataset.name,
        budget=dataset.budget,
        unit=config.budget.unit,
        available=len(prompts.ids),
        bad_rows=prompts.bad_rows,
        prompt_lengths=prompts.lengths,
        prompt_tokens=prompts.tokens,
        done=answers.done,
        spent=answers.spent,
        completion_tokens=answers.completion_tokens,
        server_prompt_tokens=answers.prompt_tokens,
        costs=answers.costs,
        answers_from=source if answers.completion_tokens else "",
    )


# ---- the plan ------------------------------------------------------------------------


@dataclass
class Plan:
    datasets: list[DatasetPlan]
    tokens_per_s: float | None  # the server's, measured on the rows (all datasets)
    measured_on: int = 0  # rows with timings the throughput was measured on
    piloted: list[str] = field(default_factory=list)  # datasets a pilot was sent for
    pilot_requests: int = 0
    boundary: str = ""  # how the end of a budget moves the count (boundary_effect)

    def to_json(self) -> dict[str, Any]:
        return {
            "datasets": {p.dataset: dataclasses.asdict(p) for p in self.datasets},
            "tokens_per_s": self.tokens_per_s,
            "measured_on": self.measured_on,
            "piloted": self.piloted,
            "pilot_requests": self.pilot_requests,
            "boundary": self.boundary,
        }


def pilot_config(config: Config, datasets: Sequence[Dataset], requests: int) -> Config:
    """The job limited to ``requests`` requests of each of ``datasets`` (the first
    prompts in the order the run sends them; ``n`` answers each count)."""
    limited = []
    for dataset in datasets:
        prompts = max(1, math.ceil(requests / dataset.n))
        limit = prompts if dataset.limit is None else min(prompts, dataset.limit)
        limited.append(msgspec.structs.replace(dataset, limit=limit))
    return msgspec.structs.replace(config, datasets=tuple(limited))


def read_datasets(config: Config, *, count_tokens: bool) -> dict[str, Prompts]:
    return {d.name: read_dataset(config, d, count_tokens=count_tokens) for d in config.datasets}


def known_plan(
    config: Config,
    prompts: dict[str, Prompts],
    *,
    piloted: Sequence[str] = (),
    pilot_requests: int = 0,
) -> Plan:
    """The plan from what is known now: the datasets' ``prompts`` and the rows
    under the sink path (``piloted``: the datasets whose rows a pilot just gave)."""
    answers = {d.name: _answers(config, d) for d in config.datasets}
    spans = [span for a in answers.values() for span in a.spans]
    rate = estimate.busy_rate(spans)
    plans = [
        estimate.estimate(
            known(
                config,
                d,
                prompts[d.name],
                answers[d.name],
                "pilot" if d.name in piloted else "earlier rows",
            ),
            rate,
        )
        for d in config.datasets
    ]
    piloted_names = sorted(piloted)
    pilot = pilot_requests if piloted else 0
    return Plan(plans, rate, len(spans), piloted_names, pilot, boundary_effect(config))


def boundary_effect(config: Config) -> str:
    """What the end of a budget does to the count of prompts, which the estimate
    (whole answers) leaves out: it depends on the answers in flight then."""
    if not policy.unit_rule(config.budget.unit).in_tokens:
        return ""  # one per answer: the count is exact
    if not policy.reserves(config.budget.admission):
        return "the answers in flight at the halt are kept beyond the budget: a few more prompts"
    if config.budget.on_boundary == "finish":
        return (
            "a request goes out only while its max_new_tokens fits: a run stops short of"
            " the budget, a few prompts fewer"
        )
    grows = config.budget.reserve == "grow"
    if config.budget.cut == "last" and not grows:
        return (
            "the one answer at a budget's line is cut at the line and kept in part: a run"
            " sends a prompt more"
        )
    if config.budget.cut == "last":
        return (
            "the answers that outgrow a budget's end (few) are cut at the line and kept in"
            " part: a run sends a few more prompts"
        )
    if grows:
        return (
            "every answer in flight when a budget is spent is cut at the line and kept in"
            " part: a run sends up to `concurrency` more prompts per dataset"
        )
    return (
        "the answers in flight when a budget runs out are cut at the line and kept in"
        " part: a run sends a few more prompts"
    )


async def make_plan(config: Config, *, pilot: int = 0, count_tokens: bool = True) -> Plan:
    """The plan of every dataset of ``config``. With ``pilot`` > 0, datasets without
    answers under the sink path are sent ``pilot`` requests each first (see the
    module docstring). ``count_tokens``: count prompts with the tokenizer."""
    await asyncio.to_thread(check_datasets, config)
    # Every prompt is read before a pilot spends anything: a bad file stops here.
    prompts = await asyncio.to_thread(read_datasets, config, count_tokens=count_tokens)
    lacking = [d for d in config.datasets if not _answers(config, d).completion_tokens]
    if pilot <= 0 or not lacking:
        return await asyncio.to_thread(known_plan, config, prompts)
    names = [d.name for d in lacking]
    print(
        f"tokenbudget: pilot: up to {pilot} requests to"
        f" {', '.join(server.url for server in config.servers)} for"
        f" {', '.join(names)}; their answers are counted against the budgets and kept in"
        f" {config.sink_path}",
        file=sys.stderr,
    )
    await run_async(pilot_config(config, lacking, pilot), progress="off")
    return await asyncio.to_thread(known_plan, config, prompts, piloted=names, pilot_requests=pilot)


def _answers(config: Config, dataset: Dataset) -> Answers:
    return answers_of(config, dataset, earlier_rows(config.sink_path, dataset.name))


# ---- how it reads ------------------------------------------------------------------------


def outcome_text(p: DatasetPlan) -> str:
    if p.outcome == "runs out":
        return f"runs out at {p.available:,}" + (f" (keeps ~{p.keeps:,})" if p.keeps else "")
    if p.outcome == "may run out":
        return f"may run out at {p.available:,}"
    return p.outcome


def _answer_text(answers: Spread | None) -> str:
    if answers is None:
        return "unknown"
    return f"{answers.mean:,.0f} ({answers.p10:,.0f}-{answers.p90:,.0f})"


def _from_text(p: DatasetPlan) -> str:
    return "-" if p.answers is None else f"{p.answers_from} ({p.answers.count})"


def _prompt_tokens_text(p: DatasetPlan) -> str:
    if p.prompt_tokens is None:
        return "unknown"
    return f"~{p.prompt_tokens:,}" if p.prompt_tokens_from == "server" else f"{p.prompt_tokens:,}"


def _time_text(p: DatasetPlan) -> str:
    if p.seconds is None:
        return "unknown"
    return "<1s" if 0 < p.seconds < 1 else format_eta(p.seconds)


HEADERS = [
    "dataset",
    "budget",
    "prompts",
    "prompt_tokens",
    "answer_tokens (p10-p90)",
    "answers from",
    "needed (10-90%)",
    "outcome",
    "time",
]


def table(plan: Plan) -> str:
    rows = [
        [
            p.dataset,
            f"{p.budget:,}",
            f"{p.available:,}",
            _prompt_tokens_text(p),
            _answer_text(p.answers),
            _from_text(p),
            needed_text(p.needed, p.needed_low, p.needed_high),
            outcome_text(p),
            _time_text(p),
        ]
        for p in plan.datasets
    ]
    lines = [format_table(HEADERS, rows), "", *notes(plan), "", *kept_lines(plan.datasets)]
    return "\n".join(lines)


def notes(plan: Plan) -> list[str]:
    out = []
    if plan.tokens_per_s is None:
        out.append("time: unknown (no rows with timings under the sink path; --pilot N measures)")
    else:
        seconds = [p.seconds for p in plan.datasets if p.seconds is not None]
        job = ""
        if len(seconds) == len(plan.datasets):
            job = f"; the job, its datasets sharing the server: ~{format_eta(sum(seconds))}"
        out.append(
            f"time: at {plan.tokens_per_s:,.0f} completion tokens/s, the server's throughput"
            f" measured on {plan.measured_on:,} rows (all datasets together){job}"
        )
    if plan.boundary:
        out.append(f"needed: whole answers; {plan.boundary}")
    if plan.piloted:
        out.append(
            f"pilot: up to {plan.pilot_requests} requests each for {', '.join(plan.piloted)},"
            " kept as rows and counted against the budgets"
        )
    unknown = [p.dataset for p in plan.datasets if p.answers is None]
    if unknown:
        out.append(
            f"unknown answer lengths ({', '.join(unknown)}): no earlier rows;"
            " `tokenbudget plan --pilot N` sends N requests each to measure them"
        )
    bad = [f"{p.dataset} {p.bad_rows:,}" for p in plan.datasets if p.bad_rows]
    if bad:
        out.append(f"bad rows, skipped: {', '.join(bad)}")
    tokens = {p.prompt_tokens_from for p in plan.datasets}
    if "server" in tokens:
        out.append("~prompt_tokens: the server's mean count over the rows, times the prompts")
    return out


def _quartiles(s: Spread | None) -> str:
    return "-" if s is None else "/".join(f"{q:,.0f}" for q in s.quartiles)


def kept_lines(plans: Sequence[DatasetPlan]) -> list[str]:
    """The prompts the budget keeps against all of them: prompt length (characters)
    quartiles, and how far apart they are (Kolmogorov-Smirnov)."""
    rows = []
    warnings = []
    for p in plans:
        kept = p.kept_prompt_length
        distance = p.kept_distance
        rows.append(
            [
                p.dataset,
                _quartiles(p.prompt_length),
                _quartiles(kept),
                "-" if distance is None else f"{distance:.3f}",
                _quartiles(p.answers),
            ]
        )
        if distance is not None and kept is not None and p.prompt_length is not None:
            bound = estimate.random_sample_distance(kept.count, p.prompt_length.count)
            if distance > bound:
                warnings.append(
                    f"{p.dataset}: the prompts its budget keeps differ from the rest (KS"
                    f" {distance:.2f}; a random sample of {kept.count:,} would be within"
                    f' {bound:.2f}): set order = "stratified"'
                )
    headers = [
        "dataset",
        "prompt chars p25/p50/p75: all",
        "kept",
        "KS",
        "answer tokens p25/p50/p75",
    ]
    return [format_table(headers, rows), *warnings]


def line(p: DatasetPlan, tokens_per_s: float | None) -> str:
    """The plan of one dataset in one line (``run`` prints these when it starts)."""
    head = f"tokenbudget: plan: {p.dataset}: {p.available:,} prompts"
    if p.done:
        head += f" ({p.done:,} done)"
    if p.needed is None:
        return (
            f"{head}; answer length unknown (no earlier rows), so the prompts"
            f" {p.budget:,} {p.unit} need are unknown (`tokenbudget plan --pilot N` measures it)"
        )
    assert p.answers is not None or p.unit == "samples"
    per = "" if p.answers is None else f" at {p.answers.mean:,.0f} tokens per answer"
    from_ = "" if p.answers is None else f" ({p.answers_from}: {p.answers.count:,})"
    text = (
        f"{head}; {p.budget:,} {p.unit} need"
        f" {needed_text(p.needed, p.needed_low, p.needed_high)}{per}{from_}: {outcome_text(p)}"
    )
    if p.seconds is not None and tokens_per_s:
        time = _time_text(p)
        text += f", {time if time.startswith('<') else '~' + time} at {tokens_per_s:,.0f} tokens/s"
    return text


def announce(config: Config) -> None:
    """``run``'s plan, one line per dataset on stderr, from what is already known
    (earlier rows; no pilot, no tokenizer), saved for ``status``."""
    plan = known_plan(config, read_datasets(config, count_tokens=False))
    save(config, plan.to_json())
    for p in plan.datasets:
        print(line(p, plan.tokens_per_s), file=sys.stderr)


# ---- after a run: what the budgets kept ----------------------------------------------


@dataclass(frozen=True)
class Kept:
    """A dataset's kept rows beside its source: prompt lengths (characters) of all
    its prompts and of the kept ones, and the kept answers' lengths (tokens)."""

    dataset: str
    prompts: int
    kept: int
    prompt_length: Spread | None
    kept_prompt_length: Spread | None
    distance: float | None  # Kolmogorov-Smirnov, kept against all
    random_within: float  # what a random sample of as many stays within (99%)
    answers: Spread | None  # completion tokens of the kept rows
    cut: int  # kept rows cut short at a budget's line

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def kept_report(config: Config) -> list[Kept]:
    """What the budgets kept of each dataset, from its rows under the sink path
    (every run's) and its source read again."""
    out = []
    for dataset in config.datasets:
        prompts = read_dataset(config, dataset, count_tokens=False)
        lengths = dict(zip(prompts.ids, prompts.lengths, strict=True))
        table = earlier_rows(config.sink_path, dataset.name)
        rows = table.to_pylist()
        kept = [lengths[r["prompt_id"]] for r in rows if r["prompt_id"] in lengths]
        answers = answers_of(config, dataset, table)
        everything = list(lengths.values())
        out.append(
            Kept(
                dataset=dataset.name,
                prompts=len(everything),
                kept=len(rows),
                prompt_length=estimate.spread(everything),
                kept_prompt_length=estimate.spread(kept),
                distance=estimate.ks_distance(kept, everything) if kept else None,
                random_within=estimate.random_sample_distance(len(kept), len(everything)),
                answers=estimate.spread(r["completion_tokens"] for r in rows),
                cut=answers.done - len(answers.completion_tokens),
            )
        )
    return out


def kept_table(kept: Sequence[Kept]) -> str:
    headers = [
        "dataset",
        "kept/prompts",
        "prompt chars p25/p50/p75: all",
        "kept",
        "KS (random: within)",
        "answer tokens p25/p50/p75",
        "cut",
    ]
    rows = [
        [
            k.dataset,
            f"{k.kept:,}/{k.prompts:,}",
            _quartiles(k.prompt_length),
            _quartiles(k.kept_prompt_length),
            "-" if k.distance is None else f"{k.distance:.3f} ({k.random_within:.3f})",
            _quartiles(k.answers),
            f"{k.cut:,}",
        ]
        for k in kept
    ]
    return "what the budgets kept, beside their sources:\n" + format_table(headers, rows)
