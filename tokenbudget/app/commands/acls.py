"""``tokenbudget acls``: the Kafka ACLs that keep each role of a job to its own
topics (docs/kafka.md, Roles and ACLs), printed for an admin, or applied."""

from __future__ import annotations

import argparse
import json

from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.commands import add_config, examples
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import ConfigError
from tokenbudget.core.kafka_acls import apply_acls
from tokenbudget.core.roles import ROLES
from tokenbudget.core.security import KafkaSecurity
from tokenbudget.streams import acls
from tokenbudget.streams.topics import Topics


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The Kafka ACLs of the job's namespace for each role's principal (its "
        "`[[kafka.roles]]` login, else `[kafka] sasl_username`'s): what each role may read "
        "and write, so that the brokers' authorizer refuses a dispatcher that writes a "
        "budget or a command (docs/kafka.md, Roles and ACLs). Printed as `kafka-acls.sh` "
        "lines to paste (on a secured cluster, add `--command-config FILE` with an admin's "
        "login), or as JSON; `--apply` creates those missing through the admin API, logged "
        "in as `[kafka] sasl_username`, who must be allowed to alter ACLs (Alter on the "
        "cluster, e.g. a super user); it removes none. Needs SASL: ACLs name the "
        "principals SASL users log in as."
    )
    parser.epilog = examples(
        "tokenbudget acls --config job.toml",
        "tokenbudget acls --config job.toml --apply",
    )
    add_config(parser)
    parser.add_argument(
        "--apply",
        action="store_true",
        help="create the ACLs missing on the cluster, logged in as [kafka] sasl_username "
        "(an admin: a principal allowed to alter ACLs, e.g. a super user)",
    )
    parser.add_argument(
        "--json", action="store_true", help="print JSON instead of kafka-acls.sh lines"
    )


def main(args: argparse.Namespace) -> int:
    config = config_module.load(args.config)
    security = KafkaSecurity.from_config(config)
    if not security.uses_sasl:
        raise ConfigError(
            "kafka.security_protocol",
            f"ACLs name SASL principals, and {config.kafka.security_protocol} logs in no one: "
            "set SASL_PLAINTEXT or SASL_SSL, with sasl_username and [[kafka.roles]] logins",
            source=args.config,
        )
    principals = {role: security.principal(role) for role in ROLES}
    wanted = acls.bindings(Topics(config.kafka.namespace), principals)
    if not args.apply:
        if args.json:
            print(json.dumps(acls.to_json(wanted), indent=2))
        else:
            print("\n".join(acls.command_lines(wanted, config.kafka.bootstrap, principals)))
        return 0
    bootstrap = resolve_bootstrap(config, create_topics=False)
    added = set(apply_acls(bootstrap, wanted))
    if args.json:
        shown = acls.to_json(wanted)
        for entry, binding in zip(shown, sorted(wanted), strict=True):
            entry["added"] = binding in added
        print(json.dumps(shown, indent=2))
    else:
        print(
            f"added {len(added)} ACLs on {bootstrap} for namespace {config.kafka.namespace!r} "
            f"({len(wanted) - len(added)} of its {len(wanted)} were there already)"
        )
    return 0
