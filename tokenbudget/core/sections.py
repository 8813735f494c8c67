"""The config file's job-wide tables, as read: [job], [kafka] (with its role logins), [budget],
[sink], [producer] and [metrics], one frozen struct each, every key declared with its
type, default and description (``Annotated[type, doc(...)]``); and the choices and
bounds the keys of every table take.

The tables that carry sampling settings, [inference] and [[datasets]], are
:mod:`tokenbudget.core.request_sections`; the config the rest of the code reads is
:mod:`tokenbudget.core.config`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from tokenbudget.core import sizes
from tokenbudget.core.keydoc import doc
from tokenbudget.core.roles import Role

# The budget's choices, named once here; what each means is streams/budget.py's tables.
Unit = Literal["completion_tokens", "total_tokens", "samples"]
BoundaryPolicy = Literal["truncate", "finish"]
AdmissionMode = Literal["reserve", "halt"]
CutPolicy = Literal["last", "any"]
ReserveMode = Literal["whole", "grow"]
# Which server of the fleet a request goes to: producers/inference/placement.py.
RoutingPolicy = Literal["least_work", "round_robin"]
# The order a dataset's prompts are sent in: producers/prompts/order.py says what each keeps.
DatasetOrder = Literal["file", "shuffled", "stratified"]
# stratify_by's default: the prompt's length, not a field of the row.
PROMPT_LENGTH = "prompt_length"
# A thinking model's reasoning, per dataset: "save" keeps it (and says so when the
# server sends none), "disable" asks the chat template for none; unset: as the server does.
ReasoningMode = Literal["save", "disable"]
# What "disable" puts in chat_template_kwargs: Qwen3's and GLM's templates read
# enable_thinking, DeepSeek V3.1's and Kimi K2.5's (and vLLM's parsers for them)
# thinking; a template ignores the key it does not read.
NO_THINKING = {"enable_thinking": False, "thinking": False}

# Bounds declared with their keys (``Annotated[int, doc(...), POSITIVE]``): msgspec
# checks them as it reads the config, and from_msgspec words a refusal as ours
# ("must be positive, got -1"). On top, one walk (check_numbers) refuses any float
# key that is not finite and any integer past the events' range.
POSITIVE = msgspec.Meta(gt=0)
NOT_NEGATIVE = msgspec.Meta(ge=0)
PORT = msgspec.Meta(ge=1, le=65535)
# A count one request carries (its max_new_tokens, a server's concurrency): positive,
# and no wider than the events' decoders take it.
REQUEST_COUNT = msgspec.Meta(gt=0, le=sizes.MAX_COUNT)


class Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """A table of the config file: frozen, and an unknown key in it is an error."""


class RoleLogin(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The SASL login of one role (docs/kafka.md, Roles and ACLs): the processes, or
    the parts of `run`, that play it log in as this principal instead of `[kafka]`'s."""

    role: Annotated[
        Role,
        doc(
            "`operator` (run's own commands, `budget set`, `servers add`, topics), "
            "`producer` (prompts), `dispatcher` (answers, leases), `ledger` (grants, halts) "
            "or `sink` (Parquet)"
        ),
    ]
    sasl_username: Annotated[str, doc("the role's SASL user: its principal is `User:<name>`")]
    sasl_password_env: Annotated[
        str, doc("the environment variable holding its password (or `sasl_password_file`)")
    ] = ""
    sasl_password_file: Annotated[
        str, doc("a file holding its password (relative to the config)")
    ] = ""


class KafkaConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Where the job's events go: the broker or cluster, the namespace of its topics,
    the topics tokenbudget creates, and how its clients connect (docs/kafka.md)."""

    bootstrap: Annotated[
        str,
        doc(
            '`"local"`: the project\'s own broker on 127.0.0.1, started if needed; else '
            '`HOST:PORT` of an existing cluster, or a list `"k1:9092,k2:9092,k3:9092"` '
            "(the topics are created there)"
        ),
    ] = "local"
    namespace: Annotated[
        str,
        doc(
            "prefix of every topic and group of the job (letters, digits, `_`, `-`); "
            '`""`: the job\'s name (`[job] name`). Set it to share a cluster by a '
            'convention of your own, or `"tokenbudget"` to resume a job that ran before '
            "jobs had names"
        ),
    ] = ""
    local_port: Annotated[
        int,
        doc("client port of the local broker (`TOKENBUDGET_KAFKA_PORT` wins when set)"),
        PORT,
    ] = 9092
    local_controller_port: Annotated[
        int,
        doc(
            "controller port of the local broker (`TOKENBUDGET_KAFKA_CONTROLLER_PORT` wins "
            "when `TOKENBUDGET_KAFKA_PORT` is set)"
        ),
        PORT,
    ] = 9093
    prompt_retention_ms: Annotated[
        int, doc("retention of the prompts topic when tokenbudget creates it (7 days); -1: forever")
    ] = 7 * 24 * 3600 * 1000
    completion_retention_ms: Annotated[
        int,
        doc(
            "retention of the completions topic when tokenbudget creates it; -1: forever, "
            "so `replay` and `export --from-topic` can read every answer again"
        ),
    ] = -1
    budget_retention_ms: Annotated[
        int, doc("retention of the budgets and outcomes topics when tokenbudget creates them")
    ] = -1
    replication_factor: Annotated[
        int,
        doc(
            "replicas of every topic tokenbudget creates, Faust's included; -1: the cluster's "
            "`default.replication.factor` (1 on the local broker)"
        ),
    ] = -1
    min_insync_replicas: Annotated[
        int, doc("`min.insync.replicas` of the topics tokenbudget creates; -1: the cluster's")
    ] = -1
    partitions: Annotated[
        int,
        doc(
            "partitions of every topic tokenbudget creates (1..1000): bounds how many ledger "
            "workers and dispatchers share the work (one partition has one reader per group)"
        ),
    ] = 4
    compression: Annotated[
        sizes.Compression,
        doc(
            "what every producer of tokenbudget (prompt producer, dispatchers, the ledger's "
            "Faust producer, the sink's dead letters, `replay --to-topic`) compresses its "
            "batches with"
        ),
    ] = sizes.DEFAULT_COMPRESSION
    # Secrets are never written here: only the name of an environment variable (*_env)
    # or a file (*_file) that holds them.
    security_protocol: Annotated[
        Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"],
        doc("how clients connect; the local broker is `PLAINTEXT` only"),
    ] = "PLAINTEXT"
    sasl_mechanism: Annotated[
        Literal["", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"], doc("required with SASL")
    ] = ""
    sasl_username: Annotated[str, doc("required with SASL")] = ""
    sasl_password_env: Annotated[
        str,
        doc(
            "the environment variable holding the SASL password (with SASL, this or "
            "`sasl_password_file`)"
        ),
    ] = ""
    sasl_password_file: Annotated[
        str,
        doc(
            "a file holding the SASL password (relative to the config; a trailing newline "
            "is ignored)"
        ),
    ] = ""
    ssl_cafile: Annotated[
        str,
        doc("PEM CA bundle the broker's certificate must chain to; `\"\"`: the system's CAs"),
    ] = ""
    ssl_certfile: Annotated[str, doc("PEM client certificate, for brokers that ask for one")] = ""
    ssl_keyfile: Annotated[
        str, doc('the client certificate\'s PEM private key (`""`: inside `ssl_certfile`)')
    ] = ""
    ssl_key_password_env: Annotated[
        str, doc("the environment variable holding the client key's password, if it has one")
    ] = ""
    ssl_key_password_file: Annotated[
        str, doc("a file holding the client key's password, if it has one")
    ] = ""
    ssl_check_hostname: Annotated[
        bool, doc("the broker's certificate must name the host in `bootstrap`")
    ] = True
    roles: Annotated[
        list[RoleLogin],
        doc(
            "a SASL login per role, one `[[kafka.roles]]` table each; a role with none "
            "logs in as `sasl_username`"
        ),
    ] = []


class BudgetConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """How budgets are counted and kept (docs/budgets.md)."""

    unit: Annotated[
        Unit,
        doc(
            "what budgets count: `completion_tokens`, `total_tokens` (prompt and completion) "
            "or `samples`"
        ),
    ] = "completion_tokens"
    snapshot_interval_s: Annotated[
        float,
        doc("how often the ledger publishes snapshots of the datasets that changed"),
        POSITIVE,
    ] = 0.5
    admission: Annotated[
        AdmissionMode,
        doc(
            "`reserve`: reserve budget before a request is sent and send that as its "
            "`max_new_tokens` (never overshoots); `halt`: halt a dataset once a completion "
            "reaches its budget (what is in flight then overshoots)"
        ),
    ] = "reserve"
    on_boundary: Annotated[
        BoundaryPolicy,
        doc(
            "`truncate`: the budget is used to the token, the answer at the line cut at it; "
            "`finish`: never cut an answer, stop admitting once a whole one "
            "(`max_new_tokens`) no longer fits, and leave the rest unused"
        ),
    ] = "truncate"
    cut: Annotated[
        CutPolicy,
        doc(
            "with `truncate`, which answers the line may cut. `last`: only the one that "
            "straddles it (a request that can no longer get room for a whole answer waits "
            "for the leftovers of those in flight); `any`: what is left goes out at once, "
            "however many answers that cuts"
        ),
    ] = "last"
    reserve: Annotated[
        ReserveMode,
        doc(
            "what a request reserves before it is sent. `whole`: its `max_new_tokens`, so "
            "a dataset with R tokens left has at most R / `max_new_tokens` requests in "
            "flight; `grow` (with `stream = true`, `completion_tokens`, `truncate`): less, "
            "grown from the dispatcher's lease as the answer streams. With `cut = "
            '"last"` it reserves the mean answer and few answers outgrow the budget\'s end; '
            'with `cut = "any"` the fleet stays full until the budget is spent and what is '
            "in flight then is cut at the line"
        ),
    ] = "whole"
    min_new_tokens: Annotated[
        int,
        doc(
            "with `truncate`, the smallest request still worth sending; below it the "
            "dataset is full"
        ),
    ] = 1
    lease_tokens: Annotated[
        int,
        doc(
            "budget a dispatcher takes from the ledger at a time (0: a quarter of "
            "`concurrency × max_new_tokens`)"
        ),
    ] = 0
    lease_ttl_s: Annotated[
        float,
        doc(
            "a lease not renewed for this long (at least 2) expires and its budget returns "
            "(a dispatcher that died)"
        ),
    ] = 30.0


class SinkConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The Parquet output (docs/output.md)."""

    path: Annotated[
        str,
        doc(
            "the Parquet root (relative to the config): `<path>/dataset=<name>/part-*.parquet`; "
            "rows already there count as done"
        ),
    ] = "out"
    rotate_rows: Annotated[int, doc("rows buffered before a file is written"), POSITIVE] = 2000
    rotate_bytes: Annotated[
        int, doc("bytes buffered before a file is written (64 MiB)"), POSITIVE
    ] = 64 * 1024 * 1024
    row_group_rows: Annotated[int, doc("rows per Parquet row group"), POSITIVE] = 1000
    flush_interval_s: Annotated[float, doc("the longest rows stay buffered"), POSITIVE] = 5.0


class ProducerConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The prompt producer: pacing, and rows that are not prompts (docs/datasets.md)."""

    max_queued_per_dataset: Annotated[
        int,
        doc(
            "prompts a dataset may be ahead of its recorded outcomes (0: four times "
            "`inference.concurrency`), so a halt leaves at most that many to skip"
        ),
        NOT_NEGATIVE,
    ] = 0
    on_bad_row: Annotated[
        Literal["skip", "fail"],
        doc(
            "what a bad row does once it is dead-lettered and counted: `skip` (a warning "
            "naming dataset and file:line; exit 0) or `fail` (the run stops, exit 2)"
        ),
    ] = "skip"
    # A longer prompt is a bad row (beyond any model's context, and Kafka's messages).
    max_prompt_bytes: Annotated[
        int,
        doc(
            "a prompt (its text, or its messages' contents) longer than this in UTF-8 is a "
            "bad row (1 MiB; at most 4 MiB, half a Kafka message)"
        ),
    ] = sizes.DEFAULT_PROMPT_BYTES
    max_prompt_tokens: Annotated[
        int,
        doc(
            "with `template = true`, a prompt of more tokens than this once templated is a "
            "bad row (0: no limit)"
        ),
    ] = 0


class JobConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The job a config is (docs/running.md, Jobs): a rerun of the same job resumes
    it, another job starts anew beside it on the same broker."""

    name: Annotated[
        str,
        doc(
            "the job's name (letters, digits, `_`, `-`), and the namespace of its "
            'topics unless `[kafka] namespace` sets one; `""`: the config file\'s stem and '
            "a short hash of its path, e.g. `job-3f9a1c2e`"
        ),
    ] = ""


class MetricsConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Prometheus metrics and progress lines (docs/monitoring.md)."""

    host: Annotated[str, doc("the address `/metrics` binds to")] = "127.0.0.1"
    port: Annotated[
        int,
        doc(
            "`run` serves `/metrics` here (the next free block when taken; it says where), "
            "its ledger worker on port + 1, extra dispatchers and ledgers after it; 0: none"
        ),
        msgspec.Meta(ge=0, le=65535),
    ] = 9464
    progress_interval_s: Annotated[
        float,
        doc(
            "when `run`'s output is not a terminal, a progress line per dataset this often "
            "(0: none)"
        ),
    ] = 60.0
