"""``tokenbudget servers add|drain|list``: change a running job's fleet of inference
servers (every dispatcher of the namespace applies it), or list it."""

from __future__ import annotations

import argparse

from tokenbudget.app import servers
from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.commands import add_config, examples
from tokenbudget.core import config as config_module
from tokenbudget.core.server_urls import check_url
from tokenbudget.streams import events as ev


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Change the job's fleet of inference servers, with or without a job running: a "
        "change is an event on the control topic that every dispatcher of the job applies "
        "at once, and later runs of the namespace keep (a drained server stays drained "
        "until added again); or list the fleet as its dispatchers last reported it."
    )
    parser.epilog = examples(
        "tokenbudget servers add http://gpu9:30000 --config job.toml",
        "tokenbudget servers drain http://gpu3:30000 --config job.toml",
        "tokenbudget servers list --config job.toml",
    )
    sub = parser.add_subparsers(
        dest="servers_command", required=True, metavar="{add,drain,list}", help="what to do"
    )
    add = sub.add_parser(
        "add",
        help="send to this server too (or again), from now on",
        description="Add a server to the fleet (or bring back one drained or dropped): "
        "each dispatcher probes it and sends to it once it answers its health check.",
        epilog=examples("tokenbudget servers add http://gpu9:30000 --config job.toml"),
    )
    add.add_argument("url", help="the server's URL, as [[inference.servers]] url takes it")
    add_config(add)
    add.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="its requests in flight at once, per dispatcher (default: [inference]'s)",
    )
    add.add_argument(
        "--weight",
        type=float,
        metavar="W",
        help="its share of the work against the others' (default: 1.0)",
    )
    add.add_argument(
        "--api-key-env",
        metavar="VAR",
        help="the environment variable holding its key, one the config names ([inference] "
        "api_key_env, a [[inference.servers]] entry's, or one of [inference] "
        "added_server_keys); default: no key (or a configured server's own)",
    )
    drain = sub.add_parser(
        "drain",
        help="no new prompts to this server; it finishes those it has",
        description="Drain a server: no dispatcher sends it anything new; what it has in "
        "flight is answered and kept.",
        epilog=examples("tokenbudget servers drain http://gpu3:30000 --config job.toml"),
    )
    drain.add_argument("url", help="the server's URL")
    add_config(drain)
    listing = sub.add_parser(
        "list",
        help="the fleet, as its dispatchers last reported it",
        description="Each server of the fleet (the config's, and those added): its state, "
        "requests in flight against its windows, requests, tokens and tokens/s, errors, "
        "summed over the dispatchers that report it, and the last change made to it.",
        epilog=examples("tokenbudget servers list --config job.toml --json"),
    )
    add_config(listing)
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    bootstrap = resolve_bootstrap(config)
    if args.servers_command == "list":
        print(servers.listing(config, bootstrap, args.json))
        return 0
    url = args.url.rstrip("/")
    if args.servers_command == "add":
        event: ev.ServerAdded | ev.ServerDrained = servers.added(
            config, url, concurrency=args.concurrency, weight=args.weight, key_env=args.api_key_env
        )
        what = "added: every dispatcher of the job sends to it once it answers its health check"
    else:
        check_url(url, "URL")
        event = servers.drained(url)
        what = "drained: it gets no new prompts and finishes those it has"
    servers.change(config, bootstrap, event)
    print(f"{url}: {what} (namespace {config.kafka.namespace}; later runs keep it)")
    return 0
