"""One import name: installed, the project is ``tokenbudget`` and nothing else.

The design keeps ``streams/``, ``producers/`` and ``sinks/`` at the repository's top;
``tokenbudget/streams`` and its siblings are symbolic links to them, which the wheel
resolves into files (tests/integration/test_wheel.py checks the wheel's own top-level
names). Nothing imports them by their bare folder names, which another package in a
vLLM or SGLang environment could shadow or be shadowed by.
"""

from __future__ import annotations

import ast
import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("streams", "producers", "sinks")


def test_the_package_list_installs_tokenbudget_alone() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = config["tool"]["setuptools"]["packages"]
    assert packages and all(p == "tokenbudget" or p.startswith("tokenbudget.") for p in packages)
    assert {f"tokenbudget.{f}" for f in FOLDERS} <= set(packages)
    assert config["tool"]["importlinter"]["root_package"] == "tokenbudget"
    assert config["tool"]["mypy"]["packages"] == ["tokenbudget"]


def test_the_top_folders_are_the_packages_under_tokenbudget() -> None:
    for folder in FOLDERS:
        link = ROOT / "tokenbudget" / folder
        assert link.is_symlink() and link.resolve() == (ROOT / folder).resolve(), link


def test_nothing_imports_a_top_folder_by_its_bare_name() -> None:
    tracked = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    bare = []
    for name in tracked:
        path = ROOT / name
        if path.is_symlink() or not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            bare += [f"{name}:{node.lineno} {m}" for m in modules if m.split(".")[0] in FOLDERS]
    assert bare == []
