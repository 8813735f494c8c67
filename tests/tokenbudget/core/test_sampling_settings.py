"""The sampling settings are declared once (tokenbudget.core.sampling); the config's keys,
the event's fields, the Parquet column and the simulator's request log derive from it."""

from __future__ import annotations

import msgspec
import pyarrow as pa
import pytest

from tokenbudget.core.request_sections import DatasetConfig, InferenceConfig
from tokenbudget.core.sampling import SAMPLING_KEYS, VERBATIM_KEY, Sampling
from tokenbudget.dev.simulator.request import requested_settings
from tokenbudget.sinks.schema import SAMPLING_TYPE
from tokenbudget.streams.fields import SamplingParams


def test_the_config_takes_every_setting_in_both_sections() -> None:
    for section in (InferenceConfig, DatasetConfig):
        assert set(SAMPLING_KEYS) <= set(section.__struct_fields__)
        assert issubclass(section, Sampling)


def test_the_event_carries_every_setting_and_the_budgets_length() -> None:
    assert set(SamplingParams.__struct_fields__) == {*SAMPLING_KEYS, "max_new_tokens"}
    settings = SamplingParams(max_new_tokens=9, temperature=0.5, stop=["x"])
    assert settings.request_fields() == {"temperature": 0.5, "stop": ["x"]}


def test_an_event_keeps_rejecting_nothing_a_newer_writer_adds() -> None:
    # The config refuses an unknown key; an event read from a topic must not.
    decoded = msgspec.json.decode(b'{"temperature":0.5,"later":1}', type=SamplingParams)
    assert decoded.temperature == 0.5
    with pytest.raises(msgspec.ValidationError, match="later"):
        msgspec.convert({"temperature": 0.5, "later": 1}, InferenceConfig)


def test_the_parquet_column_has_every_setting_in_the_files_order() -> None:
    assert SAMPLING_TYPE.names == ["max_new_tokens", *SAMPLING_KEYS]
    by_name = {field.name: field.type for field in SAMPLING_TYPE}
    assert by_name["temperature"] == pa.float64()
    assert by_name["top_k"] == pa.int64()
    assert by_name["stop"] == pa.list_(pa.string())
    # free-form tables are JSON text
    assert by_name["chat_template_kwargs"] == by_name[VERBATIM_KEY] == pa.string()


def test_the_simulator_logs_every_setting_but_the_verbatim_body() -> None:
    payload = {key: 1 for key in SAMPLING_KEYS} | {"model": "m", "priority": 3}
    sampling, extra = requested_settings("openai-completions", payload)
    assert set(sampling) == set(SAMPLING_KEYS) - {VERBATIM_KEY}
    assert extra == {VERBATIM_KEY: 1, "priority": 3}
