"""The one configuration object: loaded from TOML and the environment, here only.

Every section is a frozen struct. Unknown keys, missing keys and bad values raise
:class:`~tokenbudget.core.errors.ConfigError` naming the key (``datasets[1].budget``) and
the file, before anything runs.

Environment overrides use ``TOKENBUDGET__SECTION__KEY`` (double underscores), e.g.
``TOKENBUDGET__INFERENCE__URL=http://gpu-box:30000``. Relative paths resolve against
the config file's folder.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from tokenbudget.core import sizes
from tokenbudget.core.columns import (
    DEFAULT_COLUMNS,
    Columns,
)
from tokenbudget.core.config_checks import (
    check_added_server_rules,
    check_dataset,
    check_kafka_security,
    check_ranges,
    check_reserve,
    dataset_columns,
    resolve_order,
)
from tokenbudget.core.config_file import (
    ENV_PREFIX,
    RawConfig,
    apply_env,
    check_numbers,
    from_msgspec,
    reject_inline_secrets,
)
from tokenbudget.core.errors import ConfigError
from tokenbudget.core.formats import (
    DatasetFormat,
    Turns,
)
from tokenbudget.core.names import (
    UNNAMED_JOB,
    dataset_name_problem,
    job_name_of,
)
from tokenbudget.core.request_sections import (
    DEFAULT_URL,
    DatasetConfig,
    InferenceConfig,
    ServerConfig,
)
from tokenbudget.core.sampling import SAMPLING_KEYS
from tokenbudget.core.sections import (
    NO_THINKING,
    PROMPT_LENGTH,
    BudgetConfig,
    DatasetOrder,
    JobConfig,
    KafkaConfig,
    MetricsConfig,
    ProducerConfig,
    ReasoningMode,
    SinkConfig,
)
from tokenbudget.core.server_urls import check_url


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


def servers_environment(config: Config) -> dict[str, str]:
    """The environment that gives a process loading ``config``'s file the same fleet
    (``run``'s extra dispatchers, whatever ``--server`` or the environment said)."""
    tables = ", ".join(
        f"{{url = {json.dumps(s.url)}, concurrency = {s.concurrency}, "
        f"api_key_env = {json.dumps(s.api_key_env)}, weight = {s.weight!r}}}"
        for s in config.servers
    )
    return {f"{ENV_PREFIX}INFERENCE__SERVERS": f"[{tables}]"}


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
    apply_env(data, os.environ if environ is None else environ)
    reject_inline_secrets(data, source)
    try:
        raw = msgspec.convert(data, RawConfig)
    except msgspec.ValidationError as exc:
        raise from_msgspec(exc, source, data) from exc
    check_numbers(raw, "", source)
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
                columns=dataset_columns(d, key, source),
                reasoning=d.reasoning,
            )
        )
        check_dataset(raw, d, key, source)
    check_ranges(raw, source)
    check_reserve(raw.budget, raw.inference, source)
    servers = _servers(raw.inference, source)
    check_added_server_rules(raw.inference, source)
    check_kafka_security(raw.kafka, source)
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


def _named(raw: RawConfig, file: Path | None) -> tuple[JobConfig, KafkaConfig]:
    """The job's name (given, else its file's: :func:`job_name_of`) and its Kafka
    settings: the namespace it runs under (``[kafka] namespace``, else that name)."""
    name = raw.job.name or (job_name_of(file) if file is not None else UNNAMED_JOB)
    # Clients split the list on commas only: " h2:9092" would be a host with a space.
    bootstrap = ",".join(item.strip() for item in raw.kafka.bootstrap.split(","))
    kafka = msgspec.structs.replace(
        raw.kafka, namespace=raw.kafka.namespace or name, bootstrap=bootstrap
    )
    return msgspec.structs.replace(raw.job, name=name), kafka


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
