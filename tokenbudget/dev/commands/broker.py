"""``tokenbudget broker up|status|down``: the local Kafka broker."""

from __future__ import annotations

import argparse
import json

from streams.topics import Topics
from tokenbudget.localkafka import broker


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="broker_command", required=True)
    for name in ("up", "status", "down"):
        command = sub.add_parser(name)
        command.add_argument("--json", action="store_true")
        command.add_argument("--namespace", default="tokenbudget", help="topics to create")


def main(args: argparse.Namespace) -> int:
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
