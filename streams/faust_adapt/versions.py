"""The library versions the adaptations in :mod:`tokenbudget.streams.faust_adapt` were written
and contract-tested against, and the start-up check that refuses any other.

Every adaptation reaches into private code of these three libraries (overridden
methods, attributes set from outside, a coroutine stepped by hand); a release that
moves one of them does not fail loudly, it loses events. So the pins in
``pyproject.toml`` are exact, and a worker refuses to start on anything else.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

from tokenbudget.core.errors import FaustVersionError

# Keep equal to the `==` pins in pyproject.toml; tests/streams/faust_adapt checks both.
REQUIRED = {
    "faust-streaming": "0.15.3",
    "mode-streaming": "0.7.1",
    "aiokafka": "0.14.0",
}

NOT_INSTALLED = "not installed"


def installed_version(package: str) -> str:
    """The installed distribution's version, or :data:`NOT_INSTALLED`."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def check_versions(version_of: Callable[[str], str] = installed_version) -> None:
    """Raise :class:`FaustVersionError` for the first package in :data:`REQUIRED`
    whose version (as ``version_of`` reports it) is not the required one."""
    for package, required in REQUIRED.items():
        installed = version_of(package)
        if installed != required:
            raise FaustVersionError(package, installed, required)
