"""Wire format of every event: round trips, versions, decode errors, keys."""

from __future__ import annotations

import base64
import json
import typing
from typing import Any

import msgspec
import numpy as np
import pytest

from tokenbudget.core.errors import EventDecodeError
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.fields import ChatMessage, SamplingParams, TokenIds

ALL_EVENTS: list[ev.Event] = [
    ev.PromptEvent(
        prompt_id="p1",
        dataset="ds",
        text="hello #code",
        sampling=SamplingParams(max_new_tokens=64, temperature=0.7),
        source="data.jsonl:3",
        produced_at=1.5,
    ),
    ev.PromptEvent(
        prompt_id="p2",
        dataset="ds",
        messages=(
            ChatMessage(role="system", content="be brief"),
            ChatMessage(role="user", content="hi ✓"),
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
    data = codec.encode(event)
    assert isinstance(data, bytes)
    decoded = codec.decode(data)
    assert type(decoded) is type(event)
    assert decoded == event


EVENT_TYPES: list[type[Any]] = list(ev.Event.__args__)  # type: ignore[attr-defined]


def _sample(kind: msgspec.inspect.Type, name: str) -> Any:
    """A value of ``kind`` that differs from the field's default."""
    match kind:
        case msgspec.inspect.Metadata():  # a setting's description for the docs
            return _sample(kind.type, name)
        case msgspec.inspect.StrType():
            # a name held to a pattern (a dataset's, a variable's) takes '_' where
            # free text takes '-'
            return f"{name}_value" if kind.pattern else f"{name}-value"
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
        case msgspec.inspect.DictType():
            # free-form settings passed through to the server (JSON values)
            return {f"{name}-key": [1, "two", {"three": 3.5}], "flag": False}
        case msgspec.inspect.CustomType(cls=TokenIds):
            # as many ids as the int fields' sample (17): counts and ids agree
            return TokenIds([17, 2**31 - 1, -5, *range(14)])
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
    decoded = codec.decode(codec.encode(event))
    assert type(decoded) is cls
    assert decoded == event


@pytest.mark.parametrize("event", ALL_EVENTS, ids=lambda e: type(e).__name__)
def test_wire_carries_type_tag_and_version(event: ev.Event) -> None:
    wire = json.loads(codec.encode(event))
    completion = isinstance(event, ev.CompletionEvent)
    assert wire["v"] == (ev.COMPLETION_VERSION if completion else ev.SCHEMA_VERSION)
    assert isinstance(wire["type"], str)
    assert wire["type"]


def test_tags_are_distinct() -> None:
    tags = [json.loads(codec.encode(_full_instance(cls)))["type"] for cls in EVENT_TYPES]
    assert len(set(tags)) == len(EVENT_TYPES)


def _with(event: ev.Event, **changes: object) -> bytes:
    wire = json.loads(codec.encode(event))
    wire.update(changes)
    return json.dumps(wire).encode()


BUDGET_SET = ev.BudgetSet(dataset="ds", budget=100)


@pytest.mark.parametrize("version", [0, 2, 99])
def test_unsupported_schema_version(version: int) -> None:
    with pytest.raises(EventDecodeError) as info:
        codec.decode(_with(BUDGET_SET, v=version))
    assert f"version {version}" in str(info.value)


def test_newer_version_with_unknown_shape_is_reported_as_a_version_problem() -> None:
    wire = {"type": "budget_set", "v": 2, "dataset": "ds", "amount": "lots"}
    with pytest.raises(EventDecodeError, match="version 2"):
        codec.decode(json.dumps(wire).encode())


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
        codec.decode(data)


def test_missing_required_field() -> None:
    wire = json.loads(codec.encode(BUDGET_SET))
    del wire["budget"]
    with pytest.raises(EventDecodeError, match="budget"):
        codec.decode(json.dumps(wire).encode())


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
        codec.decode(_with(BUDGET_SET, **{field: value}))


def test_completion_with_bad_output_ids() -> None:
    completion = next(e for e in ALL_EVENTS if isinstance(e, ev.CompletionEvent))
    with pytest.raises(EventDecodeError, match="output_ids"):
        codec.decode(_with(completion, output_ids=["a", "b"]))
    with pytest.raises(EventDecodeError):
        codec.decode(_with(completion, finish_reason="exploded"))


def test_decode_error_keeps_cause() -> None:
    with pytest.raises(EventDecodeError) as info:
        codec.decode(b"{")
    assert info.value.__cause__ is not None


@pytest.mark.parametrize(
    "event", [e for e in ALL_EVENTS if hasattr(e, "dataset")], ids=lambda e: type(e).__name__
)
def test_event_key_is_the_dataset(event: ev.Event) -> None:
    assert codec.event_key(event) == b"ds"


def test_event_key_of_non_ascii_dataset_is_utf8() -> None:
    assert codec.event_key(ev.BudgetSet(dataset="données", budget=1)) == "données".encode()


def test_dead_letter_has_no_key() -> None:
    letter = next(e for e in ALL_EVENTS if isinstance(e, ev.DeadLetter))
    assert codec.event_key(letter) is None


# ------------------------------------------------------------ completion output_ids


COMPLETION = next(e for e in ALL_EVENTS if isinstance(e, ev.CompletionEvent))


def v1_wire(event: ev.CompletionEvent) -> bytes:
    """The bytes a version 1 writer produced: ids as a JSON array of numbers."""
    wire = json.loads(codec.encode(event))
    wire.update(v=1, output_ids=list(event.output_ids))
    return msgspec.json.encode(wire)


def test_completion_ids_are_little_endian_int32_bytes_on_the_wire() -> None:
    event = msgspec.structs.replace(COMPLETION, output_ids=[0, 1, 151_643, 2**31 - 1, -1])
    wire = json.loads(codec.encode(event))
    assert wire["v"] == ev.COMPLETION_VERSION == 6
    raw = base64.b64decode(wire["output_ids"], validate=True)
    assert raw == np.array([0, 1, 151_643, 2**31 - 1, -1], dtype="<i4").tobytes()


@pytest.mark.parametrize(
    "ids", [[], [7], [5, 6, 7, 8], list(range(0, 150_000, 37)), [-1, 2**31 - 1]]
)
def test_v1_and_v2_completions_decode_to_the_same_event(ids: list[int]) -> None:
    event = msgspec.structs.replace(
        COMPLETION, output_ids=ids, completion_tokens=len(ids), max_new_tokens=max(4, len(ids))
    )
    old, new = v1_wire(event), codec.encode(event)
    assert b'"output_ids":[' in old and b'"v":1' in old
    assert codec.decode(old) == codec.decode(new) == event
    assert codec.decode(old).output_ids == ids
    # a v1 event read back is written again as v2, byte for byte as a new one
    assert codec.encode(codec.decode(old)) == new


def test_constructed_ids_are_held_as_token_ids() -> None:
    event = msgspec.structs.replace(COMPLETION, output_ids=(3, 4))
    assert isinstance(event.output_ids, TokenIds)
    assert event.v == ev.COMPLETION_VERSION
    from_numpy = msgspec.structs.replace(COMPLETION, output_ids=np.array([3, 4], np.int64))
    assert from_numpy == event


@pytest.mark.parametrize(
    ("output_ids", "message"),
    [
        ("AQAAAA", "not base64"),  # padding missing
        ("AQAA*AAA", "not base64"),
        ("AQAAAAI=", "not a whole number of int32"),  # 5 bytes
        ("AQA=", "not a whole number of int32"),  # 2 bytes
        (17, "expected base64 int32 bytes or an array"),
        ({"ids": [1]}, "expected base64 int32 bytes or an array"),
        ([1, "2"], "output_ids"),
        ([1.5], "output_ids"),
        ([True], "output_ids"),
        ([[1, 2]], "output_ids"),
        ([2**31], "does not fit in int32"),
        ([-(2**31) - 1], "does not fit in int32"),
    ],
)
def test_malformed_output_ids_are_a_decode_error(output_ids: object, message: str) -> None:
    for version in (1, 2):
        with pytest.raises(EventDecodeError, match=message) as info:
            codec.decode(_with(COMPLETION, v=version, output_ids=output_ids))
        assert "output_ids" in str(info.value)


def test_completion_versions() -> None:
    assert codec.supported_versions("completion") == {1, 2, 3, 4, 5, 6}
    assert codec.supported_versions("budget_set") == {1}
    with pytest.raises(EventDecodeError, match="'completion' event has schema version 7"):
        codec.decode(_with(COMPLETION, v=7))
    with pytest.raises(EventDecodeError, match="upgrade tokenbudget"):
        codec.decode(_with(BUDGET_SET, v=2))  # only completions moved to version 2


def test_a_v3_completion_decodes_with_no_stop_reason_and_is_written_again_as_current() -> None:
    """Completions written before stop_reason existed stay readable: the topic is the
    permanent record, and nobody knows now whether the budget ended those answers."""
    wire = json.loads(codec.encode(COMPLETION))
    assert "stop_reason" not in wire or wire["stop_reason"] is None
    wire.pop("stop_reason", None)
    wire["v"] = 3
    old = codec.decode(msgspec.json.encode(wire))
    assert isinstance(old, ev.CompletionEvent) and old.stop_reason is None
    assert json.loads(codec.encode(old))["v"] == ev.COMPLETION_VERSION
    cut = msgspec.structs.replace(COMPLETION, stop_reason="budget")
    decoded = codec.decode(codec.encode(cut))
    assert isinstance(decoded, ev.CompletionEvent) and decoded.stop_reason == "budget"
    assert decoded.finish_reason == "length"  # the server's own stays beside it


def test_a_v4_completion_decodes_with_no_reasoning_and_unfinished_unknown() -> None:
    """Completions written before the reasoning fields existed stay readable, with
    nothing claimed about them: whether such an answer was cut while thinking is not
    known now."""
    wire = json.loads(codec.encode(msgspec.structs.replace(COMPLETION, stop_reason="length")))
    for name in ("reasoning", "reasoning_tokens", "unfinished"):
        wire.pop(name, None)
    wire["v"] = 4
    old = codec.decode(msgspec.json.encode(wire))
    assert isinstance(old, ev.CompletionEvent) and old.stop_reason == "length"
    assert (old.reasoning, old.reasoning_tokens, old.unfinished) == (None, None, None)
    assert json.loads(codec.encode(old))["v"] == 6
    thinking = msgspec.structs.replace(
        COMPLETION, reasoning="let me see", reasoning_tokens=1, unfinished=False
    )
    decoded = codec.decode(codec.encode(thinking))
    assert isinstance(decoded, ev.CompletionEvent)
    assert (decoded.reasoning, decoded.reasoning_tokens, decoded.unfinished) == (
        "let me see",
        1,
        False,
    )


# ------------------------------------------------------------ checked at the door
# Events come from whoever can write a topic: each of these decoded and was believed
# before the bounds were declared with the fields (issue 41's hostile inputs).


def _wire(event: ev.Event, **changes: Any) -> bytes:
    return json.dumps({**json.loads(codec.encode(event)), **changes}).encode()


_HALT = ev.BudgetExceeded(dataset="ds", budget=10, used=10, at=1.0)
_ASK = ev.LeaseRequested(dataset="ds", lease_id="l1", holder="h1", want=100, at=1.0)
_SET = ev.BudgetSet(dataset="ds", budget=100)
_DONE = ALL_EVENTS[2]
assert isinstance(_DONE, ev.CompletionEvent)


@pytest.mark.parametrize(
    ("event", "changes", "field"),
    [
        # one halt at the highest epoch would win over every real one, for ever
        (_HALT, {"epoch": 2**64 - 1}, "epoch"),
        (_HALT, {"epoch": -1}, "epoch"),
        (_ASK, {"want": -500}, "want"),
        (_ASK, {"want": 0}, "want"),
        (_ASK, {"ttl_s": 1e308}, "ttl_s"),
        (_ASK, {"ttl_s": 0}, "ttl_s"),
        (_ASK, {"min_grant": -1}, "min_grant"),
        (_SET, {"budget": -5}, "budget"),
        (_SET, {"budget": 2**63}, "budget"),
        (_DONE, {"prompt_tokens": 2**63}, "prompt_tokens"),
        (_DONE, {"completion_tokens": -1}, "completion_tokens"),
        (_DONE, {"cost": -1000000}, "cost"),
        (_DONE, {"dataset": "x/../../../escaped"}, "dataset"),
        (_DONE, {"dataset": ".."}, "dataset"),
        (_DONE, {"dataset": "a\x00b"}, "dataset"),
        (_DONE, {"dataset": "d" * 256}, "dataset"),
        (_DONE, {"dataset": "\x1b[2Jname"}, "dataset"),
        (_DONE, {"request_id": "r" * 10_000}, "request_id"),
        (
            ev.LeaseGranted(dataset="ds", lease_id="l", holder="h", granted=1, expires_at=1.0),
            {"granted": -7},
            "granted",
        ),
        (ev.ServerAdded(url="http://h:1"), {"api_key_env": "PATH=/x"}, "api_key_env"),
        (ev.ServerAdded(url="http://h:1"), {"concurrency": 0}, "concurrency"),
    ],
)
def test_a_value_out_of_its_bounds_is_a_bad_event(
    event: ev.Event, changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(EventDecodeError, match=rf"at `\$\.{field}`"):
        codec.decode(_wire(event, **changes))


def test_every_valid_dataset_name_of_a_config_decodes() -> None:
    for name in ("ds", "B1_codealpaca", "a.b-c_d", "_x", "9" * 200):
        assert codec.decode(_wire(_SET, dataset=name)) == ev.BudgetSet(dataset=name, budget=100)


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_a_record_nested_past_the_parser_is_a_bad_event_not_a_recursion_error(depth: int) -> None:
    nested = b"[" * depth + b"]" * depth
    inside = b'{"type":"completion","v":6,"input_columns":{"a":' + nested + b"}}"
    for data in (nested, inside, b'{"a":' + nested + b"}"):
        with pytest.raises(EventDecodeError, match="not a tokenbudget event"):
            codec.decode(data)


@pytest.mark.parametrize(
    ("event", "topic"),
    [
        (ev.ServerAdded(url="http://evil:1", api_key_env="TOKENBUDGET_API_KEY"), "ns.budgets"),
        (_SET, "ns.budgets"),
        (_HALT, "ns.control"),
        (_HALT, "ns.completions"),
        (
            ev.LeaseGranted(dataset="ds", lease_id="l", holder="h", granted=1, expires_at=1.0),
            "ns.reservations",
        ),
        (ev.ServerDrained(url="http://h:1"), "ns.reservations"),
        (_DONE, "ns.prompts"),
    ],
)
def test_an_event_read_from_a_topic_it_does_not_travel_on_is_a_bad_event(
    event: ev.Event, topic: str
) -> None:
    with pytest.raises(EventDecodeError, match=r"does not travel on ns\.\w+: only on ns\.\w+"):
        codec.decode(codec.encode(event), topic=topic)
    assert codec.decode(codec.encode(event), topic=f"ns.{codec.topic_of(type(event))}") == event


def test_every_event_type_travels_on_exactly_one_topic() -> None:
    kinds = [kind for kinds in codec.ON_TOPIC.values() for kind in kinds]
    assert sorted(k.__name__ for k in kinds) == sorted(
        k.__name__ for k in typing.get_args(ev.Event)
    )
