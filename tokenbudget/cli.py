"""The ``tokenbudget`` command. Errors of ours end as one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tokenbudget import lifetime, version
from tokenbudget.errors import TokenBudgetError


def _broker(args: argparse.Namespace) -> int:
    from streams.topics import Topics
    from tokenbudget import broker

    settings = broker.BrokerSettings.from_env()
    if args.broker_command == "up":
        bootstrap = broker.up(settings, Topics(args.namespace).specs())
        print(json.dumps({"bootstrap": bootstrap}) if args.json else bootstrap)
    elif args.broker_command == "status":
        state = broker.status(settings)
        if args.json:
            print(json.dumps(state.__dict__, default=str))
        else:
            word = "ready" if state.ready else ("starting" if state.running else "stopped")
            print(
                f"{word} {state.bootstrap} pid={state.pid} kafka={state.kafka_version}"
                f" java: {state.java}"
            )
        return 0 if state.ready else 1
    elif args.broker_command == "down":
        print("stopped" if broker.down(settings) else "not running")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from tokenbudget import simulator

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
        )
    )
    return 0


def _ledger(args: argparse.Namespace) -> int:
    from streams.app import LedgerSettings, run_worker
    from streams.topics import Topics

    if args.config:
        from tokenbudget import config as config_module
        from tokenbudget.kafka import resolve_bootstrap

        config = config_module.load(args.config)
        bootstrap = resolve_bootstrap(config)
        namespace = config.kafka.namespace
        interval = config.budget.snapshot_interval_s
    elif args.bootstrap:
        from tokenbudget.kafka import wait_reachable

        bootstrap, namespace, interval = args.bootstrap, args.namespace, args.snapshot_interval
        wait_reachable(bootstrap)  # Faust gives up at once on a broker restarting
    else:
        raise TokenBudgetError("ledger needs --config FILE, or --bootstrap HOST:PORT")
    from tokenbudget import broker, metrics
    from tokenbudget.kafka import topic_layout

    # The worker follows the topics as they are (made by run, or by an operator).
    layout = topic_layout(bootstrap, Topics(namespace).completions)
    if layout is None:
        broker.ensure_topics(bootstrap, Topics(namespace).specs())
        layout = topic_layout(bootstrap, Topics(namespace).completions)
        assert layout is not None
    gauges = metrics.LedgerGauges()
    if args.metrics_port:
        metrics.serve(args.metrics_host, args.metrics_port, namespace, "ledger")
    sys.argv = [sys.argv[0], "worker"]  # Faust's Worker reads argv
    run_worker(
        LedgerSettings(
            bootstrap,
            Topics(namespace, layout.partitions),
            snapshot_interval=interval,
            on_state=gauges.observe,
            replication_factor=layout.replication_factor,
        )
    )
    return 0


def _run(args: argparse.Namespace) -> int:
    from tokenbudget import config as config_module
    from tokenbudget.runner import run

    config = config_module.load(args.config)
    report = run(
        config,
        progress=False if args.json else None,
        dispatchers=args.dispatchers,
        ledgers=args.ledgers,
    )
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        from tokenbudget.report import print_table

        print_table(report)
    if report.failed:
        print(
            f"tokenbudget: {report.failed} prompt(s) failed for good (see the log); exit code 3",
            file=sys.stderr,
        )
        return EXIT_PROMPTS_FAILED
    return 0


def _status(args: argparse.Namespace) -> int:
    import asyncio

    from streams.topics import Topics
    from tokenbudget import broker
    from tokenbudget import config as config_module
    from tokenbudget.kafka import local_broker_settings, resolve_bootstrap
    from tokenbudget.status import follow

    config = config_module.load(args.config)
    if config.kafka.bootstrap == "local":
        # Read-only: never start a broker just to say there is nothing to show.
        state = broker.status(local_broker_settings(config))
        if not state.ready:
            raise TokenBudgetError(f"the local broker ({state.bootstrap}) is not running")
        bootstrap = state.bootstrap
    else:
        bootstrap = resolve_bootstrap(config, create_topics=False)  # registers TLS/SASL
    names = [d.name for d in config.datasets]
    budgets = {d.name: d.budget for d in config.datasets}
    return asyncio.run(
        follow(
            bootstrap,
            Topics(config.kafka.namespace),
            names,
            budgets,
            watch=args.watch,
            as_json=args.json,
            interval=args.interval,
        )
    )


def _demo(args: argparse.Namespace) -> int:
    from tokenbudget.config import parse_budget
    from tokenbudget.demo import run_demo

    budget = parse_budget(args.budget, "--budget")
    return run_demo(Path(args.workdir), json_output=args.json, budget=budget)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenbudget", description=__doc__)
    parser.add_argument("--version", action="version", version=f"tokenbudget {version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    broker = sub.add_parser("broker", help="the local Kafka broker (KRaft, from Maven jars)")
    broker_sub = broker.add_subparsers(dest="broker_command", required=True)
    for name in ("up", "status", "down"):
        p = broker_sub.add_parser(name)
        p.add_argument("--json", action="store_true")
        p.add_argument("--namespace", default="tokenbudget", help="topics to create")
    broker.set_defaults(func=_broker)

    simulate = sub.add_parser("simulate", help="a simulated SGLang/OpenAI inference server")
    simulate.add_argument("--host", default="127.0.0.1")
    simulate.add_argument("--port", type=int, default=30000)
    simulate.add_argument("--profile", default="demo")
    simulate.add_argument("--tokens-per-second", type=float, default=4000.0)
    simulate.add_argument("--seed", type=int, default=0)
    simulate.add_argument("--model", default="tokenbudget-sim")
    simulate.add_argument(
        "--incremental-streaming-output",
        action="store_true",
        help="stream deltas, like SGLang with this flag",
    )
    simulate.add_argument("--omit-usage", action="store_true", help="no usage in answers")
    simulate.add_argument("--omit-token-ids", action="store_true", help="ignore return_token_ids")
    simulate.add_argument(
        "--api-key-env", default="", metavar="VAR", help="require the key in $VAR as a Bearer token"
    )
    for kind in ("500", "timeout", "reset", "malformed", "busy", "unavailable", "reset-mid-stream"):
        simulate.add_argument(f"--fail-{kind}", type=float, default=0.0, metavar="SHARE")
    simulate.add_argument(
        "--retry-after",
        type=float,
        default=1.0,
        metavar="S",
        help="Retry-After of the busy (429) and unavailable (503) faults",
    )
    simulate.add_argument(
        "--log-file",
        default="",
        metavar="PATH",
        help="append every request's record here, one JSON line each",
    )
    simulate.add_argument(
        "--tokenizer",
        default="",
        metavar="DIR",
        help="a local tokenizer folder: input_ids prompts are decoded with it",
    )
    simulate.set_defaults(func=_simulate)

    ledger = sub.add_parser("ledger", help="the Faust budget ledger worker")
    ledger.add_argument("--config")
    ledger.add_argument("--bootstrap")
    ledger.add_argument("--namespace", default="tokenbudget")
    ledger.add_argument("--snapshot-interval", type=float, default=0.5)
    ledger.add_argument("--metrics-host", default="127.0.0.1")
    ledger.add_argument("--metrics-port", type=int, default=0, help="0: no /metrics")
    ledger.set_defaults(func=_ledger)

    run = sub.add_parser("run", help="run a job to its budgets")
    run.add_argument("--config", required=True)
    run.add_argument("--json", action="store_true")
    run.add_argument(
        "--dispatchers", type=int, default=1, help="dispatcher processes sharing the budgets"
    )
    run.add_argument(
        "--ledgers", type=int, default=1, help="ledger worker processes sharing the datasets"
    )
    run.set_defaults(func=_run)

    status = sub.add_parser("status", help="per-dataset budget, kept, rate, ETA, state")
    status.add_argument("--config", required=True)
    status.add_argument("--watch", action="store_true", help="refresh until interrupted")
    status.add_argument("--json", action="store_true")
    status.add_argument("--interval", type=float, default=1.0, help="--watch refresh, seconds")
    status.set_defaults(func=_status)

    demo = sub.add_parser("demo", help="eight datasets against the simulator")
    demo.add_argument("--workdir", default="demo-out")
    demo.add_argument("--json", action="store_true")
    demo.add_argument("--budget", default="400k", help="every dataset's budget (e.g. 50k)")
    demo.set_defaults(func=_demo)

    from sinks import replay as replay_module

    sink = sub.add_parser("sink", help="the Parquet sink on its own (SIGTERM: flush, commit)")
    replay_module.add_sink_arguments(sink)
    sink.set_defaults(func=replay_module.run_sink_cli)

    replay = sub.add_parser("replay", help="replay the completions topic (Parquet, ledger, ...)")
    replay_module.add_arguments(replay)
    replay.set_defaults(func=replay_module.run_cli)

    from sinks import export as export_module

    export = sub.add_parser(
        "export", help="the kept answers as training data (JSONL conversations, Parquet)"
    )
    export_module.add_arguments(export)
    export.set_defaults(func=export_module.run_cli)

    from tokenbudget import control

    control.add_commands(sub)
    return parser


EXIT_ERROR = 2  # a one-line error on stderr
EXIT_PROMPTS_FAILED = 3  # run: the job ended, but some prompts failed for good

# Loggers of the libraries we use: their warnings (kafka-python's "Task ... ran for",
# "group_id is None", aiokafka's reconnects) are ours to report, not the user's to
# read, unless TOKENBUDGET_LOG asks for that level.
_THIRD_PARTY = frozenset({"kafka", "aiokafka", "faust", "mode", "httpx", "httpcore", "asyncio"})


class QuietLibraries(logging.Filter):
    """Lets through every record of ours, and the libraries' errors only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or record.name.split(".")[0] not in _THIRD_PARTY


def log_handler(raw_level: str) -> logging.Handler:
    """The terminal's log handler: the libraries' warnings filtered out unless
    ``TOKENBUDGET_LOG`` was set."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    if not raw_level:
        handler.addFilter(QuietLibraries())
    return handler


def configure_logging(environ: Mapping[str, str] | None = None) -> None:
    """``TOKENBUDGET_LOG`` (any case: debug, INFO, Warning, ...) sets the level; the
    libraries are heard at that level only when it is set (see QuietLibraries)."""
    environ = os.environ if environ is None else environ
    raw = environ.get("TOKENBUDGET_LOG", "").strip()
    level = logging.getLevelName(raw.upper()) if raw else logging.WARNING
    if not isinstance(level, int):
        choices = "debug, info, warning, error, critical"
        raise TokenBudgetError(f"TOKENBUDGET_LOG={raw!r} is not a log level ({choices})")
    root = logging.getLogger()
    root.setLevel(level)
    if not root.handlers:  # an embedding application (or pytest) keeps its own
        root.addHandler(log_handler(raw))


def main(argv: Sequence[str] | None = None) -> int:
    lifetime.watch_parent()  # a child of `run` (or the demo) ends with it
    try:
        configure_logging()
        args = build_parser().parse_args(argv)
        return int(args.func(args))
    except TokenBudgetError as exc:
        print(f"tokenbudget: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        # Not an error of ours: a library's, or a bug. One line for the user, the
        # traceback for whoever debugs it.
        logging.getLogger("tokenbudget").debug("unexpected error", exc_info=True)
        print(
            f"tokenbudget: error: {type(exc).__name__}: {exc} (TOKENBUDGET_LOG=debug shows where)",
            file=sys.stderr,
        )
        return EXIT_ERROR
