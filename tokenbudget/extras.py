"""Optional parts of tokenbudget, installed as extras, imported where a feature needs
them: a missing one is a one-line error naming the feature and the install command."""

from __future__ import annotations

import importlib
from types import ModuleType

from tokenbudget.errors import TokenBudgetError

# module -> the extra that installs it
EXTRAS = {"transformers": "hf", "datasets": "hf", "jinja2": "hf"}


class MissingExtraError(TokenBudgetError):
    """A feature needs a package of an extra that is not installed."""


def require(module: str, feature: str) -> ModuleType:
    """``module``, imported; raise :class:`MissingExtraError` naming ``feature`` and
    the extra to install when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRAS.get(module, "hf")
        raise MissingExtraError(
            f"{feature} needs the {module} package: pip install 'tokenbudget[{extra}]'"
        ) from exc
