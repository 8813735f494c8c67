"""tokenbudget's generation throughput beside a bare httpx loop, same prompts.

    .venv/bin/python bench/overhead.py [--prompts 3000] [--concurrency 256]

Both send the same prompts to a fresh simulator (its own process) at the same
concurrency: once as a plain asyncio + httpx loop with no Kafka at all, once
through ``tokenbudget run`` (producer, Kafka, dispatcher, ledger, sink). Each
throughput is completion tokens over the span from the first request sent to the
last answer received (start-up of either is not counted). Prints both and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq

from tokenbudget import broker
from tokenbudget import config as config_module
from tokenbudget.demo import free_port, start_simulator
from tokenbudget.runner import run


def write_prompts(path: Path, count: int) -> list[str]:
    prompts = [f"#code overhead task {i}: write a function" for i in range(count)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return prompts


async def bare_loop(
    url: str, prompts: list[str], concurrency: int, max_new: int
) -> tuple[int, float]:
    """What one would write by hand: ``concurrency`` workers sharing a queue."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    tokens = 0
    first = last = 0.0
    limits = httpx.Limits(
        max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8
    )
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            nonlocal tokens, first, last
            while not queue.empty():
                text = queue.get_nowait()
                sent = time.time()
                first = first or sent
                body = {"text": text, "sampling_params": {"max_new_tokens": max_new}}
                response = await client.post(f"{url}/generate", json=body)
                response.raise_for_status()
                tokens += response.json()["meta_info"]["completion_tokens"]
                last = max(last, time.time())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tokens, last - first


def with_simulator(tokens_per_second: float, body):  # type: ignore[no-untyped-def]
    port = free_port()
    process = start_simulator(port, tokens_per_second)
    try:
        return body(f"http://127.0.0.1:{port}")
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=4096)
    parser.add_argument("--tokens-per-second", type=float, default=2000.0)
    parser.add_argument("--workdir", default="bench-out/overhead")
    args = parser.parse_args()
    workdir = Path(args.workdir).resolve()
    prompts = write_prompts(workdir / "prompts.jsonl", args.prompts)
    broker.up(broker.BrokerSettings.from_env(), [])

    bare_tokens, bare_span = with_simulator(
        args.tokens_per_second,
        lambda url: asyncio.run(bare_loop(url, prompts, args.concurrency, args.max_new_tokens)),
    )

    def through_tokenbudget(url: str) -> tuple[int, float]:
        config_path = workdir / "tokenbudget.toml"
        config_path.write_text(
            "\n".join(
                [
                    "[kafka]",
                    'bootstrap = "local"',
                    f'namespace = "bench-overhead-{int(time.time())}"',
                    "[inference]",
                    f'url = "{url}"',
                    f"concurrency = {args.concurrency}",
                    f"max_new_tokens = {args.max_new_tokens}",
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
        first, last = float("inf"), 0.0
        for file in config.sink_path.glob("dataset=*/*.parquet"):
            part = pq.read_table(file, columns=["dispatched_at", "finished_at"])
            first = min(first, min(part["dispatched_at"].to_pylist()))
            last = max(last, max(part["finished_at"].to_pylist()))
        return report.datasets["overhead"].completion_tokens, last - first

    ours_tokens, ours_span = with_simulator(args.tokens_per_second, through_tokenbudget)
    bare_rate = bare_tokens / bare_span
    ours_rate = ours_tokens / ours_span
    print(
        f"{args.prompts:,} prompts, concurrency {args.concurrency}, simulator at"
        f" {args.tokens_per_second:,.0f} tokens/s per request"
    )
    print(
        f"bare httpx loop: {bare_tokens:,} tokens in {bare_span:.1f} s = {bare_rate:,.0f} tokens/s"
    )
    print(
        f"tokenbudget run: {ours_tokens:,} tokens in {ours_span:.1f} s = {ours_rate:,.0f} tokens/s"
    )
    print(f"ratio tokenbudget / bare: {ours_rate / bare_rate:.3f}")


if __name__ == "__main__":
    main()
