"""What an inference API or a row format can do is read from its traits
(:mod:`tokenbudget.core.apis`, :mod:`tokenbudget.core.formats`), never told by its
name: read from the product's syntax trees, no module but those two compares an
API's or a format's name as a string literal (``==``, ``!=``, ``in``/``not in`` a
literal tuple, set or list, a ``match`` case), nor spells a collection of such
names (a second table). Registries keyed by name (a dict literal) and the names as
values (a default, a request's ``api``) are fine."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tokenbudget.core.apis import API_TRAITS
from tokenbudget.core.formats import FORMAT_TRAITS

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tokenbudget", "streams", "producers", "sinks")
TRAITS_MODULES = ("tokenbudget/core/apis.py", "tokenbudget/core/formats.py")
AXES = {"api": frozenset(API_TRAITS), "format": frozenset(FORMAT_TRAITS)}
NAMES = frozenset().union(*AXES.values())
# Operands that hold another vocabulary, where a word is no API or format: an
# event's tag ("prompt").
OTHER_VOCABULARIES = frozenset({"tag"})


def modules() -> Iterator[tuple[str, ast.Module]]:
    seen: set[Path] = set()
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.resolve() in seen:
                continue  # tokenbudget/producers and the like are links to the top
            seen.add(path.resolve())
            name = str(path.resolve().relative_to(ROOT))
            if name not in TRAITS_MODULES:
                yield name, ast.parse(path.read_text(encoding="utf-8"), filename=name)


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in NAMES:
        return node.value
    return None


def _other_vocabulary(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in OTHER_VOCABULARIES


def _literal_names(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Tuple | ast.Set | ast.List):
        return [n for n in map(_name, node.elts) if n is not None]
    return []


def _table_copy(node: ast.AST) -> bool:
    """A tuple, set or list of two or more names, all of one axis: a table of its own."""
    if not isinstance(node, ast.Tuple | ast.Set | ast.List) or len(node.elts) < 2:
        return False
    values = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
    return any(all(v in names for v in values) for names in AXES.values())


def comparisons(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(line, name) of every comparison of a name, and every copy of a table."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands, operands[1:], strict=False):
                if _other_vocabulary(left) or _other_vocabulary(right):
                    continue
                if isinstance(op, ast.Eq | ast.NotEq | ast.Is | ast.IsNot):
                    for name in filter(None, (_name(left), _name(right))):
                        yield node.lineno, name
                elif isinstance(op, ast.In | ast.NotIn):
                    for name in _literal_names(right):
                        yield node.lineno, name
        elif isinstance(node, ast.MatchValue) and (name := _name(node.value)):
            yield node.lineno, name
        elif _table_copy(node):
            yield getattr(node, "lineno", 0), "/".join(_literal_names(node))


def test_no_module_tells_an_api_or_a_format_by_its_name() -> None:
    found = [
        f"{module}:{line}: {name!r}"
        for module, tree in modules()
        for line, name in comparisons(tree)
    ]
    assert found == [], "compared by name, not read from the traits:\n" + "\n".join(found)


def test_the_scan_sees_the_product() -> None:
    names = {module for module, _ in modules()}
    assert "tokenbudget/core/config.py" in names, "wrong root?"
    assert "producers/inference/backends.py" in names
    assert not names & set(TRAITS_MODULES)
