"""Which budget a job runs with: a value from ``budget set`` holds until the config's
own value for the dataset changes."""

from __future__ import annotations

from pathlib import Path

from tokenbudget.app.precedence import SET_BY_COMMAND, choices, choose, config_budget_set
from tokenbudget.core import config as config_module
from tokenbudget.streams import events as ev

UNIT = "completion_tokens"


def by_hand(budget: int, against: int | None, unit: str = UNIT) -> ev.BudgetSet:
    return ev.BudgetSet(
        dataset="A",
        budget=budget,
        unit=unit,  # type: ignore[arg-type]
        set_at=1_800_000_000.0,
        set_by=SET_BY_COMMAND,
        config_budget=against,
    )


def from_config(budget: int) -> ev.BudgetSet:
    return ev.BudgetSet(dataset="A", budget=budget, set_by="config job.toml", config_budget=budget)


def test_without_a_set_value_the_config_is_used() -> None:
    for latest in (None, from_config(3000), from_config(2000)):
        choice = choose("A", 3000, UNIT, latest)
        assert (choice.budget, choice.source, choice.explain()) == (3000, "config", None)


def test_a_set_value_holds_while_the_config_is_unchanged() -> None:
    choice = choose("A", 3000, UNIT, by_hand(4000, against=3000))
    assert (choice.budget, choice.source, choice.set_value) == (4000, "set", 4000)
    line = choice.explain()
    assert line is not None
    assert line.startswith(f"A: budget 4,000 {UNIT} as set by `tokenbudget budget set` at 20")
    assert line.endswith("the config's 3,000 is unchanged since (edit it to replace the set value)")


def test_a_changed_config_replaces_the_set_value() -> None:
    choice = choose("A", 5000, UNIT, by_hand(4000, against=3000))
    assert (choice.budget, choice.source, choice.set_value) == (5000, "config", 4000)
    assert choice.explain() == (
        f"A: budget 5,000 {UNIT} from the config (changed from 3,000), "
        "replacing 4,000 set by `tokenbudget budget set`"
    )


def test_a_set_value_of_another_unit_or_without_its_config_value_does_not_hold() -> None:
    other_unit = choose("A", 3000, UNIT, by_hand(4000, against=3000, unit="samples"))
    assert (other_unit.budget, other_unit.source) == (3000, "config")
    assert other_unit.explain() == (
        f"A: budget 3,000 {UNIT} from the config (its unit is now {UNIT}), "
        "replacing 4,000 set by `tokenbudget budget set`"
    )
    older = choose("A", 3000, UNIT, by_hand(4000, against=None))  # before the rule
    assert (older.budget, older.source) == (3000, "config")


def test_a_set_value_equal_to_the_config_needs_no_word() -> None:
    choice = choose("A", 3000, UNIT, by_hand(3000, against=2000))
    assert (choice.budget, choice.source, choice.explain()) == (3000, "config", None)


def test_the_config_value_is_published_with_itself_as_its_config_value(tmp_path: Path) -> None:
    config = config_module.build(
        {"datasets": [{"name": "A", "path": "a.jsonl", "budget": "3k"}]},
        base_dir=tmp_path,
        environ={},
    )
    [choice] = choices(config, {"A": by_hand(4000, against=2000)})
    event = config_budget_set(config, choice)
    assert (event.dataset, event.budget, event.config_budget) == ("A", 3000, 3000)
    assert event.set_by == f"config {config.source}"
    # and it decides the next job like any other: the config's value
    assert choose("A", 3000, UNIT, event).source == "config"
