"""The Hugging Face stack is an extra: a feature that needs it says which to install."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from producers.tokenizers import load_tokenizer
from tokenbudget.extras import MissingExtraError, require


def test_a_missing_extra_names_the_feature_and_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(MissingExtraError) as error:
        require("transformers", "[inference] tokenizer")
    assert str(error.value) == (
        "[inference] tokenizer needs the transformers package: pip install 'tokenbudget[hf]'"
    )


def test_a_tokenizer_without_the_extra_is_that_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(MissingExtraError, match=r"tokenbudget\[hf\]"):
        load_tokenizer(str(tmp_path))


def test_the_default_install_needs_no_hugging_face_package() -> None:
    import tomllib

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    required = " ".join(project["dependencies"])
    for package in ("transformers", "datasets", "tokenizers", "jinja2"):
        assert package not in required, package
    assert {"transformers", "datasets"} <= {
        dep.split(">")[0].split("=")[0] for dep in project["optional-dependencies"]["hf"]
    }
