"""The row formats' traits table: the one list of formats, which the config accepts,
the dataset parsers and the key's doc all cover."""

from __future__ import annotations

import typing

import pytest

from tokenbudget.core.columns import TEXT_KEYS, TURNS_KEYS
from tokenbudget.core.config import build
from tokenbudget.core.errors import ConfigError
from tokenbudget.core.formats import (
    DEFAULT_FORMAT,
    FORMAT_TRAITS,
    TEXT_TURNS,
    Turns,
    format_doc,
    formats_with,
)
from tokenbudget.producers.prompts.rows import PARSERS


def dataset(**extra: typing.Any) -> dict[str, typing.Any]:
    """A one-dataset job whose API takes chat rows as they are (any format goes)."""
    row = {"name": "a", "path": "a.jsonl", "budget": "1M", **extra}
    return {"inference": {"api": "openai-chat"}, "datasets": [row]}


def test_the_parsers_the_table_and_the_config_have_the_same_formats() -> None:
    assert set(PARSERS) == set(FORMAT_TRAITS)
    for name in FORMAT_TRAITS:
        assert build(dataset(format=name), environ={}).datasets[0].format == name
    with pytest.raises(ConfigError) as info:
        build(dataset(format="csv"), environ={})
    listed = ", ".join(repr(name) for name in FORMAT_TRAITS)
    assert str(info.value).endswith(f"'csv' is not a valid value; use one of {listed}")


def test_the_default_and_the_doc_come_from_the_table() -> None:
    assert build(dataset(), environ={}).datasets[0].format == DEFAULT_FORMAT
    assert format_doc() == (
        "`prompt`, `openai` (`messages`), `sharegpt` (`conversations` of `{from, value}`), "
        "`hf` (a folder written by `save_to_disk`), or `auto` (per row; a folder is `hf`)"
    )


def test_a_format_of_plain_prompts_has_only_first_turns_and_no_chat_keys() -> None:
    assert formats_with("all") == "openai, sharegpt, hf or auto"
    for name, traits in FORMAT_TRAITS.items():
        if traits.chat is False:
            assert (traits.turns, traits.conflicts) == (TEXT_TURNS, TURNS_KEYS), name
        else:
            assert traits.turns == typing.get_args(Turns), name
    assert [n for n, t in FORMAT_TRAITS.items() if t.conflicts == TEXT_KEYS] == [
        "openai",
        "sharegpt",
    ]
    assert [n for n, t in FORMAT_TRAITS.items() if not t.conflicts] == ["auto", "hf"]


def test_only_a_format_that_may_be_a_folder_has_splits() -> None:
    assert [n for n, t in FORMAT_TRAITS.items() if t.splits] == ["auto", "hf"]
    assert [n for n, t in FORMAT_TRAITS.items() if t.folder] == ["hf"]
