"""The config file's tables that say what is requested, as read: [inference] (the servers
and how they are asked) with its ``[[inference.servers]]``, and each ``[[datasets]]``
entry. Both carry the sampling settings (:mod:`tokenbudget.core.sampling`): a
dataset's own win over [inference]'s, key by key.
"""

from __future__ import annotations

from typing import Annotated

from tokenbudget.core import sizes
from tokenbudget.core.apis import DEFAULT_API, Api, api_doc
from tokenbudget.core.formats import (
    DEFAULT_FORMAT,
    DatasetFormat,
    Turns,
    format_doc,
)
from tokenbudget.core.keydoc import doc
from tokenbudget.core.sampling import Sampling
from tokenbudget.core.sections import (
    NOT_NEGATIVE,
    POSITIVE,
    REQUEST_COUNT,
    DatasetOrder,
    ReasoningMode,
    RoutingPolicy,
    Section,
)

# The server a config that names none is sent to.
DEFAULT_URL = "http://127.0.0.1:30000"


class _Sampling(Section, Sampling, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The sampling settings (:mod:`tokenbudget.core.sampling`), all optional: in
    [inference], and in each [[datasets]] entry over [inference]'s, key by key (see
    :func:`_sampling`)."""


class ServerConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
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
