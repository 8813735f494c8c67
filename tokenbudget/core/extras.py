"""Packages imported only where a feature needs them (the Hugging Face stack: slow to
import, and ``datasets`` is an extra): a missing one is a one-line error naming the
feature and the install command."""

from __future__ import annotations

import importlib
from types import ModuleType

from tokenbudget.core.errors import TokenBudgetError

# module -> the extra that installs it; the others are dependencies of tokenbudget itself
EXTRAS = {"datasets": "hf"}


class MissingExtraError(TokenBudgetError):
    """A feature needs a package of an extra that is not installed."""


def require(module: str, feature: str) -> ModuleType:
    """``module``, imported; raise :class:`MissingExtraError` naming ``feature`` and
    what to install when it is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = EXTRAS.get(module)
        # A dependency of tokenbudget missing: the environment lost it (or pinned it out).
        install = f"pip install 'tokenbudget[{extra}]'" if extra else f"pip install {module}"
        raise MissingExtraError(f"{feature} needs the {module} package: {install}") from exc
