"""``tokenbudget broker up|status|down``: the local Kafka broker."""

from __future__ import annotations

import argparse
import json

from tokenbudget.app.commands import examples
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import BrokerSettings
from tokenbudget.streams.topics import Topics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The local Kafka broker: one JVM in KRaft combined mode on 127.0.0.1, detached (it "
        "outlives the command that started it), its state in TOKENBUDGET_HOME. `run` starts "
        'it for bootstrap = "local"; these commands manage it by hand.'
    )
    parser.epilog = examples("tokenbudget broker up", "tokenbudget broker status --json")
    sub = parser.add_subparsers(
        dest="broker_command", required=True, metavar="{up,status,down}", help="what to do"
    )
    up = sub.add_parser(
        "up",
        help="start it if it is not running, and create a namespace's topics",
        description="Start the local broker if it is not running (idempotent), wait until "
        "it answers a metadata request, create the topics of --namespace, and print its "
        "bootstrap address.",
        epilog=examples("tokenbudget broker up --namespace regen-2026-12"),
    )
    up.add_argument(
        "--json",
        action="store_true",
        help='print {"bootstrap": "HOST:PORT"} instead of the address',
    )
    up.add_argument(
        "--namespace",
        default="tokenbudget",
        metavar="NAME",
        help="create this namespace's topics ([kafka] namespace)",
    )
    status = sub.add_parser(
        "status",
        help="ready, starting or stopped; exit 0 only when ready",
        description="Whether the local broker is ready, starting or stopped, with its "
        "bootstrap address, pid, Kafka version and the java it runs on; exit 0 only when "
        "ready.",
        epilog=examples("tokenbudget broker status --json"),
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of a line")
    down = sub.add_parser(
        "down",
        help="stop it (SIGTERM, SIGKILL after 30 s)",
        description="Stop the local broker: SIGTERM, SIGKILL after 30 s.",
        epilog=examples("tokenbudget broker down"),
    )
    down.add_argument(
        "--json", action="store_true", help='print {"stopped": true|false} instead of a word'
    )


def main(args: argparse.Namespace) -> int:
    settings = BrokerSettings.from_env()
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
        stopped = broker.down(settings)
        print(
            json.dumps({"stopped": stopped})
            if args.json
            else ("stopped" if stopped else "not running")
        )
    return 0
