"""tokenbudget: exact per-dataset token budgets for synthetic data generation."""

import functools
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed

__version__ = "0.1.0"  # of a checkout run without being installed


@functools.cache
def version() -> str:
    """The installed distribution's version (``__version__`` when not installed)."""
    try:
        return installed("tokenbudget")
    except PackageNotFoundError:
        return __version__
