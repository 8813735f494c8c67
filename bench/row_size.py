"""What carrying the prompt in every completion event costs, beside not carrying it.

    .venv/bin/python bench/row_size.py [--events 20000] [--prompt-tokens 300]
                                       [--answer-tokens 1500] [--repeats 3]

Completion v3 carries the prompt as sent (text or messages), its ids, the settings,
the row id and kept columns, so the Parquet sink writes a training-ready row from
the completion alone. The alternative is for the sink to join each completion with
its prompt event from the prompts topic (the prompt travels once). This prints, on
the same synthetic events, in the same run:

* bytes per completion event on the wire: v2-shaped (baseline: no prompt fields)
  and v3 (chat prompt templated here: messages plus prompt ids), and the prompt
  event's size, which the join would have to read and keep per prompt in flight;
* the sink's decode and table build (``decode_records`` then ``keep_first``, the
  live sink's hot path) in events per second for both shapes.

Answers are ``--answer-tokens`` ids (the ids dominate the event), prompts a system
and a user turn of ``--prompt-tokens`` words with their ids.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import msgspec

from tokenbudget.sinks.rows import FirstCompletion, decode_records, keep_first
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.fields import ChatMessage, SamplingParams, TokenIds

SAMPLING = SamplingParams(max_new_tokens=4096, temperature=0.7, top_p=0.9, seed=1)


def make_events(
    count: int, prompt_tokens: int, answer_tokens: int
) -> tuple[list[bytes], list[bytes], list[bytes]]:
    """(v2-shaped completions, v3 completions, prompt events), encoded."""
    rng = random.Random(7)
    baseline, full, prompts = [], [], []
    for i in range(count):
        words = " ".join(f"w{rng.randrange(50_000)}" for _ in range(prompt_tokens))
        messages = (
            ChatMessage("system", "You are a helpful assistant."),
            ChatMessage("user", words),
        )
        prompt_ids = [rng.randrange(150_000) for _ in range(prompt_tokens + 12)]
        answer = [rng.randrange(150_000) for _ in range(answer_tokens)]
        text = " ".join(f"w{t}" for t in answer[: answer_tokens // 2])
        prompt = ev.PromptEvent(
            prompt_id=f"p{i}",
            dataset="d",
            messages=messages,
            sampling=SAMPLING,
            input_ids=prompt_ids,
            row_id=f"row-{i}",
            input_columns={"topic": "sea"},
        )
        lean = ev.CompletionEvent(
            request_id=f"r{i}",
            prompt_id=f"p{i}",
            dataset="d",
            prompt_tokens=len(prompt_ids),
            completion_tokens=answer_tokens,
            output_ids=answer,
            finish_reason="stop",
            max_new_tokens=4096,
            text=text,
        )
        whole = msgspec.structs.replace(
            lean,
            messages=messages,
            prompt_ids=TokenIds(prompt_ids),
            sampling=SAMPLING,
            model="org/model-8b",
            row_id=f"row-{i}",
            input_columns={"topic": "sea"},
        )
        baseline.append(codec.encode(lean))
        full.append(codec.encode(whole))
        prompts.append(codec.encode(prompt))
    return baseline, full, prompts


def sink_rate(values: list[bytes], batch: int = 2000) -> float:
    """Events per second through the sink's decode and table build."""
    first = FirstCompletion()
    started = time.perf_counter()
    for start in range(0, len(values), batch):
        keep_first(decode_records(values[start : start + batch]), first)
    return len(values) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--answer-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    baseline, full, prompts = make_events(args.events, args.prompt_tokens, args.answer_tokens)

    def mean_size(values: list[bytes]) -> float:
        return sum(map(len, values)) / len(values)

    lean_size, full_size, prompt_size = mean_size(baseline), mean_size(full), mean_size(prompts)
    print(
        f"{args.events:,} events, prompt {args.prompt_tokens} words, answer "
        f"{args.answer_tokens} ids"
    )
    print(f"completion without the prompt (baseline): {lean_size:,.0f} bytes/event")
    print(
        f"completion with the prompt (v3):          {full_size:,.0f} bytes/event "
        f"(+{full_size - lean_size:,.0f}, {full_size / lean_size - 1:+.1%})"
    )
    print(f"prompt event (what a join reads and holds): {prompt_size:,.0f} bytes/event")
    lean_rates, full_rates = [], []
    for _ in range(args.repeats):  # alternating, so load on the box falls on both
        lean_rates.append(sink_rate(baseline))
        full_rates.append(sink_rate(full))
    lean_rate, full_rate = statistics.median(lean_rates), statistics.median(full_rates)
    print(f"sink decode + table, baseline: {lean_rate:,.0f} events/s (median of {args.repeats})")
    print(
        f"sink decode + table, v3:       {full_rate:,.0f} events/s "
        f"({full_rate / lean_rate:.2f}x the baseline)"
    )


if __name__ == "__main__":
    main()
