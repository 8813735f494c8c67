"""The product stays in small parts, read from its syntax trees: no class has more than
``MAX_METHODS`` methods (a class that grows past it holds more than one concern:
split it into parts it composes, as the dispatcher and the simulator are), and no
function is longer than ``MAX_FUNCTION_LINES`` lines, from its ``def`` to its last
line, docstring and nested functions included; no module is longer than
``MAX_MODULE_LINES`` lines (a room a newcomer reads in one sitting), and each opens
with a docstring saying what it owns."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tokenbudget", "streams", "producers", "sinks")
MAX_METHODS = 25
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 600

Function = ast.FunctionDef | ast.AsyncFunctionDef


def sources() -> Iterator[tuple[str, str]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield str(path.relative_to(ROOT)), path.read_text(encoding="utf-8")


def modules() -> Iterator[tuple[str, ast.Module]]:
    for name, text in sources():
        yield name, ast.parse(text, filename=name)


def method_counts() -> dict[str, int]:
    """Methods defined in each class's own body, by ``module.py:Class``."""
    counts = {}
    for name, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, Function)]
                counts[f"{name}:{node.name}"] = len(methods)
    return counts


def function_lengths() -> dict[str, int]:
    """Lines of each function, by ``module.py:line:name``."""
    lengths = {}
    for name, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, Function):
                end = node.end_lineno or node.lineno
                lengths[f"{name}:{node.lineno}:{node.name}"] = end - node.lineno + 1
    return lengths


def test_no_class_has_more_than_max_methods() -> None:
    counts = method_counts()
    assert counts, "no classes found: wrong root?"
    too_many = {where: n for where, n in counts.items() if n > MAX_METHODS}
    assert too_many == {}, f"classes over {MAX_METHODS} methods: {too_many}"


def test_no_function_is_longer_than_max_lines() -> None:
    lengths = function_lengths()
    assert lengths, "no functions found: wrong root?"
    too_long = {where: n for where, n in lengths.items() if n > MAX_FUNCTION_LINES}
    assert too_long == {}, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


def test_no_module_is_longer_than_max_lines() -> None:
    lines = {name: len(text.splitlines()) for name, text in sources()}
    assert len(lines) > 100, "too few modules found: wrong root?"
    too_long = {name: n for name, n in lines.items() if n > MAX_MODULE_LINES}
    assert too_long == {}, f"modules over {MAX_MODULE_LINES} lines: {too_long}"


def test_every_module_opens_with_what_it_owns() -> None:
    found = list(modules())
    assert found, "no modules found: wrong root?"
    silent = [name for name, tree in found if not ast.get_docstring(tree)]
    assert silent == [], f"modules without a docstring: {silent}"
