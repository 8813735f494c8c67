"""``tokenbudget servers add|drain|list``: change a running job's fleet of inference
servers (every dispatcher of the namespace applies it), or list it."""

from __future__ import annotations

import argparse

from streams import events as ev
from tokenbudget import config as config_module
from tokenbudget.app import servers
from tokenbudget.app.bootstrap import resolve_bootstrap


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="servers_command", required=True)
    add = sub.add_parser("add", help="send to this server too (or again), from now on")
    add.add_argument("url")
    add.add_argument("--config", required=True)
    add.add_argument("--concurrency", type=int, help="its requests at once ([inference]'s)")
    add.add_argument("--weight", type=float, help="its share against the others (1.0)")
    add.add_argument("--api-key-env", help="the variable holding its key ([inference]'s)")
    drain = sub.add_parser("drain", help="no new prompts to this server; it finishes its own")
    drain.add_argument("url")
    drain.add_argument("--config", required=True)
    listing = sub.add_parser("list", help="the fleet, as its dispatchers last reported it")
    listing.add_argument("--config", required=True)
    listing.add_argument("--json", action="store_true")


def main(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    bootstrap = resolve_bootstrap(config)
    if args.servers_command == "list":
        print(servers.listing(config, bootstrap, args.json))
        return 0
    url = args.url.rstrip("/")
    if args.servers_command == "add":
        event: ev.ServerAdded | ev.ServerDrained = servers.added(
            url, concurrency=args.concurrency, weight=args.weight, key_env=args.api_key_env
        )
        what = "added: every dispatcher of the job sends to it once it answers its health check"
    else:
        config_module.check_url(url, "URL")
        event = servers.drained(url)
        what = "drained: it gets no new prompts and finishes those it has"
    servers.change(config, bootstrap, event)
    print(f"{url}: {what} (namespace {config.kafka.namespace}; later runs keep it)")
    return 0
