"""``tokenbudget simulate``: a simulated SGLang/OpenAI inference server."""

from __future__ import annotations

import argparse
import os

from tokenbudget.dev import simulator


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--profile", default="demo")
    parser.add_argument("--tokens-per-second", type=float, default=4000.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default="tokenbudget-sim")
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
    for kind in ("500", "timeout", "reset", "malformed", "busy", "unavailable", "reset-mid-stream"):
        parser.add_argument(f"--fail-{kind}", type=float, default=0.0, metavar="SHARE")
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
        choices=simulator.REASONING_STYLES,
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
    faults = simulator.Faults(
        http_500=args.fail_500,
        timeout=args.fail_timeout,
        reset=args.fail_reset,
        malformed=args.fail_malformed,
        busy=args.fail_busy,
        unavailable=args.fail_unavailable,
        reset_mid_stream=args.fail_reset_mid_stream,
        retry_after_s=args.retry_after,
    )
    simulator.serve(
        simulator.SimulatorConfig(
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
