"""The config's cross-key checks: combinations of keys that cannot work together
(a growing reservation without streaming, SASL keys without SASL, a chat dataset
bound for a raw-text API without a template...), each refused with a
:class:`~tokenbudget.core.errors.ConfigError` that names the key to change; and a
dataset's column mapping, checked against its format.
"""

from __future__ import annotations

import re

from tokenbudget.core import sizes
from tokenbudget.core.apis import API_TRAITS, openai_api
from tokenbudget.core.columns import (
    MAPPING_KEYS,
    Columns,
    PromptTemplate,
    TemplateError,
)
from tokenbudget.core.config_file import RawConfig
from tokenbudget.core.errors import ConfigError
from tokenbudget.core.formats import (
    DEFAULT_FORMAT,
    FORMAT_TRAITS,
    TEXT_TURNS,
    formats_with,
)
from tokenbudget.core.names import namespace_problem
from tokenbudget.core.request_sections import DatasetConfig, InferenceConfig
from tokenbudget.core.sections import BudgetConfig, DatasetOrder, KafkaConfig


def check_reserve(budget: BudgetConfig, inference: InferenceConfig, source: str) -> None:
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


def check_kafka_security(kafka: KafkaConfig, source: str) -> None:
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


def check_dataset(raw: RawConfig, d: DatasetConfig, key: str, source: str) -> None:
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
    # check those before anything starts
    # (tokenbudget.producers.prompts.dataset_checks.check_datasets).
    if not API_TRAITS[raw.inference.api].chat and not d.template:
        if traits.chat:
            found = f"format {d.format!r}"
            raise untemplated_chat(key, d.name, raw.inference.api, found, source)
        if d.messages_field:
            found = f"messages_field {d.messages_field!r}"
            raise untemplated_chat(key, d.name, raw.inference.api, found, source)


def _check_regenerate(raw: RawConfig, d: DatasetConfig, key: str, source: str) -> None:
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


def _check_disable(raw: RawConfig, d: DatasetConfig, key: str, source: str) -> None:
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


def dataset_columns(d: DatasetConfig, key: str, source: str) -> Columns:
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


def check_ranges(raw: RawConfig, source: str) -> None:
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


_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_added_server_rules(inference: InferenceConfig, source: str) -> None:
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
