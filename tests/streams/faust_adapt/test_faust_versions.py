"""The version pins of the libraries the ledger adapts, the start-up check that
refuses others, and install(): nothing patched at import, the one process-wide
change applied by install()."""

from __future__ import annotations

import inspect
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from faust.transport.producer import ProducerBuffer

from tokenbudget.core.errors import FaustVersionError, TokenBudgetError
from tokenbudget.streams import faust_adapt
from tokenbudget.streams.faust_adapt.versions import NOT_INSTALLED, REQUIRED, check_versions
from tokenbudget.streams.ledger_worker import LedgerSettings, build_app
from tokenbudget.streams.topics import Topics

PYPROJECT = Path(__file__).resolve().parents[3] / "pyproject.toml"


def test_the_pinned_versions_pass() -> None:
    check_versions(REQUIRED.__getitem__)


@pytest.mark.parametrize("package", sorted(REQUIRED))
def test_another_version_of_any_adapted_library_is_refused(package: str) -> None:
    versions = {**REQUIRED, package: "9.9.9"}
    with pytest.raises(FaustVersionError) as refused:
        check_versions(versions.__getitem__)
    error = refused.value
    assert isinstance(error, TokenBudgetError)
    assert (error.package, error.installed, error.required) == (package, "9.9.9", REQUIRED[package])
    message = str(error)
    assert "9.9.9" in message
    assert f"pip install '{package}=={REQUIRED[package]}'" in message


def test_a_library_not_installed_is_refused() -> None:
    versions = {**REQUIRED, "mode-streaming": NOT_INSTALLED}
    with pytest.raises(FaustVersionError, match="mode-streaming not installed is installed"):
        check_versions(versions.__getitem__)


def test_the_installed_libraries_are_the_pinned_ones() -> None:
    """CI installs from pyproject.toml: its pins and the check's must be the same."""
    dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    pins = dict(spec.split("==") for spec in dependencies if "==" in spec)
    assert {package: pins.get(package) for package in REQUIRED} == REQUIRED
    check_versions()


def test_install_refuses_another_version_before_changing_anything() -> None:
    # In a child: this test must not depend on whether another one called install().
    code = """
from faust.transport.producer import ProducerBuffer
from tokenbudget.streams import faust_adapt
from tokenbudget.core.errors import FaustVersionError
default = ProducerBuffer.max_messages
try:
    faust_adapt.install({"faust-streaming": "0.16.0"}.get)
except FaustVersionError:
    pass
print(ProducerBuffer.max_messages == default)
"""
    assert _run(code) == "True"


def test_importing_changes_nothing_and_install_sets_the_producer_buffer() -> None:
    code = """
from faust.transport.producer import ProducerBuffer
default = ProducerBuffer.max_messages
import tokenbudget.streams.ledger_worker
import tokenbudget.streams.faust_adapt
from tokenbudget.streams import faust_adapt
print(ProducerBuffer.max_messages == default, default)
faust_adapt.install()
print(ProducerBuffer.max_messages)
"""
    unchanged, installed = _run(code).splitlines()
    assert unchanged.split()[0] == "True"
    assert int(unchanged.split()[1]) != faust_adapt.PRODUCER_BUFFER_MESSAGES
    assert int(installed) == faust_adapt.PRODUCER_BUFFER_MESSAGES == 20_000


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout.strip()


def test_fausts_producer_buffer_stalls_deliveries_at_the_class_wide_limit() -> None:
    """What install() changes is what Faust reads: the limit is a class attribute,
    not set per instance, and the wait that holds deliveries compares with it."""
    assert "max_messages" not in inspect.getsource(ProducerBuffer.__init__)
    assert "if self.size > self.max_messages:" in inspect.getsource(ProducerBuffer.wait_until_ebb)
    app = build_app(LedgerSettings("127.0.0.1:9", Topics("unit")))  # install()s
    assert type(app.producer.buffer) is ProducerBuffer
    assert app.producer.buffer.max_messages == faust_adapt.PRODUCER_BUFFER_MESSAGES
