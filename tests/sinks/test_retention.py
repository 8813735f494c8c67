"""Completions and budget events stay replayable: retention is configurable and
keeps everything by default; prompts expire."""

from __future__ import annotations

from tokenbudget.app.bootstrap import topic_specs
from tokenbudget.core import config as config_module
from tokenbudget.streams.topics import Topics, completion_topic_configs


def configs(specs: list, name: str) -> dict[str, str]:
    return next(s.configs for s in specs if s.name == name)


def test_default_keeps_completions_and_budget_events_forever() -> None:
    topics = Topics("n")
    specs = topics.specs()
    for name in (topics.completions, topics.budgets, topics.outcomes):
        assert configs(specs, name)["retention.ms"] == "-1"
        assert configs(specs, name)["retention.bytes"] == "-1"
    assert configs(specs, topics.prompts)["retention.ms"] == str(7 * 24 * 3600 * 1000)
    assert configs(specs, topics.completions)["max.message.bytes"] == "8388608"
    assert completion_topic_configs() == configs(specs, topics.completions)


def test_retention_comes_from_the_config() -> None:
    config = config_module.build(
        {
            "kafka": {
                "namespace": "n",
                "completion_retention_ms": 30 * 24 * 3600 * 1000,
                "budget_retention_ms": 1000,
                "prompt_retention_ms": 60_000,
            }
        },
        environ={},
    )
    topics = Topics("n")
    specs = topic_specs(config)
    assert configs(specs, topics.completions)["retention.ms"] == str(30 * 24 * 3600 * 1000)
    assert configs(specs, topics.budgets)["retention.ms"] == "1000"
    assert configs(specs, topics.outcomes)["retention.ms"] == "1000"
    assert configs(specs, topics.prompts)["retention.ms"] == "60000"
    defaults = topic_specs(config_module.build({}, environ={}))
    assert configs(defaults, Topics().completions)["retention.ms"] == "-1"
