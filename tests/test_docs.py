"""The docs a newcomer reads: the README opens with the two commands, stays short, and
the generated reference pages (config keys, command line) match the code they
describe (docs/gen_reference.py writes them)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_reference", ROOT / "docs" / "gen_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_config_key_has_a_description_where_it_is_declared(generator: ModuleType) -> None:
    assert generator.undescribed() == []
    keys = generator.config_reference()
    for key in ("kafka.bootstrap", "inference.reasoning_end", "datasets[].format", "budget.cut"):
        assert f"| `{key}` |" in keys


@pytest.mark.parametrize("page", ["config.md", "cli.md"])
def test_the_committed_reference_is_what_the_generator_writes(
    generator: ModuleType, page: str
) -> None:
    committed = (ROOT / "docs" / "reference" / page).read_text()
    assert committed == generator.PAGES[page](), (
        f"docs/reference/{page} is not current: run .venv/bin/python docs/gen_reference.py"
    )


def test_a_format_lists_every_value_it_takes(generator: ModuleType) -> None:
    """The two tables that said otherwise are one, generated from the Literal."""
    row = next(
        line
        for line in generator.config_reference().splitlines()
        if line.startswith("| `datasets[].format` |")
    )
    for value in ("auto", "prompt", "openai", "sharegpt", "hf"):
        assert f'`"{value}"`' in row


def test_the_readme_opens_with_the_two_commands_and_fits_a_first_hour() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.startswith("# tokenbudget\n\n```\nmake demo\nmake test\n```\n")
    assert len(readme.splitlines()) <= 200
    assert "make test" in (ROOT / ".ci" / "run").read_text()  # CI runs the README's command


def test_every_alert_has_its_runbook_where_its_link_points() -> None:
    """An alert's runbook_url is <runbooks>#<alert in lower case>: a heading of
    docs/monitoring.md (infra/prometheus/prometheus.yml's runbooks)."""
    yaml = pytest.importorskip("yaml")
    rules = yaml.safe_load(
        (ROOT / "infra" / "prometheus" / "rules" / "tokenbudget.yml").read_text()
    )
    page = (ROOT / "docs" / "monitoring.md").read_text().splitlines()
    for rule in rules["groups"][0]["rules"]:
        assert f"### {rule['alert']}" in page
    prometheus = (ROOT / "infra" / "prometheus" / "prometheus.yml").read_text()
    assert "docs/monitoring.md" in prometheus


def test_the_readmes_links_reach_pages_that_exist() -> None:
    """mkdocs build --strict checks the links between docs/ pages; the README is not
    one of them."""
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert targets
    for target in targets:
        assert (ROOT / target).exists(), target
