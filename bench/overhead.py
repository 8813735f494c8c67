"""tokenbudget's generation throughput beside a bare httpx loop, same prompts.

    .venv/bin/python bench/overhead.py [--prompts 3000] [--concurrency 256] [--repeats 2]
                                       [--tokens-per-second 250,2000]

Both send the same prompts, as the same SGLang requests (text, ``max_new_tokens``,
no streaming), through the same HTTP client
(:class:`tokenbudget.producers.inference.http.HttpClient`)
at the same concurrency, each time to a fresh simulator process started the same
way: once as a plain asyncio loop with no Kafka at all, once through
``tokenbudget run`` (producer, Kafka, dispatcher, ledger, sink). Each throughput is
the completion tokens kept (every answer: the budget is never reached) over the
span from the first request sent to the last answer received; start-up of either
is not counted, tokenbudget's ramp-up through Kafka is. The two alternate, the
first of each pair taking turns, so a neighbour's load on a shared machine falls on
both; the ratio is given per pair and as the median with its spread.

Per simulated decode rate (``--tokens-per-second``, per request): at 250 tokens/s
x 256 requests (64k tokens/s, a few GPU nodes) the server is the bottleneck, as in
production; at 2,000 (512k tokens/s nominal) the client's CPU is, and tokenbudget's
Kafka broker, ledger and sink share this machine's cores with its dispatcher while
the bare loop has them to itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pyarrow.parquet as pq

from tokenbudget.app.runner import run
from tokenbudget.core import config as config_module
from tokenbudget.core import lifetime
from tokenbudget.dev.demo import start_simulator
from tokenbudget.dev.ports import free_port
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import BrokerSettings
from tokenbudget.producers.inference.http import HttpClient, Timeouts

T = TypeVar("T")


def write_prompts(path: Path, count: int) -> list[str]:
    prompts = [f"#code overhead task {i}: write a function" for i in range(count)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return prompts


async def bare_loop(
    url: str, prompts: list[str], concurrency: int, max_new: int
) -> tuple[int, float]:
    """What one would write by hand: ``concurrency`` workers sharing a queue, the
    request tokenbudget's SGLang backend sends."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    tokens = 0
    first = last = 0.0
    async with HttpClient(concurrency, Timeouts()) as client:

        async def worker() -> None:
            nonlocal tokens, first, last
            while not queue.empty():
                text = queue.get_nowait()
                body = {
                    "rid": uuid.uuid4().hex,
                    "sampling_params": {"max_new_tokens": max_new},
                    "stream": False,
                    "text": text,
                }
                sent = time.time()
                first = min(first, sent) if first else sent
                reply = await client.request("POST", f"{url}/generate", body)
                if reply.status != 200:
                    raise SystemExit(f"the simulator answered HTTP {reply.status}: {reply.text}")
                tokens += json.loads(reply.content)["meta_info"]["completion_tokens"]
                last = max(last, time.time())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tokens, last - first


def with_simulator(tokens_per_second: float, body: Callable[[str], T]) -> T:
    port = free_port()
    process = start_simulator(port, tokens_per_second)
    try:
        return body(f"http://127.0.0.1:{port}")
    finally:
        lifetime.stop(process, 10)


def through_tokenbudget(url: str, workdir: Path, args: argparse.Namespace) -> tuple[int, float]:
    config_path = workdir / "tokenbudget.toml"
    config_path.write_text(
        "\n".join(
            [
                "[kafka]",
                'bootstrap = "local"',
                f'namespace = "bench-overhead-{uuid.uuid4().hex[:8]}"',
                "[inference]",
                f'url = "{url}"',
                f"concurrency = {args.concurrency}",
                f"max_new_tokens = {args.max_new_tokens}",
                "stream = false",
                "[sink]",
                'path = "out"',
                "[[datasets]]",
                'name = "overhead"',
                'path = "prompts.jsonl"',
                "budget = 1000000000",
            ]
        )
        + "\n"
    )
    config = config_module.load(config_path)
    # A fresh output folder: earlier Parquet output counts as work already done.
    shutil.rmtree(config.sink_path, ignore_errors=True)
    report = run(config, progress=False)
    first, last, rows, tokens = float("inf"), 0.0, 0, 0
    for file in config.sink_path.glob("dataset=*/*.parquet"):
        part = pq.read_table(file, columns=["dispatched_at", "finished_at", "completion_tokens"])
        first = min(first, min(part["dispatched_at"].to_pylist()))
        last = max(last, max(part["finished_at"].to_pylist()))
        rows += part.num_rows
        tokens += sum(part["completion_tokens"].to_pylist())
    kept = report.datasets["overhead"].completion_tokens
    if rows != args.prompts or tokens != kept:
        raise SystemExit(f"tokenbudget kept {rows} rows, {tokens:,} tokens; ledger {kept:,}")
    return kept, last - first


def compare(args: argparse.Namespace, prompts: list[str], workdir: Path, rate: float) -> None:
    print(
        f"\n{args.prompts:,} prompts, concurrency {args.concurrency}, max_new_tokens"
        f" {args.max_new_tokens}, simulator at {rate:,.0f} tokens/s per request,"
        f" {args.repeats} pairs",
        flush=True,
    )

    def bare() -> tuple[int, float]:
        return with_simulator(
            rate,
            lambda url: asyncio.run(bare_loop(url, prompts, args.concurrency, args.max_new_tokens)),
        )

    def ours() -> tuple[int, float]:
        return with_simulator(rate, lambda url: through_tokenbudget(url, workdir, args))

    ratios: list[float] = []
    rates: dict[str, list[float]] = {"bare httpx loop": [], "tokenbudget run": []}
    for pair in range(args.repeats):
        order = [("bare httpx loop", bare), ("tokenbudget run", ours)]
        if pair % 2:
            order.reverse()
        kept: dict[str, int] = {}
        for name, measure in order:
            tokens, span = measure()
            kept[name] = tokens
            rates[name].append(tokens / span)
            print(
                f"pair {pair + 1}: {name}: {tokens:,} tokens in {span:.1f} s"
                f" = {tokens / span:,.0f} tokens/s",
                flush=True,
            )
        if kept["bare httpx loop"] != kept["tokenbudget run"]:
            raise SystemExit("the two kept different token counts: not comparable")
        ratio = rates["tokenbudget run"][-1] / rates["bare httpx loop"][-1]
        ratios.append(ratio)
        print(f"pair {pair + 1}: ratio tokenbudget / bare: {ratio:.3f}", flush=True)
    for name, values in rates.items():
        print(
            f"{name}: median {statistics.median(values):,.0f} tokens/s"
            f" (min {min(values):,.0f}, max {max(values):,.0f})"
        )
    print(
        f"ratio tokenbudget / bare at {rate:,.0f} tokens/s per request:"
        f" median {statistics.median(ratios):.3f}"
        f" (min {min(ratios):.3f}, max {max(ratios):.3f}, {len(ratios)} pairs)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=4096)
    parser.add_argument(
        "--tokens-per-second",
        default="250,2000",
        help="simulated decode rates per request, comma-separated: one comparison each",
    )
    parser.add_argument("--repeats", type=int, default=2, help="pairs of runs per rate")
    parser.add_argument("--workdir", default="bench-out/overhead")
    args = parser.parse_args()
    workdir = Path(args.workdir).resolve()
    prompts = write_prompts(workdir / "prompts.jsonl", args.prompts)
    broker.up(BrokerSettings.from_env(), [])
    for rate in (float(r) for r in str(args.tokens_per_second).split(",")):
        compare(args, prompts, workdir, rate)


if __name__ == "__main__":
    main()
