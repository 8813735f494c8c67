"""``n`` answers per prompt, each a prompt of its own, and the row's id and kept
columns, from the dataset file to the prompt event."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenbudget.core.config import build
from tokenbudget.core.errors import ConfigError
from tokenbudget.producers.prompts.datasets import read_options, read_prompts
from tokenbudget.producers.prompts.producer import sampling_for


def write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config_for(tmp_path: Path, **dataset: object):  # type: ignore[no-untyped-def]
    return build(
        {
            "inference": {"seed": 40, "n": 2},
            "datasets": [{"name": "d", "path": "d.jsonl", "budget": 100, **dataset}],
        },
        base_dir=tmp_path,
        environ={},
    )


def test_n_makes_each_prompt_n_prompts_with_ids_of_their_own(tmp_path: Path) -> None:
    write(tmp_path / "d.jsonl", [{"id": i, "prompt": f"story {i}"} for i in range(4)])
    config = config_for(tmp_path, n=3, limit=2)
    [dataset] = config.datasets
    options = read_options(config, dataset)
    rows = list(read_prompts("d", dataset.path, limit=dataset.limit, **options))
    # limit counts prompts read from the file; each gives n answers
    assert [(r.row_id, r.sample_index) for r in rows] == [
        ("0", 0),
        ("0", 1),
        ("0", 2),
        ("1", 0),
        ("1", 1),
        ("1", 2),
    ]
    assert len({r.prompt_id for r in rows}) == 6
    single = list(read_prompts("d", dataset.path, limit=2))
    # the first answer keeps the id a run with n = 1 gave, so such a run counts for it
    assert [r.prompt_id for r in rows if r.sample_index == 0] == [r.prompt_id for r in single]
    again = list(read_prompts("d", dataset.path, limit=dataset.limit, **options))
    assert [r.prompt_id for r in again] == [r.prompt_id for r in rows]  # stable
    seeds = [sampling_for(dataset, r.sample_index).seed for r in rows[:3]]
    assert seeds == [40, 41, 42]


def test_n_comes_from_inference_unless_the_dataset_sets_it(tmp_path: Path) -> None:
    assert config_for(tmp_path).datasets[0].n == 2
    assert config_for(tmp_path, n=1).datasets[0].n == 1


def test_kept_columns_are_copied_and_a_missing_one_is_null(tmp_path: Path) -> None:
    write(
        tmp_path / "d.jsonl",
        [{"prompt": "a", "topic": "sea", "level": 3}, {"prompt": "b", "topic": "sky"}],
    )
    config = config_for(tmp_path, n=1, keep_columns=["topic", "level"])
    [dataset] = config.datasets
    rows = list(read_prompts("d", dataset.path, **read_options(config, dataset)))
    assert [r.input_columns for r in rows] == [
        {"topic": "sea", "level": 3},
        {"topic": "sky", "level": None},
    ]
    assert [r.row_id for r in rows] == [None, None]  # the rows have no "id"


@pytest.mark.parametrize(
    ("dataset", "key"),
    [({"n": 0}, "datasets[0].n"), ({"keep_columns": [" topic"]}, "datasets[0].keep_columns")],
)
def test_bad_values_name_their_key(tmp_path: Path, dataset: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as error:
        config_for(tmp_path, **dataset)
    assert error.value.key == key


def test_inference_n_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"inference\.n"):
        build({"inference": {"n": 0}}, base_dir=tmp_path, environ={})
