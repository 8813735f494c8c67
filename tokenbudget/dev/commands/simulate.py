"""``tokenbudget simulate``: a simulated SGLang/OpenAI inference server."""

from __future__ import annotations

import argparse
import os

from tokenbudget.app.commands import examples
from tokenbudget.dev.simulator import server as sim_server
from tokenbudget.dev.simulator.config import (
    PROFILES,
    REASONING_STYLES,
    Faults,
    LengthRule,
    SimulatorConfig,
)

# Each fault's option: what a request it hits gets.
FAULTS = {
    "500": "an HTTP 500",
    "timeout": "no answer (the client times out)",
    "reset": "the connection dropped",
    "malformed": "a 200 whose body breaks off mid-JSON",
    "busy": "a 429 with Retry-After",
    "unavailable": "a 503 with Retry-After",
    "reset-mid-stream": "part of a streamed answer, then the connection dropped",
    "bad-counts": "an answer whose prompt or completion count is negative, not an integer or huge",
    "endless": "a 200 whose body (streamed: its first line) never ends",
}


def profiles_help() -> str:
    """``--profile``'s help, from the simulator's own table of profiles."""

    def rule(r: LengthRule) -> str:
        return f"{r.mean:,.0f} ({r.sigma:g})"

    described = []
    for name, rules in PROFILES.items():
        if len(rules) == 1:
            described.append(f"{name}: {rule(rules[0])}")
            continue
        markers = ", ".join(f"{r.marker} {rule(r)}" for r in rules if r.marker)
        described.append(f"{name}: by a marker in the prompt, {markers}, else {rule(rules[-1])}")
    return (
        "answer lengths in tokens, lognormal, mean (sigma): "
        + "; ".join(described)
        + " (default: %(default)s)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "A simulated inference server that speaks SGLang's /generate and the OpenAI "
        "completions and chat APIs (whole and streamed), with answer lengths drawn from a "
        "profile, faults on request, and a log of every request to grade a run from outside."
    )
    parser.epilog = examples(
        "tokenbudget simulate --port 30000 --profile thinking --reasoning-style reasoning_content",
        "tokenbudget simulate --fail-busy 0.05 --fail-reset-mid-stream 0.05 --log-file sim.jsonl",
    )
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--port", type=int, default=30000, help="the port to listen on")
    parser.add_argument("--profile", default="demo", choices=tuple(PROFILES), help=profiles_help())
    parser.add_argument(
        "--tokens-per-second",
        type=float,
        default=4000.0,
        metavar="N",
        help="decode speed of each request",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the answer lengths (the same seed, the same lengths)",
    )
    parser.add_argument(
        "--model", default="tokenbudget-sim", help="the model name it serves and reports"
    )
    parser.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="stream deltas, like SGLang with this flag",
    )
    parser.add_argument("--omit-usage", action="store_true", help="no usage in answers")
    parser.add_argument("--omit-token-ids", action="store_true", help="ignore return_token_ids")
    parser.add_argument(
        "--api-key-env", default="", metavar="VAR", help="require the key in $VAR as a Bearer token"
    )
    for kind, what in FAULTS.items():
        parser.add_argument(
            f"--fail-{kind}",
            type=float,
            default=0.0,
            metavar="SHARE",
            help=f"this share of requests (0..1) get {what}",
        )
    parser.add_argument(
        "--retry-after",
        type=float,
        default=1.0,
        metavar="S",
        help="Retry-After of the busy (429) and unavailable (503) faults",
    )
    parser.add_argument(
        "--log-file",
        default="",
        metavar="PATH",
        help="append every request's record here, one JSON line each",
    )
    parser.add_argument(
        "--tokenizer",
        default="",
        metavar="DIR",
        help="a local tokenizer folder: input_ids prompts are decoded with it",
    )
    parser.add_argument(
        "--reasoning-style",
        choices=REASONING_STYLES,
        default="none",
        help="a thinking model: the chat field its thinking is sent in (SGLang's "
        "reasoning_content, vLLM's reasoning); raw APIs send it inline, ended by </think>",
    )
    parser.add_argument(
        "--tool-calls",
        action="store_true",
        help="answer chat requests that offer tools with a call to the first one",
    )


def main(args: argparse.Namespace) -> int:
    faults = Faults(
        http_500=args.fail_500,
        timeout=args.fail_timeout,
        reset=args.fail_reset,
        malformed=args.fail_malformed,
        busy=args.fail_busy,
        unavailable=args.fail_unavailable,
        reset_mid_stream=args.fail_reset_mid_stream,
        bad_counts=args.fail_bad_counts,
        endless=args.fail_endless,
        retry_after_s=args.retry_after,
    )
    sim_server.serve(
        SimulatorConfig(
            host=args.host,
            port=args.port,
            profile=args.profile,
            tokens_per_second=args.tokens_per_second,
            seed=args.seed,
            faults=faults,
            model=args.model,
            incremental_streaming=args.incremental_streaming_output,
            omit_usage=args.omit_usage,
            omit_token_ids=args.omit_token_ids,
            api_key=os.environ.get(args.api_key_env) if args.api_key_env else None,
            log_file=args.log_file or None,
            tokenizer=args.tokenizer or None,
            reasoning_style=args.reasoning_style,
            tool_calls=args.tool_calls,
        )
    )
    return 0
