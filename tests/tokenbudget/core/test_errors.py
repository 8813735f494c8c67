"""The exception tree drawn in tokenbudget/core/errors.py is the tree: every error of
tokenbudget's packages is drawn under its own base, and one declared outside
errors.py is drawn with its module."""

from __future__ import annotations

import importlib
import pkgutil
import re

from tokenbudget.core import errors
from tokenbudget.core.errors import TokenBudgetError

PACKAGES = ("tokenbudget",)  # streams, producers and sinks are its subpackages


def _drawn() -> dict[str, str]:
    """Each class drawn in the module docstring -> the class drawn above it."""
    assert errors.__doc__ is not None
    parents: dict[str, str] = {}
    stack = ["TokenBudgetError"]
    for line in errors.__doc__.splitlines():
        found = re.search(r"[├└]── (\w+)", line)
        if found is None:
            continue
        depth = found.start() // 4  # every level is drawn 4 characters further in
        del stack[depth:]
        parents[found.group(1)] = stack[-1]
        stack.append(found.group(1))
    return parents


def _declared() -> list[type[TokenBudgetError]]:
    for package in PACKAGES:
        root = importlib.import_module(package)
        for module in pkgutil.walk_packages(root.__path__, f"{package}."):
            if not module.name.endswith("__main__"):
                importlib.import_module(module.name)
    found, todo = [], [TokenBudgetError]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__module__.split(".")[0] in PACKAGES and cls is not TokenBudgetError:
            found.append(cls)
    return found


def test_every_error_is_drawn_under_its_base() -> None:
    drawn = _drawn()
    declared = _declared()
    assert {cls.__name__: cls.__bases__[0].__name__ for cls in declared} == drawn


def test_an_error_declared_elsewhere_is_drawn_with_its_module() -> None:
    assert errors.__doc__ is not None
    drawing = errors.__doc__
    outside = [cls for cls in _declared() if cls.__module__ != errors.__name__]
    assert outside  # the drawing names some: this test would see a lost one
    for cls in outside:
        entry = drawing[drawing.index(f"── {cls.__name__} ") :].split("──")[1]
        assert cls.__module__ in " ".join(entry.split()), cls
