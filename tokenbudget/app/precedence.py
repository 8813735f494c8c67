"""Which budget a dataset runs with: its config's, or one set with ``tokenbudget
budget set``.

The rule: **a budget set with ``budget set`` holds until the config's own value for
that dataset changes.** Every ``BudgetSet`` carries the config's value at the time it
was published (``config_budget``: ``budget set`` reads the config it is given).
When a job starts (``run``, ``produce``), each dataset's latest ``BudgetSet`` on the
control topic is compared with the config (:func:`choose`):

* none, one without ``config_budget`` (older, or not from tokenbudget's commands), or
  one of another unit: the config's value;
* one set against the config's current value: its budget holds, whether set between
  runs or while a job ran (a rerun after Ctrl-C keeps a raised budget);
* one set against another value: the config was edited since, and its value wins.

The config's value is published when it wins; a set value that holds is left as it
is. ``run`` says at start which value it uses and why, for every dataset where a set
value was involved; ``budget show`` shows both and which one the next job uses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

from tokenbudget.core.config import Config
from tokenbudget.sinks.reading import read_to_end
from tokenbudget.streams import events as ev
from tokenbudget.streams.topics import Topics

SET_BY_COMMAND = "tokenbudget budget set"


@dataclass(frozen=True)
class BudgetChoice:
    """A dataset's budget for the next job, and where it comes from."""

    dataset: str
    config: int  # the config's value
    unit: str  # the config's
    budget: int  # the one the job runs with
    source: Literal["config", "set"]
    latest: ev.BudgetSet | None  # the latest BudgetSet on the topic

    @property
    def set_value(self) -> int | None:
        """The latest value from ``budget set``, whether it holds or not."""
        latest = self.latest
        return latest.budget if latest is not None and latest.set_by == SET_BY_COMMAND else None

    def explain(self) -> str | None:
        """One line on the choice when a set value was involved, else None."""
        latest, set_value = self.latest, self.set_value
        if latest is None or set_value is None or set_value == self.config:
            return None
        if self.source == "set":
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(latest.set_at))
            return (
                f"{self.dataset}: budget {self.budget:,} {self.unit} as set by "
                f"`{SET_BY_COMMAND}` at {when}; the config's {self.config:,} is unchanged "
                "since (edit it to replace the set value)"
            )
        if latest.unit != self.unit:
            why = f" (its unit is now {self.unit})"
        elif latest.config_budget is not None:
            why = f" (changed from {latest.config_budget:,})"
        else:
            why = ""
        return (
            f"{self.dataset}: budget {self.config:,} {self.unit} from the config{why}, "
            f"replacing {set_value:,} set by `{SET_BY_COMMAND}`"
        )


def choose(
    dataset: str, config_budget: int, unit: str, latest: ev.BudgetSet | None
) -> BudgetChoice:
    """The rule of the module: ``latest`` holds while the config's value is the one
    it was set against, in the same unit."""
    if (
        latest is not None
        and latest.config_budget == config_budget
        and latest.unit == unit
        and latest.budget != config_budget
    ):
        return BudgetChoice(dataset, config_budget, unit, latest.budget, "set", latest)
    return BudgetChoice(dataset, config_budget, unit, config_budget, "config", latest)


def latest_budget_sets(bootstrap: str, topics: Topics) -> dict[str, ev.BudgetSet]:
    """The latest ``BudgetSet`` of each dataset on the control topic (a dataset's
    events are on one partition, in order). Blocking."""
    latest: dict[str, ev.BudgetSet] = {}

    def keep(event: ev.Event) -> None:
        if isinstance(event, ev.BudgetSet):
            latest[event.dataset] = event

    read_to_end(bootstrap, topics.control, keep)
    return latest


def choices(config: Config, latest: dict[str, ev.BudgetSet]) -> list[BudgetChoice]:
    unit = config.budget.unit
    return [choose(d.name, d.budget, unit, latest.get(d.name)) for d in config.datasets]


def config_budget_set(config: Config, choice: BudgetChoice) -> ev.BudgetSet:
    """The event that puts the config's value in force."""
    return ev.BudgetSet(
        dataset=choice.dataset,
        budget=choice.config,
        unit=config.budget.unit,
        set_at=time.time(),
        set_by=f"config {config.source}",
        config_budget=choice.config,
    )
