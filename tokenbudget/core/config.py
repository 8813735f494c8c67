"""The one configuration object: loaded from TOML and the environment, here only.

Every section is a frozen struct. Unknown keys, missing keys and bad values raise
:class:`~tokenbudget.core.errors.ConfigError` naming the key (``datasets[1].budget``) and
the file, before anything runs.

Environment overrides use ``TOKENBUDGET__SECTION__KEY`` (double underscores), e.g.
``TOKENBUDGET__INFERENCE__URL=http://gpu-box:30000``. Relative paths resolve against
the config file's folder.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import re
import tomllib
import types
import typing
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from tokenbudget.core import sizes
from tokenbudget.core.apis import API_TRAITS, DEFAULT_API, Api, api_doc, openai_api
from tokenbudget.core.columns import (
    DEFAULT_COLUMNS,
    MAPPING_KEYS,
    Columns,
    PromptTemplate,
    TemplateError,
)
from tokenbudget.core.errors import ConfigError
from tokenbudget.core.formats import (
    DEFAULT_FORMAT,
    FORMAT_TRAITS,
    TEXT_TURNS,
    DatasetFormat,
    Turns,
    format_doc,
    formats_with,
)
from tokenbudget.core.keydoc import doc
from tokenbudget.core.names import (
    UNNAMED_JOB,
    dataset_name_problem,
    job_name_of,
    namespace_problem,
)
from tokenbudget.core.roles import Role
from tokenbudget.core.sampling import SAMPLING_KEYS, Sampling

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
# checks them as it reads the config, and _from_msgspec words a refusal as ours
# ("must be positive, got -1"). On top, one walk (_check_numbers) refuses any float
# key that is not finite and any integer past the events' range.
POSITIVE = msgspec.Meta(gt=0)
NOT_NEGATIVE = msgspec.Meta(ge=0)
PORT = msgspec.Meta(ge=1, le=65535)
# A count one request carries (its max_new_tokens, a server's concurrency): positive,
# and no wider than the events' decoders take it.
REQUEST_COUNT = msgspec.Meta(gt=0, le=sizes.MAX_COUNT)

ENV_PREFIX = "TOKENBUDGET__"
# The server a config that names none is sent to.
DEFAULT_URL = "http://127.0.0.1:30000"


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    pass


class RoleLogin(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
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


class KafkaConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
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


class _Sampling(_Section, Sampling, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The sampling settings (:mod:`tokenbudget.core.sampling`), all optional: in
    [inference], and in each [[datasets]] entry over [inference]'s, key by key (see
    :func:`_sampling`)."""


class ServerConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One inference server of the job's fleet (docs/servers.md, Several inference
    servers); what it does not set, it takes from [inference]."""

    url: Annotated[str, doc("the server (http or https): its root, or a router's")]
    concurrency: Annotated[
        Annotated[int, REQUEST_COUNT] | None,
        doc("its requests in flight at once, per dispatcher (unset: [inference]'s)"),
    ] = None
    api_key_env: Annotated[
        str | None,
        doc("the environment variable holding its key (unset: [inference]'s)"),
    ] = None
    weight: Annotated[
        float,
        doc(
            "its share of the work against the others' (2.0: twice as much for as much "
            "outstanding work); the speed its answers show counts on top"
        ),
    ] = 1.0


class InferenceConfig(_Sampling, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The inference servers and how they are asked (docs/servers.md). The sampling
    keys are sent only when set: in SGLang's `sampling_params` or as the OpenAI
    request's fields; every [[datasets]] entry may set its own, key by key, over
    these."""

    url: Annotated[
        str,
        doc(
            "one inference server (http or https); unset with no `[[inference.servers]]`: "
            f"`{DEFAULT_URL}`. Several: `[[inference.servers]]` (docs/servers.md)"
        ),
    ] = ""
    servers: Annotated[
        list[ServerConfig],
        doc(
            "the fleet, one `[[inference.servers]]` table per server (instead of `url`): "
            "each request goes to the server with the least outstanding work for its speed"
        ),
    ] = []
    routing: Annotated[
        RoutingPolicy,
        doc(
            "`least_work` (the least outstanding work for its speed and weight, a "
            "conversation back to its server) or `round_robin` (in turn, whatever the "
            "load: the peers' way, for comparison)"
        ),
    ] = "least_work"
    api: Annotated[Api, doc(api_doc())] = DEFAULT_API
    model: Annotated[
        str,
        doc(
            "the model name: sent to the OpenAI APIs, and checked against what the server "
            "serves before a run"
        ),
    ] = ""
    concurrency: Annotated[
        int,
        doc(
            "requests in flight at once per server and dispatcher, for the servers that do "
            "not set their own; cut while a server answers 429/503 or slows down"
        ),
        REQUEST_COUNT,
    ] = 64
    max_new_tokens: Annotated[
        int,
        doc("per request, unless the dataset sets its own; the budget may lower it"),
        REQUEST_COUNT,
    ] = 4096
    # 0 once meant no timeout to aiohttp, and a negative one failed every request.
    connect_timeout_s: Annotated[float, doc("seconds to connect to the server"), POSITIVE] = 5.0
    read_timeout_s: Annotated[
        float,
        doc(
            "seconds to wait for (the next part of) an answer; a stream's silence is "
            "noticed within a quarter more"
        ),
        POSITIVE,
    ] = 600.0
    min_tokens_per_s: Annotated[
        float,
        doc(
            "the slowest answer waited for: a request may take its `max_new_tokens` at "
            "this speed, plus `connect_timeout_s` and `read_timeout_s`, then it is a "
            "timed-out attempt, retried as one (0: no total limit)"
        ),
        NOT_NEGATIVE,
    ] = 1.0
    max_reply_bytes: Annotated[
        int,
        doc(
            "the most a reply read whole, or one line of a streamed reply, may take: "
            "beyond, it is not read further and the attempt fails as a malformed answer "
            "(16 MiB by default: a 350,000-token answer as SGLang writes it, ids and all)"
        ),
        POSITIVE,
    ] = sizes.REPLY_BYTES
    # Failures of one prompt that do not say the server is away (another HTTP 5xx, a
    # malformed answer) before it fails for good; "away" ones (429/408/502/503/504,
    # refused, reset, timed out) are retried for as long as the server is away.
    retries: Annotated[
        int,
        doc(
            "retries of a prompt before it is recorded as failed, for errors that do not say "
            "the server is busy or away (a 500, a stream reset, a malformed body); an answer "
            "that says the request itself is wrong (400-style) fails it at once"
        ),
        NOT_NEGATIVE,
    ] = 3
    backoff_s: Annotated[
        float, doc("first retry delay (a `Retry-After` the server sends wins)"), NOT_NEGATIVE
    ] = 0.5
    backoff_max_s: Annotated[float, doc("longest retry delay"), NOT_NEGATIVE] = 10.0
    pause_after_failures: Annotated[
        int,
        doc(
            "busy or away answers in a row from one server (429, 408, 502, 503, 504, "
            "refused or reset connections, read timeouts) after which it is paused: it gets "
            "nothing and `/health` is polled (when every server is, idle leases go back); "
            "those answers are retried without limit, on the other servers"
        ),
    ] = 5
    health_interval_s: Annotated[
        float, doc("how often a paused server's `/health` is asked"), POSITIVE
    ] = 2.0
    outage_timeout_s: Annotated[
        float,
        doc(
            "a server away longer than this is dropped and the job goes on with the others; "
            "with every server away past it the run ends with an error (0: wait for ever)"
        ),
    ] = 3600.0
    prompt_hold_s: Annotated[
        float,
        doc(
            "6..1800: a dispatcher that stops answering (frozen, cut off, killed) keeps its "
            "prompts this long before another takes them over (its Kafka session timeout); "
            "back within it, it claims the answers it holds"
        ),
    ] = 60.0
    stream: Annotated[
        bool,
        doc(
            "server-sent events: `first_token_at`, per-chunk progress, and answers aborted "
            "at once when a lowered budget no longer fits them"
        ),
    ] = False
    api_key_env: Annotated[
        str,
        doc(
            "the environment variable whose value is sent as a Bearer token, when set "
            "(the key itself is never read from the config), to every configured server "
            "that names none of its own"
        ),
    ] = "TOKENBUDGET_API_KEY"
    added_servers: Annotated[
        list[str],
        doc(
            "URL prefixes a server added at run time (`servers add`) must start with to be "
            'accepted, e.g. `["https://gpu-"]`; empty: any (a drained configured server '
            "may always come back)"
        ),
    ] = []
    added_server_keys: Annotated[
        list[str],
        doc(
            "environment variables a server added at run time may name as its key "
            "(`servers add --api-key-env`), besides `api_key_env` and the "
            "`[[inference.servers]]` entries' own; an added server naming none gets no key"
        ),
    ] = []
    tokenizer: Annotated[
        str,
        doc(
            "a local tokenizer folder (relative to the config), never downloaded: chat "
            "templates (`template = true`), counts the server does not send"
        ),
    ] = ""
    trust_remote_code: Annotated[
        bool,
        doc(
            "load a tokenizer folder (`tokenizer`, `export --tokenizer`, `replay "
            "--recount-with`) that ships its tokenizer as Python code (an `auto_map` in its "
            "`tokenizer_config.json`, as Kimi-K2's tiktoken tokenizer): this runs the "
            "folder's code; off, such a folder is refused"
        ),
    ] = False
    check_server: Annotated[
        bool, doc("check the server (and `model`) before a run: `/health` or `/v1/models`")
    ] = True
    n: Annotated[
        int,
        doc("answers per prompt, for every dataset that does not set its own `n`"),
        REQUEST_COUNT,
    ] = 1
    reasoning_end: Annotated[
        str,
        doc(
            "the text that ends a thinking block in the model's raw output: rows of a "
            '`reasoning = "save"` dataset whose thinking is inline are unfinished without '
            "an answer after it"
        ),
    ] = "</think>"


class BudgetConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
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


class SinkConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
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


class ProducerConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
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


class JobConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
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


class MetricsConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
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


class DatasetConfig(_Sampling, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One `[[datasets]]` entry per dataset (docs/datasets.md). The sampling keys of
    [inference] may be set here too: the dataset's own win, key by key."""

    name: Annotated[str, doc("letters, digits, `_`, `-`, `.`; unique in the job")]
    path: Annotated[
        str,
        doc(
            "`.jsonl`, `.json`, `.ndjson`, `.parquet` or `.pq` (relative to the config), or "
            "a folder written by `datasets`' `save_to_disk`"
        ),
    ]
    budget: Annotated[
        int | str,
        doc(
            'an integer, or a string such as `"10M"`, `"250k"`, `"1.5M"`, `"1_000_000"` '
            "(suffixes k, M, G or B), in `budget.unit`"
        ),
    ]
    format: Annotated[DatasetFormat, doc(format_doc())] = DEFAULT_FORMAT
    # Where the prompt is when not in prompt/messages/conversations (one of the
    # three), and the id's field: tokenbudget.core.columns.
    prompt_field: Annotated[
        str, doc('the field holding the prompt text, when it is not `prompt` (e.g. `"question"`)')
    ] = ""
    prompt_template: Annotated[
        str,
        doc(
            'the prompt built from several fields, e.g. `"{instruction}\\n\\n{input?}"` '
            "(`{name?}`: optional)"
        ),
    ] = ""
    messages_field: Annotated[
        str,
        doc(
            "the field holding chat messages or ShareGPT turns, when it is not `messages` or "
            "`conversations`"
        ),
    ] = ""
    id_field: Annotated[
        str, doc("the field holding the row's id, from which its `prompt_id` is made")
    ] = "id"
    max_new_tokens: Annotated[
        Annotated[int, REQUEST_COUNT] | None, doc("per request (unset: `inference.max_new_tokens`)")
    ] = None
    limit: Annotated[int | None, doc("publish at most this many prompts")] = None
    template: Annotated[
        bool,
        doc(
            "apply the tokenizer's chat template here and send `input_ids`; needs "
            "`inference.tokenizer` and `api` `sglang` or `openai-completions` (chat datasets "
            "need it with those)"
        ),
    ] = False
    turns: Annotated[
        Turns,
        doc(
            "conversations: `first` sends the turns up to the first user turn; `all` "
            "regenerates every assistant turn on the dataset's history; `regenerate` every "
            'turn on the model\'s own earlier answers (`api = "openai-chat"`, `n = 1`)'
        ),
    ] = "first"
    shuffle_seed: Annotated[
        int | None,
        doc(
            "shuffle the prompts with this seed (the same seed, the same order, and with "
            '`limit` the same sample); also seeds `order = "stratified"` (0 when unset)'
        ),
    ] = None
    # unset: "shuffled" with a shuffle_seed, else "file"; the seed also seeds "stratified"
    order: Annotated[
        DatasetOrder | None,
        doc(
            "the order prompts are sent in, so the prefix a budget keeps: `file`, `shuffled` "
            "or `stratified` (every prefix holds each part of the source in proportion); "
            "unset: `shuffled` with a `shuffle_seed`, else `file`"
        ),
    ] = None
    stratify_by: Annotated[
        str,
        doc(
            '`order = "stratified"`: `prompt_length` (in characters, the default) or a field '
            "of the rows"
        ),
    ] = ""
    split: Annotated[
        str,
        doc(
            '`format = "hf"`: the split of a saved `DatasetDict` (default `train`, or its only one)'
        ),
    ] = ""
    n: Annotated[
        int | None,
        doc(
            "answers per prompt (unset: `inference.n`): each its own prompt (`sample_index`), "
            "request and count, so the budget stays exact"
        ),
    ] = None
    keep_columns: Annotated[
        list[str],
        doc("input columns copied into every output row (`input_columns`, JSON; missing: null)"),
    ] = []
    reasoning: Annotated[
        ReasoningMode | None,
        doc(
            "a thinking model's reasoning: `save` (kept, warned about when a chat answer "
            "has none, raw text checked for `inference.reasoning_end`) or `disable` "
            "(`chat_template_kwargs` gets `enable_thinking = false` and `thinking = false`, "
            "unless the dataset sets its own); unset: as the server does, its reasoning kept"
        ),
    ] = None


class _RawConfig(_Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    job: JobConfig = JobConfig()
    kafka: KafkaConfig = KafkaConfig()
    inference: InferenceConfig = InferenceConfig()
    budget: BudgetConfig = BudgetConfig()
    sink: SinkConfig = SinkConfig()
    producer: ProducerConfig = ProducerConfig()
    metrics: MetricsConfig = MetricsConfig()
    datasets: list[DatasetConfig] = []


class Dataset(msgspec.Struct, frozen=True, kw_only=True):
    """A dataset as the rest of the code sees it: budget parsed, path resolved."""

    name: str
    path: Path
    budget: int
    format: DatasetFormat
    max_new_tokens: int
    limit: int | None
    template: bool = False
    turns: Turns = "first"
    shuffle_seed: int | None = None
    order: DatasetOrder = "file"
    stratify_by: str = PROMPT_LENGTH
    split: str = ""
    sampling: dict[str, Any] = {}  # the sampling settings its requests carry
    n: int = 1  # answers per prompt
    keep_columns: tuple[str, ...] = ()
    columns: Columns = DEFAULT_COLUMNS  # where the rows hold the prompt
    reasoning: ReasoningMode | None = None  # see ReasoningMode


def _sampling(inference: InferenceConfig, dataset: DatasetConfig) -> dict[str, Any]:
    """The dataset's own settings over [inference]'s; unset ones left out. With
    ``reasoning = "disable"``, :data:`NO_THINKING` over [inference]'s template
    switches, unless the dataset sets its own (a template that reads another key)."""
    merged = {}
    for key in SAMPLING_KEYS:
        value = getattr(dataset, key)
        if value is None:
            value = getattr(inference, key)
        if value is not None:
            merged[key] = value
    if dataset.reasoning == "disable" and dataset.chat_template_kwargs is None:
        merged["chat_template_kwargs"] = {**merged.get("chat_template_kwargs", {}), **NO_THINKING}
    return merged


class Server(msgspec.Struct, frozen=True, kw_only=True):
    """A server of the fleet as the rest of the code sees it: [inference]'s settings
    filled in where its own entry left them out."""

    url: str
    concurrency: int
    api_key_env: str
    weight: float = 1.0


class Config(msgspec.Struct, frozen=True, kw_only=True):
    # The job's name as given, else derived from its file (tokenbudget.core.names);
    # ``kafka.namespace`` is the one it runs under: the name, unless it sets one.
    job: JobConfig
    kafka: KafkaConfig
    inference: InferenceConfig
    # The inference servers the job starts with: [[inference.servers]], else
    # [inference] url as a fleet of one (``tokenbudget servers`` changes it at run time).
    servers: tuple[Server, ...]
    budget: BudgetConfig
    sink: SinkConfig
    producer: ProducerConfig
    metrics: MetricsConfig
    datasets: tuple[Dataset, ...]
    source: str = "<defaults>"
    base_dir: Path = Path(".")

    @property
    def sink_path(self) -> Path:
        return _resolve(self.base_dir, self.sink.path)

    @property
    def tokenizer_path(self) -> Path | None:
        """``[inference] tokenizer`` resolved against the config's folder, if set."""
        tokenizer = self.inference.tokenizer
        return _resolve(self.base_dir, tokenizer) if tokenizer else None

    @property
    def concurrency(self) -> int:
        """Requests in flight at once over the whole fleet: its servers' concurrency."""
        return sum(server.concurrency for server in self.servers)

    @property
    def max_queued_per_dataset(self) -> int:
        # The outcomes the producer counts come from the ledger's snapshots, seconds
        # behind under load (bench/fleet.py: ~1,000 answers at ~300 a second): at
        # twice the places, the queue past the requests in flight ran dry.
        return self.producer.max_queued_per_dataset or 4 * self.concurrency

    def require_datasets(self) -> None:
        """``run`` and ``produce`` have nothing to do without a dataset (and would wait
        for ever); ``ledger``, ``dispatch`` and ``status`` need none."""
        if not self.datasets:
            raise ConfigError(
                "datasets",
                "no [[datasets]] table: add one with name, path and budget",
                source=self.source,
            )

    def dataset(self, name: str) -> Dataset:
        for dataset in self.datasets:
            if dataset.name == name:
                return dataset
        raise ConfigError("datasets", f"no dataset named {name!r}", source=self.source)


_SUFFIX = {"": 1, "k": 1_000, "m": 1_000_000, "g": 1_000_000_000, "b": 1_000_000_000}
_BUDGET_RE = re.compile(r"^\s*(\d+(?:_\d+)*(?:\.\d+)?)\s*([kKmMgGbB]?)\s*$")


def parse_budget(value: object, key: str = "budget") -> int:
    """``10M`` -> 10_000_000, ``250k``, ``1.5M``, ``1_000_000`` or a plain integer."""
    if isinstance(value, bool):
        raise ConfigError(key, f"expected a token count such as 10M or 250k, got {value!r}")
    if isinstance(value, int):
        number = value
    elif isinstance(value, str) and (match := _BUDGET_RE.match(value)):
        number = round(float(match.group(1).replace("_", "")) * _SUFFIX[match.group(2).lower()])
    else:
        raise ConfigError(key, f"expected a token count such as 10M or 250k, got {value!r}")
    if number <= 0:
        raise ConfigError(key, f"must be positive, got {value!r}")
    if number > sizes.MAX_TOKENS:
        raise ConfigError(
            key,
            f"must be at most {sizes.MAX_TOKENS:,} (the events' 64-bit integers), got {value!r}",
        )
    return number


def _resolve(base: Path, path: str) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (base / p).resolve()


_PATH_RE = re.compile(r"at `\$(?P<path>[^`]*)`")
_FIELD_RE = re.compile(r"field `(?P<field>[^`]+)`")


def _key_from_msgspec(message: str) -> str:
    """Turn msgspec's ``... - at `$.datasets[1]``` into ``datasets[1].budget``."""
    path_match = _PATH_RE.search(message)
    path = path_match.group("path").lstrip(".") if path_match else ""
    field_match = _FIELD_RE.search(message)
    if field_match and ("unknown field" in message or "missing required" in message):
        path = f"{path}.{field_match.group('field')}" if path else field_match.group("field")
    return path or "<root>"


def _literal_values(key: str) -> tuple[Any, ...]:
    """The values a Literal key (``inference.api``, ``datasets[0].format``) takes, in
    the order they are declared; () for any other key."""
    kind: Any = _RawConfig
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        if part.startswith("["):
            kind = typing.get_args(kind)[0] if typing.get_origin(kind) is list else None
        elif isinstance(kind, type) and issubclass(kind, msgspec.Struct):
            kind = typing.get_type_hints(kind).get(part)
        else:
            return ()
    union = typing.get_origin(kind) in (typing.Union, types.UnionType)
    choices = typing.get_args(kind) if union else (kind,)
    return tuple(
        value
        for choice in choices
        if typing.get_origin(choice) is Literal
        for value in typing.get_args(choice)
    )


_BOUND_RE = re.compile(r"Expected `(int|float)` (>=|>|<=|<) (\S+) - at ")


def _from_msgspec(
    exc: msgspec.ValidationError, source: str, data: Mapping[str, Any] | None = None
) -> ConfigError:
    """msgspec's error as ours: the key named; for a key with a fixed set of values,
    every value it takes; for a bound declared with the key, the bound and the value
    given (from ``data``, what was read)."""
    message = str(exc)
    key = _key_from_msgspec(message)
    bound = _BOUND_RE.match(message)
    if bound is not None:
        kind, op, limit = bound.group(1), bound.group(2), float(bound.group(3))
        # msgspec says an integer's gt=0 as >= 1
        positive = (op, limit) == (">", 0) or (kind, op, limit) == ("int", ">=", 1)
        shown = f"{int(limit):,}" if limit.is_integer() else f"{limit:g}"
        words = "positive" if positive else f"{op} {shown}"
        return ConfigError(key, f"must be {words}, got {_given(data, key)}", source=source)
    values = _literal_values(key)
    if values:
        what = message.split(" - at ")[0]
        given = re.fullmatch(r"Invalid enum value (.*)", what)
        problem = f"{given.group(1)} is not a valid value" if given else what
        message = f"{problem}; use one of {', '.join(map(repr, values))}"
    return ConfigError(key, message, source=source)


def _given(data: Mapping[str, Any] | None, key: str) -> str:
    """The value ``data`` holds at ``key`` (``datasets[0].max_new_tokens``), shown."""
    value: Any = data
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", key):
        try:
            value = value[int(part[1:-1])] if part.startswith("[") else value[part]
        except (KeyError, IndexError, TypeError, ValueError):
            return "?"
    return repr(value)


def _check_numbers(section: msgspec.Struct, key: str, source: str) -> None:
    """Every float key finite and every integer within the events' range, in every
    section and table: NaN passes every comparison and inf every lower bound (a
    timeout of inf never fires), and an integer past :data:`sizes.MAX_TOKENS` is
    refused by the events' readers later (a budget over it leaves its dataset with
    none). Free-form tables (``extra_body``) go to the server as they are."""
    for name in section.__struct_fields__:
        value = getattr(section, name)
        where = f"{key}.{name}" if key else name
        items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            at = where if index is None else f"{where}[{index}]"
            if isinstance(item, msgspec.Struct):
                _check_numbers(item, at, source)
            elif isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(at, f"must be a finite number, got {item}", source=source)
            elif isinstance(item, int) and abs(item) > sizes.MAX_TOKENS:
                raise ConfigError(
                    at,
                    f"must be within ±{sizes.MAX_TOKENS:,} (the events' 64-bit integers), "
                    f"got {item:,}",
                    source=source,
                )


def _apply_env(data: dict[str, Any], environ: Mapping[str, str]) -> None:
    """The environment's overrides over ``data``. A server named there replaces the
    file's: ``TOKENBUDGET__INFERENCE__URL`` its ``[[inference.servers]]`` and
    ``TOKENBUDGET__INFERENCE__SERVERS`` its ``url``."""
    named: list[str] = []  # the inference servers' keys the environment sets
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        parts = name[len(ENV_PREFIX) :].lower().split("__")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(name, f"environment overrides take the form {ENV_PREFIX}SECTION__KEY")
        section, key = parts
        if section == "datasets" or section not in _RawConfig.__struct_fields__:
            raise ConfigError(f"{section}.{key}", f"unknown section (from ${name})")
        data.setdefault(section, {})[key] = (
            value if _is_text_key(section, key) else _env_value(value)
        )
        if section == "inference" and key in _ONE_OR_SEVERAL:
            named.append(key)
    if len(named) > 1:
        raise ConfigError(
            "inference.url",
            f"both ${ENV_PREFIX}INFERENCE__URL and ${ENV_PREFIX}INFERENCE__SERVERS are set: "
            "unset one",
        )
    for key in named:
        data["inference"].pop(_ONE_OR_SEVERAL[key], None)


# An inference server named from the environment replaces the config's: url those of
# [[inference.servers]], servers the url.
_ONE_OR_SEVERAL = {"url": "servers", "servers": "url"}


def servers_environment(config: Config) -> dict[str, str]:
    """The environment that gives a process loading ``config``'s file the same fleet
    (``run``'s extra dispatchers, whatever ``--server`` or the environment said)."""
    tables = ", ".join(
        f"{{url = {json.dumps(s.url)}, concurrency = {s.concurrency}, "
        f"api_key_env = {json.dumps(s.api_key_env)}, weight = {s.weight!r}}}"
        for s in config.servers
    )
    return {f"{ENV_PREFIX}INFERENCE__SERVERS": f"[{tables}]"}


def _is_text_key(section: str, key: str) -> bool:
    """Whether ``section.key`` holds a string: its override is then taken verbatim,
    since read as TOML ``MODEL=7`` or ``NAMESPACE=2024-01-01`` would be a number or
    a date, which the string key then rejects."""
    info = msgspec.inspect.type_info(_RawConfig)
    assert isinstance(info, msgspec.inspect.StructType)
    for section_field in info.fields:
        if section_field.name == section and isinstance(
            section_field.type, msgspec.inspect.StructType
        ):
            for key_field in section_field.type.fields:
                if key_field.name == key:
                    kind = key_field.type
                    if isinstance(kind, msgspec.inspect.Metadata):  # its description
                        kind = kind.type
                    return isinstance(kind, msgspec.inspect.StrType) or (
                        isinstance(kind, msgspec.inspect.LiteralType)
                        and all(isinstance(v, str) for v in kind.values)
                    )
    return False


def _env_value(value: str) -> Any:
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value  # a bare string


def build(
    data: dict[str, Any],
    *,
    source: str = "<dict>",
    base_dir: Path | None = None,
    environ: Mapping[str, str] | None = None,
    file: Path | None = None,
) -> Config:
    """The config of ``data``; ``file``: where it was read (it names an unnamed job)."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    _apply_env(data, os.environ if environ is None else environ)
    _reject_inline_secrets(data, source)
    try:
        raw = msgspec.convert(data, _RawConfig)
    except msgspec.ValidationError as exc:
        raise _from_msgspec(exc, source, data) from exc
    _check_numbers(raw, "", source)
    base = base_dir or Path(".").resolve()
    datasets: list[Dataset] = []
    seen: set[str] = set()
    for i, d in enumerate(raw.datasets):
        key = f"datasets[{i}]"
        if (problem := dataset_name_problem(d.name)) is not None:
            raise ConfigError(f"{key}.name", problem, source=source)
        if d.name in seen:
            raise ConfigError(f"{key}.name", f"dataset {d.name!r} appears twice", source=source)
        seen.add(d.name)
        try:
            budget = parse_budget(d.budget, f"{key}.budget")
        except ConfigError as exc:
            raise ConfigError(exc.key, str(exc).split(": ", 1)[-1], source=source) from None
        datasets.append(
            Dataset(
                name=d.name,
                path=_resolve(base, d.path),
                budget=budget,
                format=d.format,
                max_new_tokens=d.max_new_tokens or raw.inference.max_new_tokens,
                limit=d.limit,
                template=d.template,
                turns=d.turns,
                shuffle_seed=d.shuffle_seed,
                order=resolve_order(d.order, d.shuffle_seed),
                stratify_by=d.stratify_by or PROMPT_LENGTH,
                split=d.split,
                sampling=_sampling(raw.inference, d),
                n=d.n if d.n is not None else raw.inference.n,
                keep_columns=tuple(d.keep_columns),
                columns=_columns(d, key, source),
                reasoning=d.reasoning,
            )
        )
        _check_dataset(raw, d, key, source)
    _check_ranges(raw, source)
    _check_reserve(raw.budget, raw.inference, source)
    servers = _servers(raw.inference, source)
    _check_added_servers(raw.inference, source)
    _check_kafka_security(raw.kafka, source)
    if raw.inference.tokenizer and not _resolve(base, raw.inference.tokenizer).is_dir():
        raise ConfigError(
            "inference.tokenizer",
            f"{_resolve(base, raw.inference.tokenizer)} is not a folder with a saved tokenizer",
            source=source,
        )
    job, kafka = _named(raw, file)
    return Config(
        job=job,
        kafka=kafka,
        inference=raw.inference,
        servers=servers,
        budget=raw.budget,
        sink=raw.sink,
        producer=raw.producer,
        metrics=raw.metrics,
        datasets=tuple(datasets),
        source=source,
        base_dir=base,
    )


def _named(raw: _RawConfig, file: Path | None) -> tuple[JobConfig, KafkaConfig]:
    """The job's name (given, else its file's: :func:`job_name_of`) and its Kafka
    settings: the namespace it runs under (``[kafka] namespace``, else that name)."""
    name = raw.job.name or (job_name_of(file) if file is not None else UNNAMED_JOB)
    # Clients split the list on commas only: " h2:9092" would be a host with a space.
    bootstrap = ",".join(item.strip() for item in raw.kafka.bootstrap.split(","))
    kafka = msgspec.structs.replace(
        raw.kafka, namespace=raw.kafka.namespace or name, bootstrap=bootstrap
    )
    return msgspec.structs.replace(raw.job, name=name), kafka


# Keys a user may try for a secret, and the key whose *_env / *_file replaces them.
_INLINE_SECRETS = {
    ("kafka", "sasl_password"): "kafka.sasl_password",
    ("kafka", "sasl_plain_password"): "kafka.sasl_password",
    ("kafka", "password"): "kafka.sasl_password",
    ("kafka", "ssl_key_password"): "kafka.ssl_key_password",
    ("kafka", "ssl_password"): "kafka.ssl_key_password",
    ("inference", "api_key"): "inference.api_key",
}


def _reject_inline_secrets(data: dict[str, Any], source: str) -> None:
    """A secret written in the config would be copied, committed and shown: refuse it
    with the fix, before msgspec's generic "unknown field". The message never quotes
    the value."""
    for (section, key), target in _INLINE_SECRETS.items():
        table = data.get(section)
        if not isinstance(table, dict) or key not in table:
            continue
        if target == "inference.api_key":
            fix = (
                "put the key in an environment variable and set inference.api_key_env to "
                "its name (default TOKENBUDGET_API_KEY)"
            )
        else:
            fix = (
                f"put it in an environment variable and set {target}_env to its name, or "
                f"in a file only you can read and set {target}_file to its path"
            )
        raise ConfigError(
            f"{section}.{key}", f"secrets are not read from the config: {fix}", source=source
        )


def _check_reserve(budget: BudgetConfig, inference: InferenceConfig, source: str) -> None:
    """Growing reservations need reservations, answers that can be cut at a token,
    and streamed answers."""
    if budget.reserve != "grow":
        return
    if budget.admission != "reserve":
        raise ConfigError(
            "budget.reserve",
            f'"grow" grows reservations, and admission = "{budget.admission}" makes none: '
            'set budget.admission = "reserve" or budget.reserve = "whole"',
            source=source,
        )
    if budget.unit != "completion_tokens" or budget.on_boundary != "truncate":
        raise ConfigError(
            "budget.reserve",
            '"grow" cuts an answer that outgrows the budget at a token, which a budget with '
            f'unit = "{budget.unit}" and on_boundary = "{budget.on_boundary}" cannot do: set '
            'budget.unit = "completion_tokens" and budget.on_boundary = "truncate", or '
            'budget.reserve = "whole"',
            source=source,
        )
    if not inference.stream:
        raise ConfigError(
            "budget.reserve",
            '"grow" grows reservations as answers stream, and stops an answer at the '
            "line: set inference.stream = true",
            source=source,
        )


def _check_role_logins(kafka: KafkaConfig, source: str) -> None:
    sasl = kafka.security_protocol in ("SASL_PLAINTEXT", "SASL_SSL")
    seen: dict[str, int] = {}
    for i, login in enumerate(kafka.roles):
        key = f"kafka.roles[{i}]"
        if not sasl:
            raise ConfigError(
                key,
                "a role's login is only used with security_protocol SASL_PLAINTEXT or "
                f"SASL_SSL, not {kafka.security_protocol}",
                source=source,
            )
        if login.role in seen:
            raise ConfigError(
                f"{key}.role",
                f"{login.role!r} has a login already (kafka.roles[{seen[login.role]}]): "
                "give each role one",
                source=source,
            )
        seen[login.role] = i
        if not login.sasl_username:
            raise ConfigError(f"{key}.sasl_username", "a role's login needs one", source=source)
        if bool(login.sasl_password_env) == bool(login.sasl_password_file):
            raise ConfigError(
                f"{key}.sasl_password_env",
                "set the role's password as the name of an environment variable "
                "(sasl_password_env) or a file (sasl_password_file): one of them",
                source=source,
            )


def _check_kafka_security(kafka: KafkaConfig, source: str) -> None:
    """Security settings that cannot work together, named by their key."""
    protocol = kafka.security_protocol
    if kafka.bootstrap == "local" and protocol != "PLAINTEXT":
        raise ConfigError(
            "kafka.security_protocol",
            f'{protocol}: the local broker (bootstrap = "local") listens in PLAINTEXT on '
            "127.0.0.1; set kafka.bootstrap to HOST:PORT of a secured listener",
            source=source,
        )
    for prefix in ("sasl_password", "ssl_key_password"):
        if getattr(kafka, f"{prefix}_env") and getattr(kafka, f"{prefix}_file"):
            raise ConfigError(
                f"kafka.{prefix}_file",
                f"set kafka.{prefix}_env or kafka.{prefix}_file, not both",
                source=source,
            )
    sasl = {
        "sasl_mechanism": kafka.sasl_mechanism,
        "sasl_username": kafka.sasl_username,
        "sasl_password_env": kafka.sasl_password_env,
        "sasl_password_file": kafka.sasl_password_file,
    }
    if protocol in ("SASL_PLAINTEXT", "SASL_SSL"):
        if not kafka.sasl_mechanism:
            raise ConfigError(
                "kafka.sasl_mechanism",
                f"security_protocol {protocol} needs one: PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512",
                source=source,
            )
        if not kafka.sasl_username:
            raise ConfigError(
                "kafka.sasl_username", f"security_protocol {protocol} needs one", source=source
            )
        if not (kafka.sasl_password_env or kafka.sasl_password_file):
            raise ConfigError(
                "kafka.sasl_password_env",
                f"security_protocol {protocol} needs the password: set kafka.sasl_password_env "
                "to the name of an environment variable holding it, or kafka.sasl_password_file "
                "to a file holding it",
                source=source,
            )
    else:
        for key, value in sasl.items():
            if value:
                raise ConfigError(
                    f"kafka.{key}",
                    f"only used with security_protocol SASL_PLAINTEXT or SASL_SSL, not {protocol}",
                    source=source,
                )
    _check_role_logins(kafka, source)
    tls = {
        "ssl_cafile": kafka.ssl_cafile,
        "ssl_certfile": kafka.ssl_certfile,
        "ssl_keyfile": kafka.ssl_keyfile,
        "ssl_key_password_env": kafka.ssl_key_password_env,
        "ssl_key_password_file": kafka.ssl_key_password_file,
    }
    if protocol not in ("SSL", "SASL_SSL"):
        for key, value in tls.items():
            if value:
                raise ConfigError(
                    f"kafka.{key}",
                    f"only used with security_protocol SSL or SASL_SSL, not {protocol}",
                    source=source,
                )
    for key in ("ssl_keyfile", "ssl_key_password_env", "ssl_key_password_file"):
        if tls[key] and not kafka.ssl_certfile:
            raise ConfigError(
                f"kafka.{key}",
                "belongs to a client certificate: set kafka.ssl_certfile",
                source=source,
            )


def resolve_order(order: DatasetOrder | None, shuffle_seed: int | None) -> DatasetOrder:
    """The order of a dataset whose ``order`` is unset: shuffled when it has a
    ``shuffle_seed`` (as before ``order`` existed), else the file's."""
    if order is not None:
        return order
    return "shuffled" if shuffle_seed is not None else "file"


def _check_dataset(raw: _RawConfig, d: DatasetConfig, key: str, source: str) -> None:
    """Combinations of dataset options that cannot work, named by their key."""
    if d.stratify_by and resolve_order(d.order, d.shuffle_seed) != "stratified":
        raise ConfigError(
            f"{key}.stratify_by", 'only used with order = "stratified"', source=source
        )
    if d.stratify_by != d.stratify_by.strip():
        raise ConfigError(
            f"{key}.stratify_by", f"{d.stratify_by!r} is not a field name", source=source
        )
    if d.limit is not None and d.limit <= 0:
        raise ConfigError(f"{key}.limit", f"must be positive, got {d.limit}", source=source)
    if d.n is not None and d.n < 1:
        raise ConfigError(f"{key}.n", f"must be 1 or more, got {d.n}", source=source)
    for name in d.keep_columns:
        if not name or name != name.strip():
            raise ConfigError(
                f"{key}.keep_columns", f"{name!r} is not a column name", source=source
            )
    if d.template:
        if not raw.inference.tokenizer:
            raise ConfigError(
                f"{key}.template",
                "applying a chat template needs [inference] tokenizer (a local tokenizer folder)",
                source=source,
            )
        if API_TRAITS[raw.inference.api].chat:
            raw_apis = " or ".join(repr(name) for name, t in API_TRAITS.items() if not t.chat)
            raise ConfigError(
                f"{key}.template",
                f"{raw.inference.api} takes messages, not token ids: use api {raw_apis} "
                "with a local template, or drop template",
                source=source,
            )
    traits = FORMAT_TRAITS[d.format]
    text_rows = traits.chat is False or d.prompt_field or d.prompt_template
    if text_rows and d.turns not in TEXT_TURNS:
        raise ConfigError(
            f"{key}.turns",
            f"{d.turns!r} needs conversations (format {formats_with(d.turns)}, "
            "without prompt_field or prompt_template)",
            source=source,
        )
    if d.turns == "regenerate":
        _check_regenerate(raw, d, key, source)
    if d.split and not traits.splits:
        raise ConfigError(
            f"{key}.split", "only a Hugging Face dataset (format 'hf') has splits", source=source
        )
    if d.reasoning == "disable":
        _check_disable(raw, d, key, source)
    # "auto" and "hf" rows say whether they are chat only when read: run and produce
    # check those before anything starts (tokenbudget.producers.prompts.datasets.check_datasets).
    if not API_TRAITS[raw.inference.api].chat and not d.template:
        if traits.chat:
            found = f"format {d.format!r}"
            raise untemplated_chat(key, d.name, raw.inference.api, found, source)
        if d.messages_field:
            found = f"messages_field {d.messages_field!r}"
            raise untemplated_chat(key, d.name, raw.inference.api, found, source)


def _check_regenerate(raw: _RawConfig, d: DatasetConfig, key: str, source: str) -> None:
    """``turns = "regenerate"`` sends each turn's history, the model's own answers and
    tool calls in it, through the chat API; one answer per turn."""
    if not API_TRAITS[raw.inference.api].chat:
        raise ConfigError(
            f"{key}.turns",
            f"'regenerate' sends each turn with the model's earlier answers and tool calls "
            f"as chat messages, which api {raw.inference.api!r} does not take: set "
            f'[inference] api = "{openai_api(chat=True)}" (a local template is not '
            "supported with it)",
            source=source,
        )
    n = d.n if d.n is not None else raw.inference.n
    if n != 1:
        raise ConfigError(
            f"{key}.n",
            f"'regenerate' makes one answer per turn, on which the next turn is built; n is "
            f"{n}: set n = 1 for this dataset",
            source=source,
        )


def _check_disable(raw: _RawConfig, d: DatasetConfig, key: str, source: str) -> None:
    """``reasoning = "disable"`` works through the chat template: a request with no
    template to read it, or a dataset whose own template switches turn thinking on,
    would think anyway."""
    if not API_TRAITS[raw.inference.api].chat and not d.template:
        raise ConfigError(
            f"{key}.reasoning",
            f"'disable' is read by the chat template, but api {raw.inference.api!r} sends "
            "this dataset's prompts as raw text without one: set template = true (with "
            f'[inference] tokenizer), use [inference] api = "{openai_api(chat=True)}", or '
            "write the prompts with thinking off",
            source=source,
        )
    own = d.chat_template_kwargs or {}
    for switch in ("enable_thinking", "thinking"):
        if own.get(switch):
            raise ConfigError(
                f"{key}.reasoning",
                f"'disable', but the dataset's chat_template_kwargs set {switch} = true: "
                "drop one of them",
                source=source,
            )


def _columns(d: DatasetConfig, key: str, source: str) -> Columns:
    """The dataset's column mapping (tokenbudget.core.columns), checked key by key and
    against its format."""
    chosen = [name for name in MAPPING_KEYS if getattr(d, name)]
    if len(chosen) > 1:
        raise ConfigError(
            f"{key}.{chosen[1]}",
            f"set one of {', '.join(MAPPING_KEYS)}, not both {chosen[0]} and {chosen[1]}",
            source=source,
        )
    for name in ("prompt_field", "messages_field", "id_field"):
        value = getattr(d, name)
        if value != value.strip() or (name == "id_field" and not value):
            raise ConfigError(f"{key}.{name}", f"{value!r} is not a field name", source=source)
    if chosen and chosen[0] in FORMAT_TRAITS[d.format].conflicts:
        what = "chat turns" if chosen[0] == "messages_field" else "a plain prompt"
        raise ConfigError(
            f"{key}.{chosen[0]}",
            f"maps {what}, which format {d.format!r} does not read: set format = "
            f'"{DEFAULT_FORMAT}"',
            source=source,
        )
    template = None
    if d.prompt_template:
        try:
            template = PromptTemplate.parse(d.prompt_template)
        except TemplateError as exc:
            raise ConfigError(f"{key}.prompt_template", str(exc), source=source) from exc
    return Columns(
        prompt_field=d.prompt_field,
        prompt_template=template,
        messages_field=d.messages_field,
        id_field=d.id_field,
    )


def untemplated_chat(
    key: str, dataset: str, api: str, found: str, source: str | None
) -> ConfigError:
    """The error for chat rows bound for a raw-text API without a chat template:
    joined as plain text, they would reach the model in a shape it was not trained on."""
    return ConfigError(
        f"{key}.template",
        f"dataset {dataset!r} is chat ({found}) but api {api!r} sends raw text, so the"
        " messages would reach the model without its chat template: set template = true"
        ' with [inference] tokenizer = "<local tokenizer folder>", or use'
        f' [inference] api = "{openai_api(chat=True)}"',
        source=source,
    )


def _check_ranges(raw: _RawConfig, source: str) -> None:
    """Bounds that take more than the ones declared with the keys (a hint, a range
    tied to another limit, or to the broker's)."""
    if raw.budget.min_new_tokens < 1:
        raise ConfigError("budget.min_new_tokens", "must be >= 1", source=source)
    if not 1 <= raw.producer.max_prompt_bytes <= sizes.PROMPT_EVENT_BYTES:
        raise ConfigError(
            "producer.max_prompt_bytes",
            f"must be within 1..{sizes.PROMPT_EVENT_BYTES} (half of a Kafka message: the "
            f"other half holds the answer), got {raw.producer.max_prompt_bytes}",
            source=source,
        )
    if raw.producer.max_prompt_tokens < 0:
        raise ConfigError("producer.max_prompt_tokens", "must be >= 0 (0: no limit)", source=source)
    if raw.budget.lease_tokens < 0:
        raise ConfigError("budget.lease_tokens", "must be >= 0 (0: automatic)", source=source)
    if raw.budget.lease_ttl_s < 2:
        raise ConfigError("budget.lease_ttl_s", "must be >= 2 seconds", source=source)
    if raw.inference.pause_after_failures < 1:
        raise ConfigError("inference.pause_after_failures", "must be >= 1", source=source)
    if raw.metrics.progress_interval_s < 0:
        raise ConfigError("metrics.progress_interval_s", "must be >= 0 (0: none)", source=source)
    if raw.inference.outage_timeout_s < 0:
        raise ConfigError(
            "inference.outage_timeout_s", "must be >= 0 (0: wait for ever)", source=source
        )
    if not 6 <= raw.inference.prompt_hold_s <= 1800:
        raise ConfigError(
            "inference.prompt_hold_s",
            "must be within 6..1800 seconds (the broker's group.min/max.session.timeout.ms)",
            source=source,
        )
    for key, name in (("job.name", raw.job.name), ("kafka.namespace", raw.kafka.namespace)):
        if name and (problem := namespace_problem(name)) is not None:
            raise ConfigError(key, problem, source=source)
    _check_replication(raw.kafka, source)
    _check_bootstrap(raw.kafka.bootstrap, source)


def one_server_per_url(url: str) -> str:
    """What to do with several servers in one URL: the one place that says it."""
    return (
        f"{url!r} names several servers, but it takes one URL: give each server its own "
        '[[inference.servers]] table (url = "http://..."), or pass --server URL once per '
        "server to `tokenbudget run`"
    )


def _servers(inference: InferenceConfig, source: str) -> tuple[Server, ...]:
    """The fleet the config names: its ``[[inference.servers]]``, each with
    ``[inference]``'s settings where it sets none, else ``url`` alone (by default
    :data:`DEFAULT_URL`)."""
    if inference.servers and inference.url:
        raise ConfigError(
            "inference.url",
            "set either one server (url) or several ([[inference.servers]]), not both: "
            f'move {inference.url!r} into a [[inference.servers]] table as url = "..."',
            source=source,
        )
    if not inference.servers:
        url = inference.url or DEFAULT_URL
        check_url(url, "inference.url", source)
        return (
            Server(
                url=url.rstrip("/"),
                concurrency=inference.concurrency,
                api_key_env=inference.api_key_env,
            ),
        )
    servers: list[Server] = []
    for i, entry in enumerate(inference.servers):
        key = f"inference.servers[{i}]"
        check_url(entry.url, f"{key}.url", source)
        url = entry.url.rstrip("/")
        twice = [j for j, s in enumerate(servers) if s.url == url]
        if twice:
            raise ConfigError(
                f"{key}.url",
                f"{entry.url!r} is inference.servers[{twice[0]}] already: list each server once",
                source=source,
            )
        concurrency = inference.concurrency if entry.concurrency is None else entry.concurrency
        if not (entry.weight > 0 and math.isfinite(entry.weight)):
            raise ConfigError(
                f"{key}.weight", f"must be a positive number, got {entry.weight}", source=source
            )
        key_env = inference.api_key_env if entry.api_key_env is None else entry.api_key_env
        servers.append(
            Server(url=url, concurrency=concurrency, api_key_env=key_env, weight=entry.weight)
        )
    return tuple(servers)


_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_added_servers(inference: InferenceConfig, source: str) -> None:
    for i, prefix in enumerate(inference.added_servers):
        if not prefix.startswith(("http://", "https://")) or len(prefix.split()) != 1:
            raise ConfigError(
                f"inference.added_servers[{i}]",
                f'{prefix!r} is not the start of an http(s) URL (e.g. "https://gpu-")',
                source=source,
            )
    for i, name in enumerate(inference.added_server_keys):
        if not _ENV_NAME_RE.fullmatch(name):
            raise ConfigError(
                f"inference.added_server_keys[{i}]",
                f"{name!r} is not the name of an environment variable",
                source=source,
            )


def check_added_server(config: Config, url: str, api_key_env: str | None) -> None:
    """Raise a ConfigError naming the key to change unless a server added at run time
    (a ``server_added`` event, ``servers add``) may join ``config``'s fleet: its URL
    as :func:`check_url` takes it; outside the config's servers, one that starts
    with an ``[inference] added_servers`` prefix when there are any (a drained
    configured server may always come back); and its key, if it names one, a
    variable the config names: its ``api_key_env``, a configured server's, or one of
    ``added_server_keys``. Only the names are compared: no variable is read here."""
    check_url(url, "URL", config.source)
    prefixes = config.inference.added_servers
    configured = any(server.url == url for server in config.servers)
    if prefixes and not configured and not url.startswith(tuple(prefixes)):
        raise ConfigError(
            "inference.added_servers",
            f"{url} is not a server this job takes: it starts with none of "
            f"{', '.join(map(repr, prefixes))}; add its prefix there to accept it",
            source=config.source,
        )
    if api_key_env and api_key_env not in key_variables(config):
        named = ", ".join(sorted(key_variables(config))) or "none"
        raise ConfigError(
            "inference.added_server_keys",
            f"{url} would be sent the key in ${api_key_env}, a variable the config does not "
            f"name (it names {named}): list it there to let servers added at run time use it",
            source=config.source,
        )


def key_variables(config: Config) -> frozenset[str]:
    """The environment variables ``config`` names as inference keys."""
    names = {config.inference.api_key_env, *config.inference.added_server_keys}
    names.update(server.api_key_env for server in config.servers)
    return frozenset(names - {""})


def with_servers(config: Config, urls: Sequence[str]) -> Config:
    """``config`` sent to ``urls`` instead of the servers it names (``--server``), each
    with ``[inference]``'s settings."""
    for url in urls:
        check_url(url, "--server", config.source)
    inference = msgspec.structs.replace(
        config.inference, url="", servers=[ServerConfig(url=url) for url in urls]
    )
    return msgspec.structs.replace(
        config, inference=inference, servers=_servers(inference, config.source)
    )


def check_url(url: str, key: str, source: str | None = None) -> None:
    """Raise a ConfigError naming ``key`` unless ``url`` is one http(s) URL of a host
    with nothing secret in it: a server's URL is shown in logs, metrics' ``server``
    label, the fleet's events and ``status``, so it takes no user or password and no
    query string or fragment (a key there would be shown too; keys come from the
    environment). The error never shows what such a URL holds."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        raise ConfigError(key, f"{_masked(url)!r} is not a URL: {exc}", source=source) from None
    if "@" in parts.netloc:
        raise ConfigError(
            key,
            f"{_masked(url)!r} holds a user or password, which a URL shown in logs, metrics "
            f"and status would show too: drop it, and name the environment variable holding "
            f"the server's key in api_key_env ({_KEY_FLAG})",
            source=source,
        )
    if "?" in url or "#" in url:
        raise ConfigError(
            key,
            f"{_masked(url)!r} has a query string or fragment, which a URL shown in logs, "
            "metrics and status would show too (a key in it with them): drop it; a server's "
            f"key comes from the environment variable named in api_key_env ({_KEY_FLAG})",
            source=source,
        )
    if "," in url or len(url.split()) > 1:
        raise ConfigError(key, one_server_per_url(url), source=source)
    if not url.startswith(("http://", "https://")):
        raise ConfigError(key, f"{url!r} is not an http(s) URL", source=source)
    try:
        parts.port  # noqa: B018 - parsing the port is the check
    except ValueError as exc:
        raise ConfigError(key, f"{url!r}: {exc}", source=source) from None
    if not parts.hostname:
        raise ConfigError(key, f"{url!r} names no host", source=source)


# Where a server added at run time says the same.
_KEY_FLAG = "`servers add --api-key-env` for a server added at run time"


def _masked(url: str) -> str:
    """``url`` as an error may show it: no user or password, no query or fragment."""
    scheme, has_slashes, rest = url.partition("://")
    if not has_slashes:
        scheme, rest = "", url
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        authority = "…@" + authority.rpartition("@")[2]
    shown = f"{scheme}://" * bool(scheme) + authority + slash + path
    cut = min((i for i in (shown.find("?"), shown.find("#")) if i >= 0), default=-1)
    return shown if cut < 0 else shown[:cut] + shown[cut] + "…"


def in_clear(url: str) -> bool:
    """Whether what is sent to ``url`` can be read on the way: plain http to a host
    other than this machine's loopback (the end of an SSH tunnel is loopback)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http":
        return False
    host = (parts.hostname or "").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True  # a name: whatever it resolves to, the key crosses a network


_ADDRESS_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.\-]+):\d{1,5}$")


def _check_bootstrap(bootstrap: str, source: str) -> None:
    if bootstrap == "local":
        return
    for item in bootstrap.split(","):
        if not _ADDRESS_RE.match(item.strip()):
            raise ConfigError(
                "kafka.bootstrap",
                f'{item.strip()!r} is not HOST:PORT; write "local" for the project\'s own '
                'broker, or a list such as "kafka1:9092,kafka2:9092,kafka3:9092"',
                source=source,
            )


def _check_replication(kafka: KafkaConfig, source: str) -> None:
    for key in ("prompt_retention_ms", "completion_retention_ms", "budget_retention_ms"):
        value = getattr(kafka, key)
        if value == 0 or value < -1:
            raise ConfigError(
                f"kafka.{key}", f"must be positive, or -1 for forever; got {value}", source=source
            )
    if not 1 <= kafka.partitions <= 1000:
        raise ConfigError("kafka.partitions", "must be within 1..1000", source=source)
    for key in ("replication_factor", "min_insync_replicas"):
        value = getattr(kafka, key)
        if value == 0 or value < -1:
            raise ConfigError(
                f"kafka.{key}",
                f"must be >= 1, or -1 for the cluster's default; got {value}",
                source=source,
            )
    if 0 < kafka.replication_factor < kafka.min_insync_replicas:
        raise ConfigError(
            "kafka.min_insync_replicas",
            f"{kafka.min_insync_replicas} exceeds kafka.replication_factor "
            f"{kafka.replication_factor}: no write with acks=all could ever succeed",
            source=source,
        )
    if kafka.bootstrap == "local" and kafka.replication_factor > 1:
        raise ConfigError(
            "kafka.replication_factor",
            "the local broker is one node: leave it at -1 (or 1), or point kafka.bootstrap "
            "at a cluster",
            source=source,
        )


def load(path: str | Path, *, environ: Mapping[str, str] | None = None) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        message = f"cannot read {path}: {exc.strerror}"
        raise ConfigError("<file>", message, source=str(path)) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("<file>", f"not valid TOML: {exc}", source=str(path)) from exc
    return build(data, source=str(path), base_dir=path.resolve().parent, environ=environ, file=path)
