"""The order prompts are sent in: a stratified order keeps every prefix like the
whole source, where the file's order of a file sorted by length does not; no order
changes a prompt id. Graded from the dataset file itself."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tokenbudget.app.estimate import ks_distance
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import ConfigError
from tokenbudget.producers.prompts.dataset_checks import check_datasets
from tokenbudget.producers.prompts.datasets import read_prompts
from tokenbudget.producers.prompts.order import stratified
from tokenbudget.producers.prompts.rows import PromptRow

ROWS = 2000


def sorted_by_length(path: Path) -> Path:
    """Prompts from 10 to about 2,000 characters, shortest first, as a file sorted
    by length is; each row carries its source."""
    with path.open("w") as handle:
        for i in range(ROWS):
            source = ("web", "books", "code", "math")[i * 7 % 4]
            row = {"id": f"r{i}", "prompt": "x" * (10 + i), "source": source}
            handle.write(json.dumps(row) + "\n")
    return path


def lengths(rows: list[PromptRow]) -> list[int]:
    return [len(r.text or "") for r in rows]


def read(path: Path, **options: Any) -> list[PromptRow]:
    return list(read_prompts("d", path, **options))


@pytest.mark.parametrize("k", [50, 100, 200, 500])
def test_any_prefix_of_a_stratified_order_has_the_sources_lengths(tmp_path: Path, k: int) -> None:
    path = sorted_by_length(tmp_path / "d.jsonl")
    every = lengths(read(path))
    in_file_order = lengths(read(path)[:k])
    stratified_order = lengths(read(path, order="stratified", shuffle_seed=3)[:k])
    shuffled = lengths(read(path, order="shuffled", shuffle_seed=3)[:k])
    # The file's order keeps the k shortest: as far from the source as can be.
    assert ks_distance(in_file_order, every) == pytest.approx(1 - k / ROWS)
    # Stratified: within one prompt per level of halving of the source's share
    # below any length, so a distance of at most ceil(log2 n) / k (0.22 for k = 50,
    # 0.022 for k = 500), where the file's order is at 0.975 and 0.75.
    assert ks_distance(stratified_order, every) <= math.ceil(math.log2(ROWS)) / k
    # A shuffle is a random sample: closer than the file's order, not as close.
    assert ks_distance(shuffled, every) > ks_distance(stratified_order, every)


def test_a_stratified_order_by_a_field_keeps_its_shares_in_every_prefix(tmp_path: Path) -> None:
    path = sorted_by_length(tmp_path / "d.jsonl")
    rows = read(path, order="stratified", stratify_by="source", shuffle_seed=1)
    sources = {f"r{i}": ("web", "books", "code", "math")[i * 7 % 4] for i in range(ROWS)}
    for k in (8, 20, 101, 400):
        counts = Counter(sources[r.row_id or ""] for r in rows[:k])
        assert max(counts.values()) - min(counts.values()) <= 2, (k, counts)


def test_order_never_changes_a_prompt_id(tmp_path: Path) -> None:
    path = sorted_by_length(tmp_path / "d.jsonl")
    plain = read(path)
    for options in (
        {"order": "stratified", "shuffle_seed": 3},
        {"order": "stratified", "stratify_by": "source"},
        {"order": "shuffled", "shuffle_seed": 3},
    ):
        ordered = read(path, **options)
        assert [r.prompt_id for r in ordered] != [r.prompt_id for r in plain]
        assert {(r.prompt_id, r.source, r.text) for r in ordered} == {
            (r.prompt_id, r.source, r.text) for r in plain
        }
    # the same seed, the same order; another seed, another
    one = [r.prompt_id for r in read(path, order="stratified", shuffle_seed=5)]
    assert one == [r.prompt_id for r in read(path, order="stratified", shuffle_seed=5)]
    assert one != [r.prompt_id for r in read(path, order="stratified", shuffle_seed=6)]


def test_stratified_orders_mixed_and_missing_values_without_failing() -> None:
    items = [None, 3, "b", 1.5, {"a": 1}, float("nan"), "a", 2, None]
    ordered = stratified(items, lambda x: x, seed=0)
    assert sorted(map(repr, ordered)) == sorted(map(repr, items))


def build(tmp_path: Path, **dataset: Any) -> config_module.Config:
    data = {"datasets": [{"name": "d", "path": "d.jsonl", "budget": "1M", **dataset}]}
    return config_module.build(data, base_dir=tmp_path, environ={})


def test_order_keys_in_the_config(tmp_path: Path) -> None:
    sorted_by_length(tmp_path / "d.jsonl")
    assert build(tmp_path).datasets[0].order == "file"
    assert build(tmp_path, shuffle_seed=4).datasets[0].order == "shuffled"  # as before
    d = build(tmp_path, order="stratified", stratify_by="source").datasets[0]
    assert (d.order, d.stratify_by) == ("stratified", "source")
    assert build(tmp_path, order="stratified").datasets[0].stratify_by == "prompt_length"
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.stratify_by.*order = \"stratified\""):
        build(tmp_path, stratify_by="source")
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.order.*'stratified'"):
        build(tmp_path, order="sorted")
    # a field no row has would put every row in one stratum: stopped before a run
    with pytest.raises(ConfigError, match=r"datasets\[0\]\.stratify_by.*no field 'sorce'"):
        check_datasets(build(tmp_path, order="stratified", stratify_by="sorce"))
    check_datasets(build(tmp_path, order="stratified", stratify_by="source"))
