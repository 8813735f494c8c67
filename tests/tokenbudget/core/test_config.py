"""Config loading: budgets parsed, every bad key named, paths and env overrides."""

from __future__ import annotations

import math
import os
import types
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tokenbudget.core import sizes
from tokenbudget.core.columns import Columns, PromptTemplate
from tokenbudget.core.config import build, load, parse_budget, with_servers
from tokenbudget.core.config_file import RawConfig
from tokenbudget.core.errors import ConfigError
from tokenbudget.core.server_urls import in_clear, one_server_per_url

NO_ENV: dict[str, str] = {}


def dataset(name: str = "a", **extra: Any) -> dict[str, Any]:
    return {"name": name, "path": f"{name}.jsonl", "budget": "1M", **extra}


def config_error(data: dict[str, Any], **kwargs: Any) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        build(data, environ=kwargs.pop("environ", NO_ENV), **kwargs)
    return info.value


# ---- parse_budget ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("10M", 10_000_000),
        ("10m", 10_000_000),
        ("250k", 250_000),
        ("250K", 250_000),
        ("1.5M", 1_500_000),
        ("2G", 2_000_000_000),
        ("1b", 1_000_000_000),
        ("1_000_000", 1_000_000),
        ("42", 42),
        (" 3k ", 3_000),
        (1000000, 1_000_000),
        (1, 1),
    ],
)
def test_parse_budget(value: object, expected: int) -> None:
    result = parse_budget(value)
    assert result == expected
    assert type(result) is int


@pytest.mark.parametrize(
    "value",
    ["10Q", "", "M", "ten", "1.5.2M", "-5", "1e6", 0, -5, "0", "0k", True, False, 1.5, None],
)
def test_parse_budget_rejects(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_budget(value, "datasets[3].budget")
    assert info.value.key == "datasets[3].budget"
    assert "datasets[3].budget" in str(info.value)


# ---- unknown, missing and wrong keys -----------------------------------------------


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"kafka": {"bootstrp": "x"}}, "kafka.bootstrp"),
        ({"inference": {"concurency": 3}}, "inference.concurency"),
        ({"budget": {"units": "samples"}}, "budget.units"),
        ({"sink": {"paht": "out"}}, "sink.paht"),
        ({"producer": {"on_bad": "skip"}}, "producer.on_bad"),
        ({"metrics": {"prot": 1}}, "metrics.prot"),
        ({"datasets": [dataset("a"), dataset("b", colour="red")]}, "datasets[1].colour"),
        ({"kafak": {}}, "kafak"),
    ],
)
def test_unknown_key_is_named(data: dict[str, Any], key: str) -> None:
    error = config_error(data)
    assert error.key == key
    assert f"'{key}'" in str(error)


def test_missing_dataset_budget() -> None:
    error = config_error({"datasets": [{"name": "a", "path": "a.jsonl"}]})
    assert error.key == "datasets[0].budget"


def test_missing_dataset_path_in_second_dataset() -> None:
    error = config_error({"datasets": [dataset("a"), {"name": "b", "budget": 5}]})
    assert error.key == "datasets[1].path"


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"inference": {"concurrency": "lots"}}, "inference.concurrency"),
        ({"inference": {"api": "grpc"}}, "inference.api"),
        ({"kafka": {"local_port": "9092"}}, "kafka.local_port"),
        ({"budget": {"unit": "words"}}, "budget.unit"),
        ({"datasets": [dataset("a", format="csv")]}, "datasets[0].format"),
        ({"datasets": [dataset("a", limit="ten")]}, "datasets[0].limit"),
        ({"datasets": {"name": "a"}}, "datasets"),
    ],
)
def test_wrong_type_is_named(data: dict[str, Any], key: str) -> None:
    assert config_error(data).key == key


@pytest.mark.parametrize("budget", ["10Q", 0, -5, True])
def test_bad_dataset_budget_is_named(budget: object) -> None:
    error = config_error({"datasets": [dataset("a"), dataset("b", budget=budget)]}, source="x.toml")
    assert error.key == "datasets[1].budget"
    assert error.source == "x.toml"
    assert str(error).startswith("x.toml: ")


def test_duplicate_dataset_names() -> None:
    error = config_error({"datasets": [dataset("a"), dataset("b"), dataset("a")]})
    assert error.key == "datasets[2].name"
    assert "twice" in str(error)


@pytest.mark.parametrize("name", ["has space", "a/b", "", "é"])
def test_bad_dataset_name(name: str) -> None:
    assert config_error({"datasets": [dataset(name)]}).key == "datasets[0].name"


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"inference": {"concurrency": 0}}, "inference.concurrency"),
        ({"inference": {"max_new_tokens": -1}}, "inference.max_new_tokens"),
        ({"inference": {"retries": -1}}, "inference.retries"),
        ({"inference": {"url": "gpu-box:30000"}}, "inference.url"),
        ({"sink": {"row_group_rows": 0}}, "sink.row_group_rows"),
        ({"kafka": {"namespace": "a.b"}}, "kafka.namespace"),
    ],
)
def test_out_of_range_values(data: dict[str, Any], key: str) -> None:
    assert config_error(data).key == key


# ---- defaults and values -----------------------------------------------------------


def test_defaults() -> None:
    config = build({}, environ=NO_ENV)
    assert config.datasets == ()
    assert config.inference.api == "sglang"
    assert config.max_queued_per_dataset == 4 * config.inference.concurrency


def test_dataset_values() -> None:
    config = build(
        {
            "inference": {"max_new_tokens": 512, "api": "openai-chat"},
            "datasets": [
                dataset("a", budget="2.5k"),
                dataset("b", budget=7, max_new_tokens=64, limit=3, format="openai"),
            ],
        },
        environ=NO_ENV,
    )
    a, b = config.datasets
    assert (a.name, a.budget, a.max_new_tokens, a.limit, a.format) == ("a", 2500, 512, None, "auto")
    assert (b.name, b.budget, b.max_new_tokens, b.limit, b.format) == ("b", 7, 64, 3, "openai")
    assert config.dataset("b") is b
    with pytest.raises(ConfigError):
        config.dataset("zzz")


def test_input_is_not_mutated_by_env_overrides() -> None:
    data: dict[str, Any] = {"inference": {"concurrency": 2}}
    build(data, environ={"TOKENBUDGET__INFERENCE__CONCURRENCY": "9"})
    assert data == {"inference": {"concurrency": 2}}


# ---- files and paths ---------------------------------------------------------------


CONFIG_TOML = """
[sink]
path = "out"

[[datasets]]
name = "relative"
path = "data/a.jsonl"
budget = "10M"

[[datasets]]
name = "absolute"
path = "{absolute}"
budget = 250000
"""


def test_relative_paths_resolve_against_the_config_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "project"
    folder.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    absolute = tmp_path / "abs" / "b.jsonl"
    file = folder / "tokenbudget.toml"
    file.write_text(CONFIG_TOML.format(absolute=absolute.as_posix()))
    monkeypatch.chdir(elsewhere)  # the working directory must not matter

    config = load(file, environ=NO_ENV)

    relative, absolute_ds = config.datasets
    assert relative.path == (folder / "data" / "a.jsonl").resolve()
    assert absolute_ds.path == absolute
    assert relative.budget == 10_000_000
    assert absolute_ds.budget == 250_000
    assert config.sink_path == (folder / "out").resolve()
    assert config.source == str(file)


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    file = tmp_path / "bad.toml"
    file.write_text('[[datasets]]\nname = "a"\npath = "a.jsonl"\n')
    with pytest.raises(ConfigError) as info:
        load(file, environ=NO_ENV)
    assert info.value.key == "datasets[0].budget"
    assert info.value.source == str(file)
    assert str(file) in str(info.value)


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    file = tmp_path / "broken.toml"
    file.write_text("[kafka\nbootstrap = 1\n")
    with pytest.raises(ConfigError) as info:
        load(file, environ=NO_ENV)
    assert info.value.source == str(file)
    assert str(file) in str(info.value)
    assert "TOML" in str(info.value)


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    file = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load(file, environ=NO_ENV)
    assert str(file) in str(info.value)


# ---- environment overrides ---------------------------------------------------------


def test_env_override_applies(tmp_path: Path) -> None:
    file = tmp_path / "c.toml"
    file.write_text("[inference]\nconcurrency = 2\n")
    assert load(file, environ=NO_ENV).inference.concurrency == 2
    config = load(file, environ={"TOKENBUDGET__INFERENCE__CONCURRENCY": "8"})
    assert config.inference.concurrency == 8


def test_env_overrides_of_several_types() -> None:
    config = build(
        {},
        environ={
            "TOKENBUDGET__INFERENCE__URL": "http://gpu-box:30000",
            "TOKENBUDGET__INFERENCE__TEMPERATURE": "0.25",
            "TOKENBUDGET__BUDGET__UNIT": "samples",
            "TOKENBUDGET__KAFKA__BOOTSTRAP": "10.0.0.1:9092",
            "UNRELATED": "ignored",
            "TOKENBUDGET_SINGLE_UNDERSCORE": "ignored too",
        },
    )
    assert config.inference.url == "http://gpu-box:30000"
    assert config.inference.temperature == 0.25
    assert config.budget.unit == "samples"
    assert config.kafka.bootstrap == "10.0.0.1:9092"


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("TOKENBUDGET__NOSUCH__X", "nosuch.x"),
        ("TOKENBUDGET__DATASETS__BUDGET", "datasets.budget"),
        ("TOKENBUDGET__INFERENCE__NOSUCH", "inference.nosuch"),
    ],
)
def test_bad_env_override_raises(name: str, key: str) -> None:
    assert config_error({}, environ={name: "1"}).key == key


@pytest.mark.parametrize(
    "name", ["TOKENBUDGET__INFERENCE", "TOKENBUDGET__A__B__C", "TOKENBUDGET____X"]
)
def test_malformed_env_name_raises(name: str) -> None:
    assert config_error({}, environ={name: "1"}).key == name


def test_env_override_with_wrong_type_is_named() -> None:
    error = config_error({}, environ={"TOKENBUDGET__INFERENCE__CONCURRENCY": "many"})
    assert error.key == "inference.concurrency"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TOKENBUDGET__INFERENCE__MODEL", "7"),
        ("TOKENBUDGET__INFERENCE__MODEL", "true"),
        ("TOKENBUDGET__INFERENCE__MODEL", "2024-01-01"),
        ("TOKENBUDGET__KAFKA__NAMESPACE", "2024"),
        ("TOKENBUDGET__INFERENCE__API_KEY_ENV", '"quoted"'),
    ],
)
def test_env_override_of_a_string_key_is_taken_verbatim(name: str, value: str) -> None:
    _, section, key = name.lower().split("__")
    config = build({}, environ={name: value})
    assert getattr(getattr(config, section), key) == value


def test_env_override_of_a_literal_key_is_taken_verbatim() -> None:
    config = build({}, environ={"TOKENBUDGET__PRODUCER__ON_BAD_ROW": "fail"})
    assert config.producer.on_bad_row == "fail"


# ---- Kafka security ----------------------------------------------------------------

SECURED = {
    "bootstrap": "kafka.example:9093",
    "security_protocol": "SASL_SSL",
    "sasl_mechanism": "SCRAM-SHA-512",
    "sasl_username": "alice",
    "sasl_password_env": "KAFKA_PASSWORD",
}


def test_secured_kafka_config_holds_names_not_secrets() -> None:
    config = build({"kafka": {**SECURED, "ssl_cafile": "ca.pem"}}, environ=NO_ENV)
    assert config.kafka.security_protocol == "SASL_SSL"
    assert config.kafka.sasl_password_env == "KAFKA_PASSWORD"
    assert config.kafka.ssl_check_hostname is True
    assert build({}, environ=NO_ENV).kafka.security_protocol == "PLAINTEXT"


@pytest.mark.parametrize(
    ("section", "key", "fix"),
    [
        ("kafka", "sasl_password", "kafka.sasl_password_env"),
        ("kafka", "password", "kafka.sasl_password_file"),
        ("kafka", "ssl_key_password", "kafka.ssl_key_password_env"),
        ("inference", "api_key", "inference.api_key_env"),
    ],
)
def test_a_secret_in_the_config_is_refused_with_the_fix(section: str, key: str, fix: str) -> None:
    data: dict[str, Any] = {"kafka": dict(SECURED)}
    data.setdefault(section, {})[key] = "hunter2-in-toml"
    error = config_error(data)
    assert error.key == f"{section}.{key}"
    assert fix in str(error)
    assert "hunter2" not in str(error)


def test_a_secret_in_an_env_override_is_refused_too() -> None:
    error = config_error(
        {"kafka": SECURED}, environ={"TOKENBUDGET__KAFKA__SASL_PASSWORD": "hunter2-env"}
    )
    assert error.key == "kafka.sasl_password"
    assert "hunter2" not in str(error)


def test_security_env_overrides() -> None:
    config = build(
        {"kafka": {"bootstrap": "kafka.example:9093"}},
        environ={
            "TOKENBUDGET__KAFKA__SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "TOKENBUDGET__KAFKA__SASL_MECHANISM": "PLAIN",
            "TOKENBUDGET__KAFKA__SASL_USERNAME": "svc",
            "TOKENBUDGET__KAFKA__SASL_PASSWORD_FILE": "/run/secrets/kafka",
        },
    )
    assert config.kafka.security_protocol == "SASL_PLAINTEXT"
    assert config.kafka.sasl_password_file == "/run/secrets/kafka"


@pytest.mark.parametrize(
    ("kafka", "key"),
    [
        ({"sasl_mechanism": ""}, "kafka.sasl_mechanism"),
        ({"sasl_mechanism": "GSSAPI"}, "kafka.sasl_mechanism"),
        ({"sasl_username": ""}, "kafka.sasl_username"),
        ({"sasl_password_env": ""}, "kafka.sasl_password_env"),
        ({"sasl_password_file": "pw"}, "kafka.sasl_password_file"),  # and _env: both
        ({"security_protocol": "TLS"}, "kafka.security_protocol"),
        ({"security_protocol": "SSL"}, "kafka.sasl_mechanism"),  # SASL keys without SASL
        ({"security_protocol": "SASL_PLAINTEXT", "ssl_cafile": "ca.pem"}, "kafka.ssl_cafile"),
        ({"ssl_keyfile": "client.key"}, "kafka.ssl_keyfile"),  # without ssl_certfile
        ({"ssl_key_password_env": "K"}, "kafka.ssl_key_password_env"),
        ({"bootstrap": "local"}, "kafka.security_protocol"),  # the local broker: PLAINTEXT
    ],
)
def test_security_combinations_that_cannot_work_are_named(kafka: dict[str, Any], key: str) -> None:
    error = config_error({"kafka": {**SECURED, **kafka}})
    assert error.key == key
    assert key in str(error)


# ---- a Kafka cluster -------------------------------------------------------------


def test_cluster_keys_default_to_the_clusters_own_settings() -> None:
    kafka = build({}, environ=NO_ENV).kafka
    assert (kafka.replication_factor, kafka.min_insync_replicas, kafka.partitions) == (-1, -1, 4)


def test_a_bootstrap_list_is_kept_whole_without_spaces() -> None:
    config = build({"kafka": {"bootstrap": "k1:9092, k2:9092 ,[::1]:9093"}}, environ=NO_ENV)
    assert config.kafka.bootstrap == "k1:9092,k2:9092,[::1]:9093"


@pytest.mark.parametrize("bootstrap", ["k1:9092,k2", "k1:9092,,k2:9092", "k1", "k1:port"])
def test_a_bootstrap_entry_without_a_port_is_named(bootstrap: str) -> None:
    error = config_error({"kafka": {"bootstrap": bootstrap}})
    assert error.key == "kafka.bootstrap"
    assert "HOST:PORT" in str(error)


@pytest.mark.parametrize(
    ("kafka", "key"),
    [
        ({"replication_factor": 0}, "kafka.replication_factor"),
        ({"replication_factor": -2}, "kafka.replication_factor"),
        ({"min_insync_replicas": 0}, "kafka.min_insync_replicas"),
        ({"partitions": 0}, "kafka.partitions"),
        (
            {"bootstrap": "k1:9092", "replication_factor": 2, "min_insync_replicas": 3},
            "kafka.min_insync_replicas",
        ),
        ({"replication_factor": 3}, "kafka.replication_factor"),  # the local broker
    ],
)
def test_replication_settings_that_cannot_work_are_named(kafka: dict[str, Any], key: str) -> None:
    assert config_error({"kafka": kafka}).key == key


def test_the_configured_layout_reaches_every_topic_spec() -> None:
    from tokenbudget.app.bootstrap import topic_specs

    config = build(
        {
            "kafka": {
                "bootstrap": "k1:9092,k2:9092,k3:9092",
                "replication_factor": 3,
                "min_insync_replicas": 2,
                "partitions": 8,
            }
        },
        environ=NO_ENV,
    )
    specs = topic_specs(config)
    assert {s.replication_factor for s in specs} == {3}
    assert {s.configs["min.insync.replicas"] for s in specs} == {"2"}
    keyed = [s for s in specs if not s.name.endswith("-__assignor-__leader")]
    assert {s.partitions for s in keyed} == {8}  # co-partitioned


# ---- keys with a fixed set of values ---------------------------------------------


def literal_keys() -> list[tuple[str, tuple[Any, ...]]]:
    """Every key of the config whose type is a Literal, with its values, as
    ``(section.key, values)``; dataset keys as ``datasets[0].key``."""
    found = []
    for section, kind in typing.get_type_hints(RawConfig).items():
        struct = typing.get_args(kind)[0] if section == "datasets" else kind
        prefix = "datasets[0]" if section == "datasets" else section
        for key, hint in typing.get_type_hints(struct).items():
            if typing.get_origin(hint) is typing.Literal:
                found.append((f"{prefix}.{key}", typing.get_args(hint)))
    return found


def test_the_config_has_literal_keys_in_every_part_that_checks_them() -> None:
    keys = dict(literal_keys())
    assert keys["inference.api"] == ("sglang", "openai-completions", "openai-chat")
    assert {"budget.unit", "kafka.security_protocol", "producer.on_bad_row"} <= keys.keys()
    assert {"datasets[0].format", "datasets[0].turns"} <= keys.keys()


@pytest.mark.parametrize(("key", "values"), literal_keys(), ids=lambda v: str(v))
@pytest.mark.parametrize("bad", ["vllm", 3])
def test_a_bad_value_of_any_literal_key_lists_every_value_it_takes(
    key: str, values: tuple[Any, ...], bad: object
) -> None:
    section, name = key.split(".")
    data: dict[str, Any] = (
        {"datasets": [dataset("a", **{name: bad})]}
        if section == "datasets[0]"
        else {section: {name: bad}}
    )
    error = config_error(data, source="job.toml")
    assert error.key == key
    listed = ", ".join(repr(v) for v in values)
    assert str(error).endswith(f"; use one of {listed}")
    if bad == "vllm":
        assert f"config key '{key}': 'vllm' is not a valid value; use one of" in str(error)


def test_a_bad_literal_from_the_environment_lists_the_values_too() -> None:
    error = config_error({}, environ={"TOKENBUDGET__INFERENCE__API": "vllm"})
    assert error.key == "inference.api"
    assert "'vllm' is not a valid value; use one of 'sglang', 'openai-completions'" in str(error)


# ---- inference.url ---------------------------------------------------------------


@pytest.mark.parametrize(
    "url", ["http://gpu1:30000,http://gpu2:30000", "http://gpu1:30000, http://gpu2:30000", "a,b"]
)
def test_several_servers_in_inference_url_say_what_to_do_instead(url: str) -> None:
    error = config_error({"inference": {"url": url}})
    assert error.key == "inference.url"
    assert str(error).endswith(one_server_per_url(url))
    assert "give each server its own [[inference.servers]] table" in str(error)
    assert "pass --server URL once per server to `tokenbudget run`" in str(error)


# ---- inference.servers -------------------------------------------------------------


def test_servers_take_inference_settings_they_do_not_set() -> None:
    config = build(
        {
            "inference": {
                "concurrency": 32,
                "api_key_env": "KEY",
                "servers": [
                    {"url": "http://gpu1:30000/"},
                    {"url": "http://gpu2:30000", "concurrency": 128, "weight": 2.5},
                    {"url": "https://gpu3", "api_key_env": "GPU3_KEY"},
                ],
            }
        },
        environ=NO_ENV,
    )
    assert [(s.url, s.concurrency, s.api_key_env, s.weight) for s in config.servers] == [
        ("http://gpu1:30000", 32, "KEY", 1.0),
        ("http://gpu2:30000", 128, "KEY", 2.5),
        ("https://gpu3", 32, "GPU3_KEY", 1.0),
    ]
    assert config.concurrency == 32 + 128 + 32  # what the fleet takes at once


def test_one_url_is_a_fleet_of_one_and_no_url_the_local_default() -> None:
    one = build({"inference": {"url": "http://router:8000", "concurrency": 8}}, environ=NO_ENV)
    assert [(s.url, s.concurrency) for s in one.servers] == [("http://router:8000", 8)]
    assert [s.url for s in build({}, environ=NO_ENV).servers] == ["http://127.0.0.1:30000"]


@pytest.mark.parametrize(
    ("servers", "key", "problem"),
    [
        (
            [{"url": "http://a:1"}, {"url": "http://b:1"}, {"url": "ftp://c"}],
            "inference.servers[2].url",
            "is not an http(s) URL",
        ),
        (
            [{"url": "http://a:1"}, {"url": "http://a:1/"}],
            "inference.servers[1].url",
            "is inference.servers[0] already",
        ),
        (
            [{"url": "http://a:1,http://b:1"}],
            "inference.servers[0].url",
            "give each server its own",
        ),
        ([{"concurrency": 4}], "inference.servers[0].url", "missing required field"),
        (
            [{"url": "http://a:1", "concurrency": 0}],
            "inference.servers[0].concurrency",
            "must be positive",
        ),
        (
            [{"url": "http://a:1", "weight": 0}],
            "inference.servers[0].weight",
            "must be a positive number",
        ),
        (
            [{"url": "http://a:1", "api_key": "s3cret"}],
            "inference.servers[0].api_key",
            "unknown field",
        ),
    ],
)
def test_a_bad_server_entry_is_named_by_its_index(
    servers: list[dict[str, Any]], key: str, problem: str
) -> None:
    error = config_error({"inference": {"servers": servers}})
    assert error.key == key and problem in str(error)


def test_url_and_servers_together_are_refused_naming_url() -> None:
    error = config_error({"inference": {"url": "http://a:1", "servers": [{"url": "http://b:1"}]}})
    assert error.key == "inference.url" and "not both" in str(error)


def test_the_environment_names_the_servers_in_place_of_the_files() -> None:
    file = {"inference": {"servers": [{"url": "http://a:1"}, {"url": "http://b:1"}]}}
    one = build(file, environ={"TOKENBUDGET__INFERENCE__URL": "http://c:1"})
    assert [s.url for s in one.servers] == ["http://c:1"]
    several = build(
        {"inference": {"url": "http://a:1"}},
        environ={"TOKENBUDGET__INFERENCE__SERVERS": '[{url = "http://c:1"}, {url = "http://d:1"}]'},
    )
    assert [s.url for s in several.servers] == ["http://c:1", "http://d:1"]


def test_servers_given_on_the_command_line_replace_the_configs() -> None:
    config = build({"inference": {"url": "http://a:1", "concurrency": 16}}, environ=NO_ENV)
    moved = with_servers(config, ["http://c:1", "http://d:1/"])
    assert [(s.url, s.concurrency) for s in moved.servers] == [
        ("http://c:1", 16),
        ("http://d:1", 16),
    ]
    with pytest.raises(ConfigError) as info:
        with_servers(config, ["gpu1:30000"])
    assert info.value.key == "--server" and "is not an http(s) URL" in str(info.value)


@pytest.mark.parametrize(
    ("url", "problem"),
    [("http://gpu1:3o000", "Port could not be cast"), ("http://:30000", "names no host")],
)
def test_a_url_that_cannot_be_requested_is_named(url: str, problem: str) -> None:
    error = config_error({"inference": {"url": url}})
    assert error.key == "inference.url" and problem in str(error)


# ---- datasets ----------------------------------------------------------------------


def test_run_and_produce_need_a_dataset() -> None:
    build({}, environ=NO_ENV)  # ledger, dispatch and status need none
    with pytest.raises(ConfigError) as info:
        build({}, environ=NO_ENV, source="job.toml").require_datasets()
    assert str(info.value) == (
        "job.toml: config key 'datasets': no [[datasets]] table: add one with name, path and budget"
    )


def test_column_mapping_keys() -> None:
    config = build(
        {
            "datasets": [
                dataset("a"),
                dataset("b", prompt_field="question", id_field="qid"),
                dataset("c", prompt_template="{instruction}\n\n{input?}"),
                dataset("d", messages_field="dialog"),
            ],
            "inference": {"api": "openai-chat"},
        },
        environ=NO_ENV,
    )
    a, b, c, d = (ds.columns for ds in config.datasets)
    assert a == Columns() and a.id_field == "id"
    assert (b.prompt_field, b.id_field) == ("question", "qid")
    assert c.prompt_template == PromptTemplate.parse("{instruction}\n\n{input?}")
    assert d.messages_field == "dialog"


@pytest.mark.parametrize(
    ("extra", "key", "message"),
    [
        (
            {"prompt_field": "question", "prompt_template": "{question}"},
            "prompt_template",
            "set one of prompt_field, prompt_template, messages_field, not both",
        ),
        (
            {"prompt_template": "{q}", "messages_field": "dialog"},
            "messages_field",
            "not both prompt_template and messages_field",
        ),
        ({"prompt_template": "{input!r}"}, "prompt_template", "a placeholder is {field} or"),
        ({"prompt_template": "{a}\n{b?}"}, "prompt_template", "{b?} shares a paragraph"),
        (
            {"prompt_field": "question", "format": "openai"},
            "prompt_field",
            "maps a plain prompt, which format 'openai' does not read: set format = \"auto\"",
        ),
        (
            {"prompt_template": "{q}", "format": "sharegpt"},
            "prompt_template",
            "maps a plain prompt, which format 'sharegpt' does not read",
        ),
        (
            {"messages_field": "dialog", "format": "prompt"},
            "messages_field",
            "maps chat turns, which format 'prompt' does not read",
        ),
        ({"prompt_field": "q", "turns": "all"}, "turns", "'all' needs conversations"),
        ({"prompt_field": " q"}, "prompt_field", "' q' is not a field name"),
        ({"id_field": ""}, "id_field", "'' is not a field name"),
        ({"messages_field": "dialog"}, "template", "is chat (messages_field 'dialog')"),
    ],
)
def test_column_mappings_that_cannot_work_are_named(
    extra: dict[str, Any], key: str, message: str
) -> None:
    # api sglang sends raw text: chat needs template = true
    error = config_error({"datasets": [dataset("x"), dataset("a", **extra)]})
    assert error.key == f"datasets[1].{key}"
    assert message in str(error)


# ---- sizes and compression ----------------------------------------------------------


def test_size_and_compression_defaults() -> None:
    config = build({}, environ=NO_ENV)
    assert config.kafka.compression == "zstd"
    assert config.producer.max_prompt_bytes == sizes.DEFAULT_PROMPT_BYTES == 1024 * 1024
    assert config.producer.max_prompt_tokens == 0


@pytest.mark.parametrize("codec", ["zstd", "lz4", "gzip", "none"])
def test_compression_choices_also_from_the_environment(codec: str) -> None:
    assert build({"kafka": {"compression": codec}}, environ=NO_ENV).kafka.compression == codec
    env = {"TOKENBUDGET__KAFKA__COMPRESSION": codec}
    assert build({}, environ=env).kafka.compression == codec


@pytest.mark.parametrize(
    ("data", "key", "says"),
    [
        (
            {"kafka": {"compression": "snappy"}},
            "kafka.compression",
            "'snappy' is not a valid value; use one of 'zstd', 'lz4', 'gzip', 'none'",
        ),
        ({"producer": {"max_prompt_bytes": 0}}, "producer.max_prompt_bytes", "within 1.."),
        # over half a Kafka message: the answer would have no room beside it
        (
            {"producer": {"max_prompt_bytes": sizes.PROMPT_EVENT_BYTES + 1}},
            "producer.max_prompt_bytes",
            "the other half holds the answer",
        ),
        ({"producer": {"max_prompt_tokens": -1}}, "producer.max_prompt_tokens", "0: no limit"),
    ],
)
def test_size_settings_that_cannot_work_are_named(
    data: dict[str, Any], key: str, says: str
) -> None:
    error = config_error(data)
    assert error.key == key
    assert says in str(error)


def test_the_size_limit_reaches_every_topic_spec() -> None:
    from tokenbudget.app.bootstrap import topic_specs

    specs = topic_specs(build({}, environ=NO_ENV))
    assert {s.configs["max.message.bytes"] for s in specs} == {str(sizes.MESSAGE_BYTES)}


# ---- a thinking model's reasoning -----------------------------------------------------


def test_reasoning_disable_turns_the_templates_thinking_off_unless_the_dataset_says_how() -> None:
    config = build(
        {
            "inference": {"api": "openai-chat", "chat_template_kwargs": {"max_think": 2}},
            "datasets": [
                dataset("off", reasoning="disable"),
                dataset("own", reasoning="disable", chat_template_kwargs={"mode": "fast"}),
                dataset("saved", reasoning="save"),
                dataset("unset"),
            ],
        },
        environ=NO_ENV,
    )
    kwargs = {d.name: d.sampling.get("chat_template_kwargs") for d in config.datasets}
    assert kwargs == {
        # both switches: Qwen3's and GLM's templates read one, DeepSeek's and Kimi's the other
        "off": {"max_think": 2, "enable_thinking": False, "thinking": False},
        "own": {"mode": "fast"},  # a template that reads another key: its own, as written
        "saved": {"max_think": 2},
        "unset": {"max_think": 2},
    }
    assert [d.reasoning for d in config.datasets] == ["disable", "disable", "save", None]
    assert config.inference.reasoning_end == "</think>"


@pytest.mark.parametrize(
    ("inference", "extra", "fix"),
    [
        ({"api": "sglang"}, {}, "set template = true"),
        ({"api": "openai-completions"}, {}, 'api = "openai-chat"'),
        ({"api": "openai-chat"}, {"chat_template_kwargs": {"enable_thinking": True}},
         "set enable_thinking = true: drop one"),
        ({"api": "openai-chat"}, {"chat_template_kwargs": {"thinking": True}}, "drop one"),
    ],
)  # fmt: skip
def test_reasoning_disable_that_would_think_anyway_is_named(
    inference: dict[str, Any], extra: dict[str, Any], fix: str
) -> None:
    data = {"inference": inference, "datasets": [dataset(reasoning="disable", **extra)]}
    error = config_error(data, source="job.toml")
    assert error.key == "datasets[0].reasoning" and fix in str(error)


def test_a_bad_reasoning_value_lists_the_values() -> None:
    error = config_error({"datasets": [dataset(reasoning="keep")]})
    assert error.key == "datasets[0].reasoning"
    assert str(error).endswith("'keep' is not a valid value; use one of 'save', 'disable'")


# ---- [budget] reserve ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("budget", "inference", "says"),
    [
        ({"admission": "halt"}, {"stream": True}, 'budget.admission = "reserve"'),
        ({"unit": "samples"}, {"stream": True}, 'budget.unit = "completion_tokens"'),
        ({"on_boundary": "finish"}, {"stream": True}, 'budget.on_boundary = "truncate"'),
        ({}, {}, "inference.stream = true"),
    ],
)
def test_growing_reservations_name_what_they_need(
    budget: dict[str, Any], inference: dict[str, Any], says: str
) -> None:
    error = config_error(
        {
            "inference": {"url": "http://h:1", **inference},
            "budget": {"reserve": "grow", **budget},
            "datasets": [dataset()],
        }
    )
    assert error.key == "budget.reserve"
    assert says in str(error)


def test_growing_reservations_with_streamed_answers_are_accepted() -> None:
    config = build(
        {
            "inference": {"url": "http://h:1", "stream": True},
            "budget": {"reserve": "grow", "cut": "any"},
            "datasets": [dataset()],
        },
        environ=NO_ENV,
    )
    assert (config.budget.reserve, config.budget.cut) == ("grow", "any")


@pytest.mark.parametrize("key", ["connect_timeout_s", "read_timeout_s"])
@pytest.mark.parametrize("value", [0, -1.5])
def test_a_timeout_that_is_not_positive_is_refused_naming_its_key(key: str, value: float) -> None:
    error = config_error({"inference": {key: value}})
    assert error.key == f"inference.{key}" and "must be positive" in str(error)


@pytest.mark.parametrize("value", [0, -1])
def test_a_reply_limit_that_is_not_positive_is_refused_naming_its_key(value: int) -> None:
    error = config_error({"inference": {"max_reply_bytes": value}})
    assert error.key == "inference.max_reply_bytes" and "must be positive" in str(error)


@pytest.mark.parametrize("value", [-1.0, float("nan"), float("inf")])
def test_a_floor_speed_that_is_negative_or_not_finite_is_refused_naming_its_key(
    value: float,
) -> None:
    error = config_error({"inference": {"min_tokens_per_s": value}})
    assert error.key == "inference.min_tokens_per_s"


def test_reply_limits_default_to_a_long_answer_and_a_token_a_second() -> None:
    inference = build({"inference": {"min_tokens_per_s": 0}}, environ=NO_ENV).inference
    assert inference.min_tokens_per_s == 0  # no total limit
    defaults = build({}, environ=NO_ENV).inference
    assert (defaults.max_reply_bytes, defaults.min_tokens_per_s) == (sizes.REPLY_BYTES, 1.0)


# ---- numbers that pass a type check but cannot work ------------------------------------


def _unwrapped(hint: Any) -> Any:
    """A key's type without its description, bounds and None."""
    if typing.get_origin(hint) is typing.Annotated:
        return _unwrapped(typing.get_args(hint)[0])
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return _unwrapped(args[0])
    return hint


def keys_of(kind: type) -> list[str]:
    """Every key of the config of type ``kind`` (a table of a list as its first entry)."""
    found = []

    def walk(struct: type, prefix: str) -> None:
        for name, hint in typing.get_type_hints(struct, include_extras=True).items():
            inner = _unwrapped(hint)
            if isinstance(inner, type) and issubclass(inner, msgspec.Struct):
                walk(inner, name)  # a section
            elif typing.get_origin(inner) is list and isinstance(typing.get_args(inner)[0], type):
                item = typing.get_args(inner)[0]
                if issubclass(item, msgspec.Struct):
                    walk(item, f"{prefix}.{name}[0]" if prefix else f"{name}[0]")
            elif inner is kind:
                found.append(f"{prefix}.{name}" if prefix else name)

    walk(RawConfig, "")
    return found


# What a table of a list needs beside the key under test.
_TABLES = {
    "datasets[0]": dataset(),
    "inference.servers[0]": {"url": "http://h:1"},
    "kafka.roles[0]": {"role": "producer", "sasl_username": "p"},
}


def setting(key: str, value: Any) -> dict[str, Any]:
    """The config data that sets ``key`` (``inference.servers[0].weight``) to ``value``."""
    for table, needs in _TABLES.items():
        if key.startswith(table + "."):
            entry = {**needs, key[len(table) + 1 :]: value}
            section, _, field = table.removesuffix("[0]").rpartition(".")
            return {section: {field: [entry]}} if section else {field: [entry]}
    section, name = key.split(".")
    return {section: {name: value}}


FLOAT_KEYS = keys_of(float)


def test_the_float_keys_are_found_in_every_part_of_the_config() -> None:
    for key in (
        "inference.read_timeout_s",
        "budget.lease_ttl_s",
        "inference.health_interval_s",
        "sink.flush_interval_s",
        "inference.servers[0].weight",
        "datasets[0].temperature",
    ):
        assert key in FLOAT_KEYS


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_float_key_that_is_not_a_finite_number_is_refused_naming_it(
    key: str, value: float
) -> None:
    error = config_error(setting(key, value))
    assert error.key == key and f"got {value}" in str(error)


def test_nan_and_inf_written_in_toml_or_the_environment_are_refused_too(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text("[inference]\nread_timeout_s = nan\n")
    with pytest.raises(ConfigError) as info:
        load(path, environ=NO_ENV)
    assert info.value.key == "inference.read_timeout_s"
    error = config_error({}, environ={"TOKENBUDGET__BUDGET__LEASE_TTL_S": "inf"})
    assert error.key == "budget.lease_ttl_s" and "finite" in str(error)


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("sink.rotate_bytes", -1, "must be positive, got -1"),
        ("sink.rotate_rows", -1, "must be positive, got -1"),
        ("sink.row_group_rows", 0, "must be positive, got 0"),
        ("sink.flush_interval_s", -1.0, "must be positive, got -1.0"),
        ("budget.snapshot_interval_s", 0.0, "must be positive, got 0.0"),
        ("producer.max_queued_per_dataset", -1, "must be >= 0, got -1"),
        ("inference.backoff_s", -1.0, "must be >= 0, got -1.0"),
        ("inference.backoff_max_s", -1.0, "must be >= 0, got -1.0"),
        ("inference.health_interval_s", 0.0, "must be positive, got 0.0"),
        ("inference.servers[0].concurrency", -1, "must be positive, got -1"),
        ("kafka.local_port", 0, "must be positive, got 0"),
        ("kafka.local_controller_port", 70_000, "must be <= 65,535, got 70000"),
        ("metrics.port", -1, "must be >= 0, got -1"),
        ("kafka.prompt_retention_ms", 0, "must be positive, or -1 for forever; got 0"),
        ("datasets[0].max_new_tokens", -5, "must be positive, got -5"),
        ("datasets[0].max_new_tokens", 0, "must be positive, got 0"),
        ("inference.max_new_tokens", 2**31, "must be <= 2,147,483,647, got 2147483648"),
        ("datasets[0].max_new_tokens", 2**31, "must be <= 2,147,483,647, got 2147483648"),
        ("inference.servers[0].concurrency", 2**31, "must be <= 2,147,483,647"),
        ("budget.lease_tokens", 2**63, "within ±9,223,372,036,854,775,807"),
    ],
)
def test_a_size_or_count_that_cannot_work_is_refused_naming_it(
    key: str, value: float, says: str
) -> None:
    error = config_error(setting(key, value))
    assert error.key == key and says in str(error)


@pytest.mark.parametrize("budget", [2**63, "9223372036854775808", "10000000000G"])
def test_a_budget_past_the_events_range_is_refused_naming_it(budget: object) -> None:
    error = config_error({"datasets": [dataset(budget=budget)]})
    assert error.key == "datasets[0].budget" and "9,223,372,036,854,775,807" in str(error)
    largest = build({"datasets": [dataset(budget=2**63 - 1)]}, environ=NO_ENV)
    assert largest.datasets[0].budget == sizes.MAX_TOKENS == 2**63 - 1


# ---- URLs hold nothing secret: they are shown in logs, metrics, events and status -----


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("http://user:s3cret@gpu1:30000", "holds a user or password"),
        ("https://s3cret@gpu1:30000/v1", "holds a user or password"),
        ("http://gpu1:30000/?key=s3cret", "has a query string or fragment"),
        ("http://gpu1:30000/generate?api_key=s3cret&x=1", "has a query string or fragment"),
        ("http://gpu1:30000/#s3cret", "has a query string or fragment"),
    ],
)
@pytest.mark.parametrize("where", ["inference.url", "inference.servers[0].url", "--server"])
def test_a_url_with_credentials_or_a_query_is_refused_naming_its_key_not_the_secret(
    url: str, says: str, where: str
) -> None:
    if where == "--server":
        with pytest.raises(ConfigError) as info:
            with_servers(build({}, environ=NO_ENV), [url])
        error = info.value
    else:
        error = config_error(setting(where, url))
    assert error.key == where and says in str(error)
    assert "api_key_env" in str(error) and "s3cret" not in str(error)
    assert "gpu1:30000" in str(error)  # which URL, without what it held


def test_a_plain_http_url_is_taken_and_said_to_be_in_clear_off_this_machine_only() -> None:
    clear = ["http://gpu1:30000", "http://10.0.0.7:30000", "http://[fe80::1]:30000"]
    local = ["http://127.0.0.1:30000", "http://localhost:30000", "http://[::1]:30000"]
    config = build({"inference": {"servers": [{"url": u} for u in clear + local]}}, environ={})
    assert [in_clear(s.url) for s in config.servers] == [True] * 3 + [False] * 3
    assert not in_clear("https://gpu1:30000")


def test_added_server_keys_are_checked_as_they_are_read() -> None:
    prefix = config_error({"inference": {"added_servers": ["gpu-"]}})
    assert prefix.key == "inference.added_servers[0]" and "https://gpu-" in str(prefix)
    name = config_error({"inference": {"added_server_keys": ["GPU KEY"]}})
    assert name.key == "inference.added_server_keys[0]" and "environment variable" in str(name)


# ---- a job is its config: its name, and the namespace it runs under -------------------


def _job_file(folder: Path, text: str = "", name: str = "job.toml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def test_a_config_that_names_no_job_is_the_job_of_its_file(tmp_path: Path) -> None:
    first = load(_job_file(tmp_path / "a"), environ={})
    second = load(_job_file(tmp_path / "b"), environ={})
    again = load(tmp_path / "a" / "job.toml", environ={})
    copied = load(_job_file(tmp_path / "a", name="job-v2.toml"), environ={})
    names = [c.kafka.namespace for c in (first, second, again, copied)]
    assert names[0] == again.kafka.namespace == first.job.name  # a rerun: the same job
    assert len({names[0], names[1], names[3]}) == 3  # two folders, or another file: others
    assert names[0].startswith("job-") and names[3].startswith("job-v2-")
    # relative or not, the same file is the same job
    relative = Path(os.path.relpath(tmp_path / "a" / "job.toml"))
    assert load(relative, environ={}).kafka.namespace == names[0]


def test_a_jobs_name_is_its_namespace_unless_kafka_namespace_says_otherwise(
    tmp_path: Path,
) -> None:
    named = load(_job_file(tmp_path, '[job]\nname = "regen-dec"\n'), environ={})
    assert (named.job.name, named.kafka.namespace) == ("regen-dec", "regen-dec")
    both = '[job]\nname = "regen-dec"\n[kafka]\nnamespace = "tokenbudget"\n'
    kept = load(_job_file(tmp_path, both), environ={})
    assert (kept.job.name, kept.kafka.namespace) == ("regen-dec", "tokenbudget")
    assert build({}, environ=NO_ENV).kafka.namespace == "tokenbudget"  # no file: as before


@pytest.mark.parametrize(("section", "key"), [("job", "name"), ("kafka", "namespace")])
def test_a_job_name_or_namespace_that_cannot_name_topics_is_refused_naming_its_key(
    section: str, key: str
) -> None:
    for bad in ("a.b", "a b", "x" * 101, "../x"):
        error = config_error({section: {key: bad}})
        assert error.key == f"{section}.{key}" and "letters, digits" in str(error)
