"""A job's identity, without Kafka: what counts as another job and what does not."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tokenbudget.app import identity
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import DatasetError
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev


def write(path: Path, rows: int = 3, marker: str = "a") -> Path:
    path.write_text(
        "".join(json.dumps({"id": f"q{i}", "prompt": f"{marker} {i}"}) + "\n" for i in range(rows))
    )
    return path


def job(tmp_path: Path, *datasets: dict[str, Any], **sections: dict[str, Any]) -> ev.JobIdentity:
    data: dict[str, Any] = {
        "inference": {"model": "m", "max_new_tokens": 256},
        "datasets": list(datasets or [{"name": "B1", "path": "data.jsonl", "budget": "10k"}]),
    }
    for section, keys in sections.items():
        data[section] = {**data.get(section, {}), **keys}
    config = config_module.build(data, base_dir=tmp_path, environ={})
    return identity.identity_of(config, at=1_700_000_000.0)


B1 = {"name": "B1", "path": "data.jsonl", "budget": "10k"}


@pytest.fixture
def base(tmp_path: Path) -> ev.JobIdentity:
    write(tmp_path / "data.jsonl")
    write(tmp_path / "other.jsonl", marker="b")
    (tmp_path / "tok").mkdir()
    return job(tmp_path, B1)


def test_the_same_job_has_no_differences(tmp_path: Path, base: ev.JobIdentity) -> None:
    assert identity.differences(base, job(tmp_path, B1)) == []


@pytest.mark.parametrize(
    ("dataset", "sections"),
    [
        ({"budget": "20M"}, {}),  # raising a budget and running again is the way on
        ({"limit": 2}, {}),
        ({"keep_columns": ["topic"]}, {}),
        ({}, {"inference": {"concurrency": 3, "url": "http://gpu:8000", "retries": 9}}),
        ({}, {"inference": {"read_timeout_s": 5.0, "stream": True, "check_server": False}}),
        ({}, {"budget": {"on_boundary": "finish", "lease_tokens": 7, "unit": "total_tokens"}}),
        ({}, {"kafka": {"partitions": 8, "namespace": "other"}}),
        ({}, {"sink": {"rotate_rows": 5, "flush_interval_s": 1.0}}),
        ({}, {"producer": {"on_bad_row": "fail"}}),
        # settings at their default, written out or not
        ({"format": "auto", "turns": "first", "n": 1}, {}),
        ({"max_new_tokens": 256}, {}),  # the [inference] value it had anyway
    ],
)
def test_operational_keys_are_not_the_jobs_identity(
    tmp_path: Path, base: ev.JobIdentity, dataset: dict[str, Any], sections: dict[str, Any]
) -> None:
    assert identity.differences(base, job(tmp_path, {**B1, **dataset}, **sections)) == []


def test_a_file_moved_with_the_same_bytes_is_the_same_dataset(
    tmp_path: Path, base: ev.JobIdentity
) -> None:
    (tmp_path / "moved").mkdir()
    os.replace(tmp_path / "data.jsonl", tmp_path / "moved" / "renamed.jsonl")
    moved = job(tmp_path, {**B1, "path": "moved/renamed.jsonl"})
    assert identity.differences(base, moved) == []


def test_changed_content_is_named_with_the_file(tmp_path: Path, base: ev.JobIdentity) -> None:
    with (tmp_path / "data.jsonl").open("a") as handle:
        handle.write(json.dumps({"id": "q9", "prompt": "one more"}) + "\n")
    assert identity.differences(base, job(tmp_path, B1)) == [
        "datasets[0] B1: data.jsonl content changed"
    ]
    other = job(tmp_path, {**B1, "path": "other.jsonl"})
    [change] = identity.differences(base, other)
    assert change.startswith("datasets[0] B1: other.jsonl content changed (")
    assert change.endswith("data.jsonl → " + str(tmp_path / "other.jsonl") + ")")


@pytest.mark.parametrize(
    ("dataset", "sections", "change"),
    [
        ({"format": "prompt"}, {}, "format auto → prompt"),
        ({"turns": "all"}, {}, "turns first → all"),
        ({"n": 3}, {}, "n 1 → 3"),
        ({}, {"inference": {"n": 2}}, "n 1 → 2"),
        ({"shuffle_seed": 7}, {}, "shuffle_seed unset → 7"),
        ({"template": True}, {"inference": {"tokenizer": "tok"}}, "template false → true"),
        ({"max_new_tokens": 512}, {}, "max_new_tokens 256 → 512"),
        ({}, {"inference": {"max_new_tokens": 100}}, "max_new_tokens 256 → 100"),
        ({"temperature": 0.7}, {}, "temperature unset → 0.7"),
        ({}, {"inference": {"top_p": 0.9}}, "top_p unset → 0.9"),
        ({"stop": ["</s>"]}, {}, 'stop unset → ["</s>"]'),
        ({"seed": 4}, {}, "seed unset → 4"),
        ({"reasoning": "save"}, {}, "reasoning unset → save"),  # what the rows hold
        (
            {"chat_template_kwargs": {"enable_thinking": False}},
            {},
            'chat_template_kwargs unset → {"enable_thinking":false}',
        ),
    ],
)
def test_settings_that_change_prompts_or_answers_are_named(
    tmp_path: Path,
    base: ev.JobIdentity,
    dataset: dict[str, Any],
    sections: dict[str, Any],
    change: str,
) -> None:
    current = job(tmp_path, {**B1, **dataset}, **sections)
    changes = identity.differences(base, current)
    assert f"datasets[0] B1: {change}" in changes
    assert all(c.startswith("datasets[0] B1: ") for c in changes)


def test_a_dataset_setting_overrides_inferences_and_only_the_result_counts(
    tmp_path: Path,
) -> None:
    write(tmp_path / "data.jsonl")
    on_dataset = job(tmp_path, {**B1, "temperature": 0.5})
    on_inference = job(tmp_path, B1, inference={"temperature": 0.5})
    assert identity.differences(on_dataset, on_inference) == []


@pytest.mark.parametrize(
    ("sections", "change"),
    [
        ({"inference": {"api": "openai-completions"}}, "inference.api sglang → openai-completions"),
        ({"inference": {"model": "other"}}, "inference.model m → other"),
    ],
)
def test_the_model_and_api_are_the_jobs(
    tmp_path: Path, base: ev.JobIdentity, sections: dict[str, Any], change: str
) -> None:
    assert identity.differences(base, job(tmp_path, B1, **sections)) == [change]


def test_another_sink_path_is_another_job(tmp_path: Path, base: ev.JobIdentity) -> None:
    changes = identity.differences(base, job(tmp_path, B1, sink={"path": "elsewhere"}))
    assert changes == [f"sink.path {tmp_path / 'out'} → {tmp_path / 'elsewhere'}"]


def test_datasets_added_or_removed_are_no_difference_and_a_removed_one_is_remembered(
    tmp_path: Path, base: ev.JobIdentity
) -> None:
    b2 = {"name": "B2", "path": "other.jsonl", "budget": "1k"}
    grown = job(tmp_path, B1, b2)
    assert identity.differences(base, grown) == []
    recorded = identity.merged(base, grown)
    assert [d.name for d in recorded.datasets] == ["B1", "B2"]
    assert recorded.first_at == base.first_at
    assert not identity.same_record(base, recorded)  # the addition is worth recording
    shrunk = job(tmp_path, b2)
    assert identity.differences(recorded, shrunk) == []
    kept = identity.merged(recorded, shrunk)
    assert identity.same_record(recorded, kept)  # B1's record stays, nothing to write
    write(tmp_path / "data.jsonl", rows=5)
    back = job(tmp_path, b2, B1)
    assert identity.differences(kept, back) == ["datasets[1] B1: data.jsonl content changed"]


def test_a_record_made_before_a_setting_existed_still_matches(
    tmp_path: Path, base: ev.JobIdentity
) -> None:
    """Settings at their default are left out of a record, so a key added to
    [[datasets]] later does not make every earlier job another one; a value the
    record has and this build does not know is compared with 'unset'."""
    assert "shuffle_seed" not in base.datasets[0].settings
    assert base.datasets[0].settings["format"] == "auto"  # no default: always there
    future = msgspec.structs.replace(
        base.datasets[0], settings={**base.datasets[0].settings, "prompt_column": "question"}
    )
    newer = msgspec.structs.replace(base, datasets=(future,))
    assert identity.differences(newer, job(tmp_path, B1)) == [
        "datasets[0] B1: prompt_column question → unset"
    ]


def test_every_dataset_field_is_compared_or_named_as_not_identity() -> None:
    fields = {f.name for f in msgspec.structs.fields(config_module.Dataset)}
    compared = fields - identity.NOT_IDENTITY
    assert {"format", "turns", "n", "shuffle_seed", "template", "split", "max_new_tokens"} <= (
        compared
    )
    assert fields >= identity.NOT_IDENTITY  # no name there is a typo or a field gone


def test_the_refusal_is_one_line_naming_what_changed_and_the_ways_on(
    tmp_path: Path, base: ev.JobIdentity
) -> None:
    write(tmp_path / "data.jsonl", rows=4)
    current = job(tmp_path, B1, sink={"path": "out2"})
    changes = identity.differences(base, current)
    (tmp_path / "job.toml").write_text("")  # a job that names neither job nor namespace
    config = config_module.load(tmp_path / "job.toml", environ={})
    message = identity.changed_message(changes, base, config, "run")
    assert "\n" not in message
    assert message.startswith(
        f"sink.path {tmp_path / 'out'} → {tmp_path / 'out2'}; "
        "datasets[0] B1: data.jsonl content changed since the first run of job "
        f"{config.kafka.namespace} ("
    )
    # The new job's way first: the config names neither its job nor its namespace.
    new = message.index("for a new job, give it another name: [job] name, or save the config")
    assert new < message.index("`tokenbudget run --resume-changed`")
    later = msgspec.structs.replace(base, recorded_at=base.first_at + 60)
    assert "since the run that last recorded it of job" in identity.changed_message(
        changes, later, config, "produce"
    )
    named = msgspec.structs.replace(
        config, kafka=msgspec.structs.replace(config.kafka, namespace="shared")
    )
    assert "for a new job, set another [kafka] namespace;" in identity.changed_message(
        changes, base, named, "run"
    )
    many = identity.changed_message([f"c{i}" for i in range(5)], base, config, "run")
    assert many.startswith("c0; c1; c2; and 2 more since")


def test_the_content_hash_reads_every_byte_in_chunks(tmp_path: Path) -> None:
    big = tmp_path / "big.bin"
    data = bytearray(os.urandom(3 * identity._CHUNK + 17))
    big.write_bytes(data)
    first = identity.content_hash(big)
    assert first.startswith("xxh3_128:") and identity.content_hash(big) == first
    data[-1] ^= 1  # the last byte of the last, partial chunk
    big.write_bytes(data)
    assert identity.content_hash(big) != first


def test_a_folder_is_hashed_by_its_files_names_and_bytes(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "data-00000.arrow").write_bytes(b"abc")
    (folder / "dataset_dict.json").write_text("{}")
    first = identity.content_hash(folder)
    (folder / ".lock").write_text("x")  # hidden files are not data
    assert identity.content_hash(folder) == first
    os.replace(folder / "train" / "data-00000.arrow", folder / "train" / "data-00001.arrow")
    assert identity.content_hash(folder) != first


def test_a_missing_file_is_a_dataset_error(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"absent\.jsonl: cannot read it"):
        identity.content_hash(tmp_path / "absent.jsonl")


def test_the_record_round_trips_as_an_event(base: ev.JobIdentity) -> None:
    assert codec.decode(codec.encode(base)) == base
    assert codec.event_key(base) is None  # no dataset: the ledger passes it by


MAPPED = {**B1, "prompt_template": "{instruction}\n\n{input?}", "id_field": "qid"}


def test_a_column_mapping_is_recorded_as_written_and_matches_after_the_round_trip(
    tmp_path: Path, base: ev.JobIdentity
) -> None:
    mapped = job(tmp_path, MAPPED)
    settings = mapped.datasets[0].settings
    assert settings["prompt_template"] == "{instruction}\n\n{input?}"
    assert settings["id_field"] == "qid"
    back = codec.decode(codec.encode(mapped))
    assert isinstance(back, ev.JobIdentity)
    assert identity.differences(back, job(tmp_path, MAPPED)) == []


def test_another_column_mapping_is_named_by_its_key(tmp_path: Path, base: ev.JobIdentity) -> None:
    mapped = codec.decode(codec.encode(job(tmp_path, MAPPED)))
    assert isinstance(mapped, ev.JobIdentity)
    other = job(tmp_path, {**MAPPED, "prompt_template": "{instruction}"})
    assert identity.differences(mapped, other) == [
        "datasets[0] B1: prompt_template {instruction}\n\n{input?} → {instruction}"
    ]
    assert identity.differences(base, job(tmp_path, {**B1, "prompt_field": "question"})) == [
        "datasets[0] B1: prompt_field unset → question"
    ]
