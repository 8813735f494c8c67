"""Wire format of every event: round trips, versions, decode errors, keys."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from streams import events as ev
from tokenbudget.errors import EventDecodeError

ALL_EVENTS: list[ev.Event] = [
    ev.PromptEvent(
        prompt_id="p1",
        dataset="ds",
        text="hello #code",
        sampling=ev.SamplingParams(max_new_tokens=64, temperature=0.7),
        source="data.jsonl:3",
        produced_at=1.5,
    ),
    ev.PromptEvent(
        prompt_id="p2",
        dataset="ds",
        messages=(
            ev.ChatMessage(role="system", content="be brief"),
            ev.ChatMessage(role="user", content="hi ✓"),
        ),
    ),
    ev.CompletionEvent(
        request_id="r1",
        prompt_id="p1",
        dataset="ds",
        prompt_tokens=3,
        completion_tokens=4,
        output_ids=[5, 6, 7, 8],
        finish_reason="length",
        max_new_tokens=4,
        text=" w5 w6 w7 w8",
        count_source="tokenizer",
        attempts=2,
        dispatched_at=1.0,
        first_token_at=1.25,
        finished_at=2.0,
    ),
    ev.BudgetSet(dataset="ds", budget=10_000_000, unit="total_tokens", set_at=3.0, set_by="cli"),
    ev.BudgetExceeded(dataset="ds", budget=10, used=12, trigger_request_id="r1", at=4.0),
    ev.BudgetRaised(dataset="ds", budget=20, used=12, unit="samples", at=5.0),
    ev.LedgerSnapshot(
        dataset="ds",
        budget=None,
        unit="completion_tokens",
        completion_tokens=1,
        prompt_tokens=2,
        samples=3,
        skipped=4,
        failed=5,
        produced=None,
        halted=False,
        status="open",
        outcome_events=12,
        at=6.0,
    ),
    ev.PromptSkipped(prompt_id="p3", dataset="ds", reason="halted", at=7.0),
    ev.PromptFailed(prompt_id="p4", dataset="ds", reason="HTTP 500", attempts=4, at=8.0),
    ev.ProducerDone(dataset="ds", produced=100, reason="limit", at=9.0),
    ev.DeadLetter(
        reason="bad",
        source_topic="t.completions",
        partition=2,
        offset=17,
        key="ds",
        payload="{not json",
        at=10.0,
    ),
]


@pytest.mark.parametrize("event", ALL_EVENTS, ids=lambda e: type(e).__name__)
def test_round_trip(event: ev.Event) -> None:
    data = ev.encode(event)
    assert isinstance(data, bytes)
    decoded = ev.decode(data)
    assert type(decoded) is type(event)
    assert decoded == event


EVENT_TYPES: list[type[Any]] = list(ev.Event.__args__)  # type: ignore[attr-defined]


def _sample(kind: msgspec.inspect.Type, name: str) -> Any:
    """A value of ``kind`` that differs from the field's default."""
    match kind:
        case msgspec.inspect.StrType():
            return f"{name}-value"
        case msgspec.inspect.BoolType():
            return True
        case msgspec.inspect.IntType():
            return 17
        case msgspec.inspect.FloatType():
            return 2.5
        case msgspec.inspect.LiteralType():
            return kind.values[-1]
        case msgspec.inspect.UnionType():
            real = [t for t in kind.types if not isinstance(t, msgspec.inspect.NoneType)]
            return _sample(real[0], name)
        case msgspec.inspect.ListType() | msgspec.inspect.VarTupleType():
            item = _sample(kind.item_type, name)
            return [item, item] if isinstance(kind, msgspec.inspect.ListType) else (item,)
        case msgspec.inspect.StructType():
            return kind.cls(
                **{f.name: _sample(f.type, f.name) for f in kind.fields if f.name != "v"}
            )
    raise AssertionError(f"no sample for {kind!r} ({name})")


def _full_instance(cls: type[Any]) -> Any:
    info = msgspec.inspect.type_info(cls)
    assert isinstance(info, msgspec.inspect.StructType)
    return cls(**{f.name: _sample(f.type, f.name) for f in info.fields if f.name != "v"})


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda c: c.__name__)
def test_round_trip_of_every_event_type_with_every_field_set(cls: type[Any]) -> None:
    event = _full_instance(cls)
    decoded = ev.decode(ev.encode(event))
    assert type(decoded) is cls
    assert decoded == event


@pytest.mark.parametrize("event", ALL_EVENTS, ids=lambda e: type(e).__name__)
def test_wire_carries_type_tag_and_version(event: ev.Event) -> None:
    wire = json.loads(ev.encode(event))
    assert wire["v"] == ev.SCHEMA_VERSION
    assert isinstance(wire["type"], str)
    assert wire["type"]


def test_tags_are_distinct() -> None:
    tags = [json.loads(ev.encode(_full_instance(cls)))["type"] for cls in EVENT_TYPES]
    assert len(set(tags)) == len(EVENT_TYPES)


def _with(event: ev.Event, **changes: object) -> bytes:
    wire = json.loads(ev.encode(event))
    wire.update(changes)
    return json.dumps(wire).encode()


BUDGET_SET = ev.BudgetSet(dataset="ds", budget=100)


@pytest.mark.parametrize("version", [0, 2, 99])
def test_unsupported_schema_version(version: int) -> None:
    with pytest.raises(EventDecodeError) as info:
        ev.decode(_with(BUDGET_SET, v=version))
    assert f"version {version}" in str(info.value)


def test_newer_version_with_unknown_shape_is_reported_as_a_version_problem() -> None:
    wire = {"type": "budget_set", "v": 2, "dataset": "ds", "amount": "lots"}
    with pytest.raises(EventDecodeError, match="version 2"):
        ev.decode(json.dumps(wire).encode())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\x00\xff\xfegarbage",
        b"not json at all",
        b'{"type": "budget_set", "v": 1, "dataset": "ds", "budget": 1',  # truncated
        b"[1, 2, 3]",
        b"42",
        b'{"type": "no_such_event", "v": 1}',
        b'{"v": 1, "dataset": "ds", "budget": 1}',  # no type tag
    ],
)
def test_garbage_raises_event_decode_error(data: bytes) -> None:
    with pytest.raises(EventDecodeError):
        ev.decode(data)


def test_missing_required_field() -> None:
    wire = json.loads(ev.encode(BUDGET_SET))
    del wire["budget"]
    with pytest.raises(EventDecodeError, match="budget"):
        ev.decode(json.dumps(wire).encode())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("budget", "a lot"),
        ("dataset", 7),
        ("unit", "bananas"),
        ("v", "one"),
    ],
)
def test_wrong_type(field: str, value: object) -> None:
    with pytest.raises(EventDecodeError):
        ev.decode(_with(BUDGET_SET, **{field: value}))


def test_completion_with_bad_output_ids() -> None:
    completion = next(e for e in ALL_EVENTS if isinstance(e, ev.CompletionEvent))
    with pytest.raises(EventDecodeError, match="output_ids"):
        ev.decode(_with(completion, output_ids=["a", "b"]))
    with pytest.raises(EventDecodeError):
        ev.decode(_with(completion, finish_reason="exploded"))


def test_decode_error_keeps_cause() -> None:
    with pytest.raises(EventDecodeError) as info:
        ev.decode(b"{")
    assert info.value.__cause__ is not None


@pytest.mark.parametrize(
    "event", [e for e in ALL_EVENTS if hasattr(e, "dataset")], ids=lambda e: type(e).__name__
)
def test_event_key_is_the_dataset(event: ev.Event) -> None:
    assert ev.event_key(event) == b"ds"


def test_event_key_of_non_ascii_dataset_is_utf8() -> None:
    assert ev.event_key(ev.BudgetSet(dataset="données", budget=1)) == "données".encode()


def test_dead_letter_has_no_key() -> None:
    letter = next(e for e in ALL_EVENTS if isinstance(e, ev.DeadLetter))
    assert ev.event_key(letter) is None


def test_dead_letter_keeps_payload_and_reason() -> None:
    payload = b'{"type": "completion", "v": 1, "trunc'
    letter = ev.dead_letter(
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
    assert ev.decode(ev.encode(letter)) == letter


def test_dead_letter_of_binary_payload_and_no_key() -> None:
    letter = ev.dead_letter("garbage", source_topic="t", payload=b"ab\xffcd", key=None)
    assert letter.payload == "ab\ufffdcd"
    assert letter.key is None
    assert letter.partition == -1
    assert letter.offset == -1
    empty = ev.dead_letter("empty", source_topic="t", payload=None)
    assert empty.payload == ""
    assert ev.decode(ev.encode(letter)) == letter
