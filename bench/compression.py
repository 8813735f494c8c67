"""Bytes per kept token on the completions topic, with and without compression.

    .venv/bin/python bench/compression.py [--events 2000] [--answer-tokens 2000]
                                          [--prompt-tokens 600] [--codecs none,zstd,lz4,gzip]
                                          [--bootstrap HOST:PORT]

Publishes the same realistic completion events (answer text and its token ids, the
chat prompt as sent and its ids, settings, row id: completion v3, as the dispatcher
publishes them) once per codec, each to a completions topic of a fresh namespace,
with the dispatcher's own producer settings and ``[kafka] compression`` set to the
codec. The sizes come from the broker (DescribeLogDirs: the partitions' log size on
disk), not from our counters, and are divided by the completion tokens published
(every event is a distinct prompt's first completion: all would be kept). The first
codec is the baseline.

The text is real text: CPython's standard library sources, split into words,
spaces and punctuation, each piece's id its frequency rank (as a BPE vocabulary
numbers the common pieces first); answers and prompts are consecutive slices of it.
Code answers are one kind of what a regeneration job produces; prose compresses
similarly, random ids (bench/ledger.py's) much less.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import sysconfig
import time
import typing
import uuid
from pathlib import Path

from aiokafka import AIOKafkaProducer

from tokenbudget.core import kafka_admin, sizes
from tokenbudget.core.kafka import aiokafka_producer_options
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import BrokerSettings
from tokenbudget.producers.dispatch.dispatcher import PRODUCER_BATCH_BYTES
from tokenbudget.streams import events as ev
from tokenbudget.streams.fields import ChatMessage, SamplingParams, TokenIds
from tokenbudget.streams.topics import Topics

PIECES = re.compile(r"\w+|\s+|[^\w\s]")
SAMPLING = SamplingParams(max_new_tokens=4096, temperature=0.7, top_p=0.9, seed=1)


def corpus(tokens: int) -> tuple[list[str], list[int]]:
    """At least ``tokens`` pieces of the standard library's sources, and their ids."""
    pieces: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        pieces += PIECES.findall(path.read_text(errors="replace"))
        if len(pieces) >= tokens:
            break
    ranks = {p: i for i, (p, _) in enumerate(collections.Counter(pieces).most_common())}
    return pieces, [ranks[p] for p in pieces]


def make_events(count: int, prompt_tokens: int, answer_tokens: int) -> list[ev.CompletionEvent]:
    per_event = prompt_tokens + answer_tokens
    pieces, ids = corpus(min(count, 200) * per_event)  # a long run reuses the text
    events = []
    for i in range(count):
        start = (i * per_event) % (len(ids) - per_event)
        cut = start + prompt_tokens
        end = cut + answer_tokens
        messages = (
            ChatMessage("system", "You are a careful Python programmer."),
            ChatMessage("user", "".join(pieces[start:cut])),
        )
        events.append(
            ev.CompletionEvent(
                request_id=uuid.uuid4().hex,
                prompt_id=uuid.uuid4().hex,
                dataset="code",
                prompt_tokens=prompt_tokens + 12,
                completion_tokens=answer_tokens,
                output_ids=ids[cut:end],
                finish_reason="stop",
                max_new_tokens=4096,
                text="".join(pieces[cut:end]),
                messages=messages,
                prompt_ids=TokenIds(list(range(12)) + ids[start:cut]),
                sampling=SAMPLING,
                model="org/coder-8b",
                row_id=f"row-{i}",
            )
        )
    return events


async def publish(
    bootstrap: str, topic: str, values: list[bytes], compression: sizes.Compression
) -> float:
    """Seconds to publish ``values`` as the dispatcher does (its producer settings)."""
    producer = AIOKafkaProducer(
        **aiokafka_producer_options(bootstrap, compression),
        linger_ms=2,
        max_batch_size=PRODUCER_BATCH_BYTES,
    )
    await producer.start()
    started = time.perf_counter()
    try:
        sent = [await producer.send(topic, value, key=b"code") for value in values]
        await asyncio.gather(*sent)
    finally:
        await producer.stop()
    return time.perf_counter() - started


def topic_bytes(bootstrap: str, topic: str) -> int:
    """The topic's size on the brokers' disks, as they report it."""
    admin = kafka_admin.admin_client(bootstrap)
    try:
        described = admin.describe_log_dirs([topic])
    finally:
        admin.close()
    return sum(
        partition["partition_size"]
        for node in described
        for log_dir in node["log_dirs"]
        for found in log_dir["topics"]
        if found["name"] == topic
        for partition in found["partitions"]
    )


def measure(
    bootstrap: str, values: list[bytes], compression: sizes.Compression
) -> tuple[int, float]:
    topics = Topics(f"bench-compression-{compression}-{uuid.uuid4().hex[:6]}")
    kafka_admin.ensure_topics(bootstrap, topics.specs())
    try:
        seconds = asyncio.run(publish(bootstrap, topics.completions, values, compression))
        return topic_bytes(bootstrap, topics.completions), seconds
    finally:
        admin = kafka_admin.admin_client(bootstrap)
        admin.delete_topics([spec.name for spec in topics.specs()])
        admin.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=2000)
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--answer-tokens", type=int, default=2000)
    parser.add_argument("--codecs", default="none,zstd,lz4,gzip")
    parser.add_argument("--bootstrap", default="", help="a running broker (default: local)")
    args = parser.parse_args()
    codecs = args.codecs.split(",")
    for codec in codecs:
        if codec not in typing.get_args(sizes.Compression):
            raise SystemExit(f"--codecs: unknown codec {codec!r}")
    bootstrap = args.bootstrap or broker.up(BrokerSettings.from_env(), [])
    events = make_events(args.events, args.prompt_tokens, args.answer_tokens)
    values = [codec.encode(e) for e in events]
    kept = sum(e.completion_tokens for e in events)
    raw = sum(map(len, values))
    print(
        f"{len(values):,} completion events (code: a {args.prompt_tokens}-token chat prompt, "
        f"{args.answer_tokens}-token answers, ids and text), {raw / len(values):,.0f} bytes "
        f"each as JSON, {kept:,} tokens kept"
    )
    results = {codec: measure(bootstrap, values, codec) for codec in codecs}  # type: ignore[arg-type]
    base = results[codecs[0]][0]
    header = ("compression", "on disk", "bytes/token", f"x {codecs[0]}", "publish s")
    print(f"{header[0]:<12}{header[1]:>14}{header[2]:>13}{header[3]:>10}{header[4]:>11}")
    for codec, (size, seconds) in results.items():
        print(f"{codec:<12}{size:>14,}{size / kept:>13.2f}{size / base:>10.3f}{seconds:>11.2f}")


if __name__ == "__main__":
    main()
