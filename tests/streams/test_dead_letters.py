"""Dead letters: a record's payload, reason and origin kept, a bad dataset row's place
and excerpt, and a letter that fits in a message whatever the record's size."""

from __future__ import annotations

import base64

import pytest

from tokenbudget.core.errors import DatasetError, EventDecodeError
from tokenbudget.streams import codec
from tokenbudget.streams.dead_letters import (
    EXCERPT_CHARS,
    PREFIX_BYTES,
    bad_row_letter,
    dead_letter,
)


def test_dead_letter_keeps_payload_and_reason() -> None:
    payload = b'{"type": "completion", "v": 1, "trunc'
    letter = dead_letter(
        "not a tokenbudget event: truncated",
        source_topic="ns.completions",
        payload=payload,
        partition=3,
        offset=42,
        key=b"ds",
    )
    assert letter.reason == "not a tokenbudget event: truncated"
    assert letter.payload == payload.decode()
    assert letter.source_topic == "ns.completions"
    assert letter.partition == 3
    assert letter.offset == 42
    assert letter.key == "ds"
    assert letter.at > 0
    # The letter itself survives the wire.
    assert codec.decode(codec.encode(letter)) == letter


def test_dead_letter_of_binary_payload_and_no_key() -> None:
    letter = dead_letter("garbage", source_topic="t", payload=b"ab\xffcd", key=None)
    assert letter.payload == "ab\ufffdcd"
    assert letter.key is None
    assert letter.partition == -1
    assert letter.offset == -1
    empty = dead_letter("empty", source_topic="t", payload=None)
    assert empty.payload == ""
    assert codec.decode(codec.encode(letter)) == letter


def test_a_bad_row_letter_names_dataset_line_and_fix_and_keeps_only_an_excerpt() -> None:
    row = DatasetError(
        "data/big.jsonl",
        "the prompt is 1,500,000 bytes of UTF-8, over [producer] max_prompt_bytes",
        line=3,
        excerpt="aaaa... (1,499,996 more characters)",
        size=1_500_000,
    )
    letter = bad_row_letter("big", row, "fix: shorten the row")
    assert letter.key == "big" and letter.source == "data/big.jsonl:3"
    assert letter.size == 1_500_000 and letter.payload == row.excerpt
    assert letter.reason.startswith("bad row of dataset big at data/big.jsonl:3: the prompt is")
    assert letter.reason.endswith("fix: shorten the row")
    assert letter.source_topic == ""  # it never was an event
    assert codec.decode(codec.encode(letter)) == letter
    # Readers of an older build ignore the fields they do not know.
    assert (
        codec.decode(codec.encode(letter).replace(b',"source":"data/big.jsonl:3"', b"")).key
        == "big"
    )


def test_a_binary_record_of_1_5_mb_is_a_bad_event_and_its_letter_fits_in_a_message() -> None:
    data = bytes(range(256)) * (1_500_000 // 256)
    with pytest.raises(EventDecodeError) as info:
        codec.decode(data)
    letter = dead_letter(str(info.value), source_topic="ns.completions", payload=data)
    wire = codec.encode(letter)
    assert len(wire) < 200_000  # the record was 1.5 MB; the limit is 8 MiB
    assert letter.size == len(data)
    assert base64.b64decode(letter.payload_base64) == data[:PREFIX_BYTES]
    assert letter.sha256 == __import__("hashlib").sha256(data).hexdigest()
    assert len(letter.payload) <= EXCERPT_CHARS
    assert codec.decode(wire) == letter
