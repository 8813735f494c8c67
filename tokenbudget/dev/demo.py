"""``make demo``: eight datasets modelled on the run that motivated tokenbudget.

B2 has long code answers (mean 3,793 tokens), B6/B7 ~1,500-token chat answers, the
others sit in between or below; B8 has too few prompts to reach its budget, so it
ends exhausted rather than halted. Every dataset gets the same token budget, as in
the motivating run, and the table shows beside the result what a sample cap chosen
from the average answer length would have kept instead.

B7 holds chat messages, and /generate takes raw text: its chat template is applied
here (``template = true``) with a tiny tokenizer the demo builds offline, as a real
run does with the model's own tokenizer folder.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from tokenbudget.app.children import cli_command
from tokenbudget.app.report import Column, run_table
from tokenbudget.app.run_report import RunReport
from tokenbudget.app.runner import run
from tokenbudget.app.tables import percent
from tokenbudget.core import config as config_module
from tokenbudget.core import lifetime
from tokenbudget.core.errors import TokenBudgetError
from tokenbudget.dev import tiny_tokenizer
from tokenbudget.dev.ports import free_port


@dataclass(frozen=True)
class DemoDataset:
    name: str
    marker: str  # picks the simulator's length distribution
    mean_tokens: int
    chat: bool = False
    rows: int | None = None  # None: enough to reach the budget


DEMO_DATASETS = (
    DemoDataset("B1_codealpaca", "#code", 1200),
    DemoDataset("B2_opencodeinstruct", "#long-code", 3793),
    DemoDataset("B3_math", "#math", 2200),
    DemoDataset("B4_reasoning", "#reasoning", 3000),
    DemoDataset("B5_short_qa", "#short", 300),
    DemoDataset("B6_chat", "#chat", 1500),
    DemoDataset("B7_sharegpt_chat", "#chat", 1500, chat=True),
    DemoDataset("B8_small_code", "#code", 1200, rows=40),
)
DEMO_BUDGET = 400_000
CONCURRENCY = 64
MAX_NEW_TOKENS = 8192
TOKENS_PER_SECOND = 6000.0


def write_datasets(folder: Path, budget: int) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for d in DEMO_DATASETS:
        count = d.rows or math.ceil(1.5 * budget / d.mean_tokens) + 20
        path = folder / f"{d.name}.jsonl"
        with path.open("w") as handle:
            for i in range(count):
                text = f"{d.marker} {d.name} task {i}: write a detailed answer about item {i}."
                row: dict[str, object] = {"id": f"{d.name}-{i}"}
                if d.chat:
                    row["messages"] = [
                        {"role": "system", "content": "You are a helpful assistant."},
                        {"role": "user", "content": text},
                    ]
                else:
                    row["prompt"] = text
                handle.write(json.dumps(row) + "\n")
        paths[d.name] = path
    return paths


def write_tokenizer(folder: Path, paths: dict[str, Path]) -> Path:
    """A tiny tokenizer with a chat template for the chat datasets, built offline.

    Trained on their own prompts, so every prompt gets distinct ids; the simulator's
    markers stay whole words, so the simulator, decoding the ids, still gives each
    dataset its length distribution."""
    chats = [paths[d.name] for d in DEMO_DATASETS if d.chat and d.name in paths]
    return tiny_tokenizer.build_tokenizer(
        folder,
        [*tiny_tokenizer.CORPUS, *tiny_tokenizer.dataset_corpus(chats)],
        whole_words=sorted({d.marker for d in DEMO_DATASETS}, key=len, reverse=True),
    )


def start_simulator(
    port: int, tokens_per_second: float, tokenizer: Path | None = None
) -> subprocess.Popen[bytes]:
    command = cli_command(
        "simulate",
        "--port",
        str(port),
        "--profile",
        "demo",
        "--tokens-per-second",
        str(tokens_per_second),
        *(["--tokenizer", str(tokenizer)] if tokenizer is not None else []),
    )
    process = lifetime.spawn(command)
    wait_for_simulator(process, port)
    return process


def wait_for_simulator(
    process: subprocess.Popen[bytes], port: int, *, timeout: float = 30, logs: str = ""
) -> None:
    """Wait until the simulator started as ``process`` answers /health on ``port``;
    kill it and raise if it exits or does not answer in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            break
        time.sleep(0.2)
    process.kill()
    raise TokenBudgetError(f"the simulator did not come up on port {port}{logs}")


def write_config(
    workdir: Path, paths: dict[str, Path], port: int, budget: int, tokenizer: Path
) -> Path:
    namespace = f"demo-{int(time.time())}"
    chats = {d.name for d in DEMO_DATASETS if d.chat}
    lines = [
        "[kafka]",
        'bootstrap = "local"',
        f'namespace = "{namespace}"',
        "[inference]",
        f'url = "http://127.0.0.1:{port}"',
        'api = "sglang"',
        f"concurrency = {CONCURRENCY}",
        f"max_new_tokens = {MAX_NEW_TOKENS}",
        f'tokenizer = "{tokenizer}"',
        "[budget]",
        'unit = "completion_tokens"',
        "[sink]",
        'path = "out"',
    ]
    for name, path in paths.items():
        lines += [
            "[[datasets]]",
            f'name = "{name}"',
            f'path = "{path}"',
            f'budget = "{budget // 1000}k"',
            *(["template = true"] if name in chats else []),
        ]
    config_path = workdir / "tokenbudget.toml"
    config_path.write_text("\n".join(lines) + "\n")
    return config_path


def comparison_columns(report: RunReport) -> tuple[int, list[Column]]:
    """The sample cap a user would pick from the pooled average answer length, and
    the run table's columns of what it would have kept per dataset at that
    dataset's own average."""
    samples = sum(r.samples for r in report.datasets.values())
    tokens = sum(r.completion_tokens for r in report.datasets.values())
    budget = max(r.budget for r in report.datasets.values())
    cap = max(1, round(budget / (tokens / samples))) if samples else 0
    means, kept, overshoot = {}, {}, {}
    for name, r in report.datasets.items():
        mean = r.completion_tokens / r.samples if r.samples else 0.0
        capped = round(cap * mean)
        means[name] = f"{mean:,.0f}"
        kept[name] = f"{capped:,}"
        overshoot[name] = percent(capped - r.budget, r.budget)
    return cap, [("avg_answer", means), (f"cap_{cap}_tokens", kept), ("cap_overshoot", overshoot)]


def run_demo(workdir: Path, *, json_output: bool = False, budget: int = DEMO_BUDGET) -> int:
    workdir = workdir.resolve()
    for stale in ("out", "data", "tokenizer"):
        shutil.rmtree(workdir / stale, ignore_errors=True)
    paths = write_datasets(workdir / "data", budget)
    tokenizer = write_tokenizer(workdir / "tokenizer", paths)
    port = free_port()
    simulator = start_simulator(port, TOKENS_PER_SECOND, tokenizer)
    try:
        config = config_module.load(write_config(workdir, paths, port, budget, tokenizer))
        report = run(config, progress=False if json_output else None)
    finally:
        simulator.terminate()
        simulator.wait(10)
    if json_output:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    cap, columns = comparison_columns(report)
    print(run_table(report, columns))
    halt_bound = CONCURRENCY * MAX_NEW_TOKENS
    worst = max(r.overshoot for r in report.datasets.values())
    print(
        f"\ntokenbudget: worst overshoot {worst:,} tokens (reservations allow none;"
        f" halting after the fact would allow concurrency x max_new_tokens = {halt_bound:,});"
        f" a cap of {cap} samples per dataset, chosen from the average answer, would"
        " overshoot long-answer datasets and starve short ones (right-hand columns)."
    )
    print(
        f"{report.seconds:.1f} s; Parquet in {config.sink_path}; broker left running "
        "(`tokenbudget broker down` stops it)"
    )
    return 0
