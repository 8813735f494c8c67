"""Hugging Face datasets are an extra, transformers a dependency imported where needed:
a feature whose package is missing says what to install."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tokenbudget.core.extras import MissingExtraError, require
from tokenbudget.producers.templates import load_tokenizer


def test_a_missing_extra_names_the_feature_and_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(MissingExtraError) as error:
        require("datasets", "format 'hf'")
    assert str(error.value) == (
        "format 'hf' needs the datasets package: pip install 'tokenbudget[hf]'"
    )


def test_a_tokenizer_without_transformers_says_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # a dependency the env lost
    with pytest.raises(MissingExtraError, match="needs the transformers package: pip install"):
        load_tokenizer(str(tmp_path))


def _names(requirements: list[str]) -> set[str]:
    return {dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in requirements}


def test_transformers_is_a_dependency_and_datasets_an_extra() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())["project"]
    required = _names(project["dependencies"])
    # chat templates (the demo's too) need no extra
    assert {"transformers", "jinja2"} <= required
    assert "datasets" not in required
    assert _names(project["optional-dependencies"]["hf"]) == {"datasets"}
