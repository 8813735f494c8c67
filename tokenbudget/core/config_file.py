"""The config file as read, before it becomes a :class:`~tokenbudget.core.config.Config`:
its tables (``RawConfig``), the environment's overrides over them
(``TOKENBUDGET__SECTION__KEY``), secrets written inline refused, msgspec's refusals
worded as ours (the key named, the values it takes), and every number checked.
"""

from __future__ import annotations

import math
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal

import msgspec

from tokenbudget.core import sizes
from tokenbudget.core.errors import ConfigError
from tokenbudget.core.request_sections import DatasetConfig, InferenceConfig
from tokenbudget.core.sections import (
    BudgetConfig,
    JobConfig,
    KafkaConfig,
    MetricsConfig,
    ProducerConfig,
    Section,
    SinkConfig,
)

ENV_PREFIX = "TOKENBUDGET__"


class RawConfig(Section, frozen=True, forbid_unknown_fields=True, kw_only=True):
    job: JobConfig = JobConfig()
    kafka: KafkaConfig = KafkaConfig()
    inference: InferenceConfig = InferenceConfig()
    budget: BudgetConfig = BudgetConfig()
    sink: SinkConfig = SinkConfig()
    producer: ProducerConfig = ProducerConfig()
    metrics: MetricsConfig = MetricsConfig()
    datasets: list[DatasetConfig] = []


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
    kind: Any = RawConfig
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


def from_msgspec(
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


def check_numbers(section: msgspec.Struct, key: str, source: str) -> None:
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
                check_numbers(item, at, source)
            elif isinstance(item, float) and not math.isfinite(item):
                raise ConfigError(at, f"must be a finite number, got {item}", source=source)
            elif isinstance(item, int) and abs(item) > sizes.MAX_TOKENS:
                raise ConfigError(
                    at,
                    f"must be within ±{sizes.MAX_TOKENS:,} (the events' 64-bit integers), "
                    f"got {item:,}",
                    source=source,
                )


def apply_env(data: dict[str, Any], environ: Mapping[str, str]) -> None:
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
        if section == "datasets" or section not in RawConfig.__struct_fields__:
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


def _is_text_key(section: str, key: str) -> bool:
    """Whether ``section.key`` holds a string: its override is then taken verbatim,
    since read as TOML ``MODEL=7`` or ``NAMESPACE=2024-01-01`` would be a number or
    a date, which the string key then rejects."""
    info = msgspec.inspect.type_info(RawConfig)
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


# Keys a user may try for a secret, and the key whose *_env / *_file replaces them.
_INLINE_SECRETS = {
    ("kafka", "sasl_password"): "kafka.sasl_password",
    ("kafka", "sasl_plain_password"): "kafka.sasl_password",
    ("kafka", "password"): "kafka.sasl_password",
    ("kafka", "ssl_key_password"): "kafka.ssl_key_password",
    ("kafka", "ssl_password"): "kafka.ssl_key_password",
    ("inference", "api_key"): "inference.api_key",
}


def reject_inline_secrets(data: dict[str, Any], source: str) -> None:
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
