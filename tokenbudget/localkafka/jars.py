"""The local Kafka broker's jars without Maven: one lock file per Kafka version, a downloader.

Contract:

* ``kafka_resources/jars-<version>.lock`` (package data) lists every jar the broker of
  that Kafka version runs with, sorted, one per line; ``#`` lines are comments, and
  ``# key: value`` comments are metadata (``kafka-version``, ``pom-sha256``)::

      group<TAB>artifact<TAB>version<TAB>sha256<TAB>size

  ``make jars-lock`` (:mod:`tokenbudget.localkafka.jarlock`) regenerates the locks with Maven from
  ``infra/kafka/pom.xml``. Nothing else needs Maven.
* :func:`ensure` makes ``libs`` hold exactly the locked jars, each checked by size and
  SHA-256, downloading the missing ones from
  ``<repository>/<group as path>/<artifact>/<version>/<artifact>-<version>.jar``. The
  repository is ``$TOKENBUDGET_MAVEN_REPOSITORY`` (an http(s) mirror, or a ``file://``
  directory in the Maven layout for air-gapped hosts), else Maven Central.
* A download goes to ``<name>.part`` (fsynced, then renamed over ``<name>``), so ``libs``
  never holds half a jar; a ``.part`` left by an interrupted run is continued with an
  HTTP Range request. A digest mismatch is an error that deletes the bad file; it is
  never retried silently.
* ``complete.json`` beside ``libs`` records what was verified (the lock's digest, each
  jar's digest, size and mtime): later calls only stat the jars and touch no network.
  A cache Maven filled earlier is verified once by digest and kept.
* ``.lock`` beside ``libs`` (the file lock the Maven path in :mod:`tokenbudget.localkafka.storage`
  takes too) keeps two processes from filling the same cache at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TextIO
from urllib.parse import urlsplit
from urllib.request import url2pathname

import httpx

from tokenbudget.core.errors import BrokerError
from tokenbudget.core.files import fsync_dir, locked, write_atomic

log = logging.getLogger(__name__)

LOCK_DIR = Path(__file__).resolve().parent / "kafka_resources"
DEFAULT_REPOSITORY = "https://repo.maven.apache.org/maven2"
REPOSITORY_ENV = "TOKENBUDGET_MAVEN_REPOSITORY"
MARKER_FILE = "complete.json"
COLUMNS = ("group", "artifact", "version", "sha256", "size")

# Connect fails fast on a dead mirror; read is generous for slow links (per chunk, not
# per jar).
_TIMEOUT = httpx.Timeout(60.0, connect=15.0)
_CHUNK = 1 << 16
_FIELD = re.compile(r"[A-Za-z0-9_.\-]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_META = re.compile(r"#\s*([a-z][a-z0-9-]*):\s*(\S.*?)\s*")
_LOCK_NAME = re.compile(r"jars-(.+)\.lock")


@dataclass(frozen=True)
class Jar:
    group: str
    artifact: str
    version: str
    sha256: str
    size: int

    @property
    def name(self) -> str:
        return f"{self.artifact}-{self.version}.jar"

    def url(self, repository: str) -> str:
        path = self.group.replace(".", "/")
        return f"{repository}/{path}/{self.artifact}/{self.version}/{self.name}"

    def line(self) -> str:
        return "\t".join((self.group, self.artifact, self.version, self.sha256, str(self.size)))


@dataclass(frozen=True)
class Lock:
    path: Path
    jars: tuple[Jar, ...]
    meta: Mapping[str, str]  # the ``# key: value`` header lines
    sha256: str  # of the whole file: the marker notices a regenerated lock

    @property
    def names(self) -> set[str]:
        return {jar.name for jar in self.jars}


# --------------------------------------------------------------------------- lock files


def lock_file(version: str, lock_dir: Path | None = None) -> Path | None:
    """The packaged lock for Kafka ``version``, or None when this version has none."""
    path = (lock_dir or LOCK_DIR) / f"jars-{version}.lock"
    return path if path.is_file() else None


def locked_versions(lock_dir: Path | None = None) -> list[str]:
    """The Kafka versions with a packaged lock, oldest first."""
    found = []
    for path in (lock_dir or LOCK_DIR).glob("jars-*.lock"):
        match = _LOCK_NAME.fullmatch(path.name)
        if match:
            found.append(match.group(1))
    return sorted(found, key=lambda v: [int(p) if p.isdigit() else 0 for p in v.split(".")])


def format_lock(jars: Sequence[Jar], meta: Mapping[str, str]) -> str:
    """The text of a lock file: a header, then one sorted line per jar."""
    lines = [
        "# The jars the local Kafka broker runs with, fetched from a Maven repository and",
        "# checked by SHA-256 (tokenbudget/localkafka/jars.py). Generated, do not edit:",
        "# `make jars-lock` (python -m tokenbudget.localkafka.jarlock) regenerates it from",
        "# infra/kafka/pom.xml with Maven.",
    ]
    lines += [f"# {key}: {value}" for key, value in meta.items()]
    lines.append("# " + "\t".join(COLUMNS))
    ordered = sorted(jars, key=lambda jar: (jar.group, jar.artifact, jar.version))
    lines += [jar.line() for jar in ordered]
    return "\n".join(lines) + "\n"


def _parse_line(path: Path, number: int, line: str) -> Jar:
    fields = line.split("\t")
    fix = "regenerate it with `make jars-lock`, or reinstall tokenbudget"
    if len(fields) != len(COLUMNS):
        raise BrokerError(
            f"{path}:{number}: expected {len(COLUMNS)} tab-separated fields "
            f"({', '.join(COLUMNS)}), got {line!r}; {fix}"
        )
    group, artifact, version, sha256, size = fields
    if not all(_FIELD.fullmatch(f) for f in (group, artifact, version)):
        raise BrokerError(f"{path}:{number}: bad group, artifact or version in {line!r}; {fix}")
    if not _SHA256.fullmatch(sha256) or not size.isdigit():
        raise BrokerError(f"{path}:{number}: bad sha256 or size in {line!r}; {fix}")
    return Jar(group, artifact, version, sha256, int(size))


def read_lock(path: Path) -> Lock:
    """Parse a lock file; a malformed one is a BrokerError naming the line."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BrokerError(f"cannot read the jar lock {path}: {exc}; reinstall tokenbudget") from exc
    jars: list[Jar] = []
    meta: dict[str, str] = {}
    for number, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if line.startswith("#"):
            match = _META.fullmatch(line)
            if match:
                meta[match.group(1)] = match.group(2)
        elif line.strip():
            jars.append(_parse_line(path, number, line.rstrip("\r")))
    names = [jar.name for jar in jars]
    if not jars or len(set(names)) != len(names):
        raise BrokerError(
            f"{path} lists no jars or a jar name twice; regenerate it with `make jars-lock`"
        )
    return Lock(path, tuple(jars), meta, hashlib.sha256(data).hexdigest())


# --------------------------------------------------------------------------- the cache


def repository_url(repository: str | None = None) -> str:
    """``repository``, else $TOKENBUDGET_MAVEN_REPOSITORY, else Maven Central; no '/' at end."""
    raw = repository or os.environ.get(REPOSITORY_ENV, "").strip() or DEFAULT_REPOSITORY
    if urlsplit(raw).scheme not in ("http", "https", "file"):
        raise BrokerError(
            f"{REPOSITORY_ENV}={raw!r} is not an http(s):// or file:// URL of a Maven "
            f"repository; set it to a mirror like {DEFAULT_REPOSITORY}, or unset it"
        )
    return raw.rstrip("/")


def ensure(
    libs: Path, lock_path: Path, *, repository: str | None = None, stream: TextIO | None = None
) -> Path:
    """Make ``libs`` hold exactly the jars of the lock at ``lock_path``; return ``libs``.

    Offline when the cache is complete. ``repository`` overrides
    $TOKENBUDGET_MAVEN_REPOSITORY; progress goes to ``stream`` (stderr).
    """
    lock = read_lock(lock_path)
    marker = libs.parent / MARKER_FILE
    if _complete(libs, marker, lock):
        return libs
    with locked(libs.parent / ".lock"):
        if _complete(libs, marker, lock):
            return libs
        libs.mkdir(parents=True, exist_ok=True)
        _remove_strays(libs, lock)
        missing = [jar for jar in lock.jars if not _verified(libs / jar.name, jar)]
        if missing:
            fetch = _Fetch(libs, lock, repository_url(repository), stream or sys.stderr)
            fetch.all(missing)
        _write_marker(marker, libs, lock)
    return libs


def _complete(libs: Path, marker: Path, lock: Lock) -> bool:
    """Whether the marker vouches for this lock and every jar still has its size and mtime."""
    try:
        data = json.loads(marker.read_text())
        present = {name for name in os.listdir(libs) if name.endswith(".jar")}
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict) or data.get("lock_sha256") != lock.sha256:
        return False
    recorded = data.get("jars")
    if not isinstance(recorded, dict) or present != lock.names or set(recorded) != lock.names:
        return False
    for jar in lock.jars:
        entry = recorded[jar.name]
        try:
            st = (libs / jar.name).stat()
        except OSError:
            return False
        if not isinstance(entry, dict) or entry.get("sha256") != jar.sha256:
            return False
        if st.st_size != jar.size or entry.get("mtime_ns") != st.st_mtime_ns:
            return False
    return True


def _remove_strays(libs: Path, lock: Lock) -> None:
    # The broker's classpath is ``libs/*``: a jar the lock does not list (another
    # version's, a leftover) would load beside the right ones.
    for path in libs.iterdir():
        if path.suffix == ".jar" and path.name not in lock.names:
            log.info("removing %s: not in %s", path, lock.path.name)
            path.unlink()
        elif path.suffix == ".part" and path.name.removesuffix(".part") not in lock.names:
            path.unlink()


def _sha256(path: Path) -> str:
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def _verified(path: Path, jar: Jar) -> bool:
    """Whether ``path`` is ``jar``; a file that is not is deleted (it is downloaded again)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return False
    if size == jar.size and _sha256(path) == jar.sha256:
        return True
    log.warning("%s does not match its lock entry (size or SHA-256): fetching it again", path)
    path.unlink()
    return False


def _write_marker(marker: Path, libs: Path, lock: Lock) -> None:
    jars = {}
    for jar in lock.jars:
        st = (libs / jar.name).stat()
        jars[jar.name] = {"sha256": jar.sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    data = {
        "kafka_version": lock.meta.get("kafka-version", ""),
        "lock": lock.path.name,
        "lock_sha256": lock.sha256,
        "jars": jars,
    }
    write_atomic(marker, json.dumps(data, indent=1, sort_keys=True))


# --------------------------------------------------------------------------- downloads


class _Progress:
    """One updating line (bytes done/total) on a terminal; else the one header line."""

    def __init__(self, stream: TextIO, total: int, count: int) -> None:
        self.stream = stream
        self.total = total
        self.count = count
        self.done = 0
        self.index = 0
        self.name = ""
        self.shown = 0.0
        try:
            self.tty = stream.isatty()
        except (AttributeError, ValueError):
            self.tty = False

    def begin(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def next_jar(self, name: str) -> None:
        self.index += 1
        self.name = name
        self._draw(force=True)

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        self._draw()

    def end(self) -> None:
        if self.tty:
            self._draw(force=True)
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.tty or (not force and now - self.shown < 0.1):
            return
        self.shown = now
        text = f"  {_mb(self.done)}/{_mb(self.total)} MB  [{self.index}/{self.count}] {self.name}"
        width = max(20, shutil.get_terminal_size().columns - 1)
        self.stream.write("\r" + text[:width].ljust(width))
        self.stream.flush()


def _mb(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f}"


class _Fetch:
    """Downloads jars of one lock from one repository into one libs directory."""

    def __init__(self, libs: Path, lock: Lock, repository: str, stream: TextIO) -> None:
        self.libs = libs
        self.lock = lock
        self.repository = repository
        self.stream = stream
        self.progress = _Progress(stream, 0, 0)

    def all(self, jars: Sequence[Jar]) -> None:
        total = sum(jar.size for jar in jars)
        self.progress = _Progress(self.stream, total, len(jars))
        self.progress.begin(
            f"tokenbudget: downloading {len(jars)} Kafka jars ({_mb(total)} MB) "
            f"from {self.repository} into {self.libs}"
        )
        try:
            if self.repository.startswith("file:"):
                for jar in jars:
                    self.progress.next_jar(jar.name)
                    self._install(jar, self._copy(jar))
            else:
                headers = {"User-Agent": "tokenbudget", "Accept-Encoding": "identity"}
                with httpx.Client(timeout=_TIMEOUT, follow_redirects=True, headers=headers) as c:
                    for jar in jars:
                        self.progress.next_jar(jar.name)
                        self._install(jar, self._get(c, jar))
        finally:
            self.progress.end()
        # The renames are durable only once the folder itself is on disk.
        fsync_dir(self.libs)

    def _copy(self, jar: Jar) -> Path:
        """Copy ``jar`` from a file:// repository into its ``.part``."""
        url = jar.url(self.repository)
        source = Path(url2pathname(urlsplit(url).path))
        part = self.libs / f"{jar.name}.part"
        try:
            with source.open("rb") as src, part.open("wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
                dst.flush()
                os.fsync(dst.fileno())
        except OSError as exc:
            raise BrokerError(
                f"cannot copy {jar.name} from {url}: {exc}. {REPOSITORY_ENV}="
                f"{self.repository} must be a directory in the Maven repository layout "
                "holding every jar of the lock; fix or unset it"
            ) from exc
        self.progress.advance(jar.size)
        return part

    def _get(self, client: httpx.Client, jar: Jar) -> Path:
        """Download ``jar`` into its ``.part``, continuing a partial one."""
        url = jar.url(self.repository)
        part = self.libs / f"{jar.name}.part"
        try:
            offset = part.stat().st_size
        except FileNotFoundError:
            offset = 0
        if offset > jar.size:  # not a prefix of this jar: start over
            part.unlink()
            offset = 0
        if offset == jar.size:  # complete but not yet renamed: the digest decides
            self.progress.advance(offset)
            return part
        try:
            self._stream(client, url, part, offset)
        except httpx.HTTPError as exc:
            raise BrokerError(
                f"downloading {url} failed: {type(exc).__name__}: {exc}. Is {self.repository} "
                f"reachable? Set {REPOSITORY_ENV} to a reachable Maven mirror (or a file:// "
                "directory in the Maven layout), or unset it for Maven Central; running "
                "again resumes the download"
            ) from exc
        return part

    def _stream(self, client: httpx.Client, url: str, part: Path, offset: int) -> None:
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        with client.stream("GET", url, headers=headers) as response:
            mode = self._mode(url, response, offset)
            if mode is not None:
                self.progress.advance(offset if mode == "ab" else 0)
                with part.open(mode) as fh:
                    for chunk in response.iter_bytes(_CHUNK):
                        fh.write(chunk)
                        self.progress.advance(len(chunk))
                    fh.flush()
                    os.fsync(fh.fileno())
                return
        # The server does not take the .part for a prefix of the jar: start over.
        part.unlink()
        self._stream(client, url, part, 0)

    def _mode(self, url: str, response: httpx.Response, offset: int) -> str | None:
        """Append the body ("ab"), write it afresh ("wb"), or None: drop the .part."""
        status = response.status_code
        if status == 200:
            return "wb"  # also what a server that ignores Range sends: the whole jar
        if offset and status == 206:
            content_range = response.headers.get("content-range", "")
            return "ab" if content_range.startswith(f"bytes {offset}-") else None
        if offset and status == 416:
            return None
        self._http_error(url, response)

    def _http_error(self, url: str, response: httpx.Response) -> NoReturn:
        status = f"HTTP {response.status_code} {response.reason_phrase}".strip()
        hint = "does not have it" if response.status_code == 404 else "refused it"
        raise BrokerError(
            f"downloading {url} failed: {status}: {self.repository} {hint}. Set "
            f"{REPOSITORY_ENV} to a Maven repository (mirror) that has every jar of "
            f"{self.lock.path.name}, or unset it for Maven Central"
        )

    def _install(self, jar: Jar, part: Path) -> None:
        """Check the digest of ``part`` and rename it to the jar, or delete it and fail."""
        url = jar.url(self.repository)
        size = part.stat().st_size
        digest = _sha256(part)
        if size != jar.size or digest != jar.sha256:
            part.unlink(missing_ok=True)
            raise BrokerError(
                f"{jar.name} from {url} does not match {self.lock.path}: expected SHA-256 "
                f"{jar.sha256} ({jar.size} bytes), got {digest} ({size} bytes); the file was "
                f"deleted. A corrupted transfer passes on a retry; if it fails again, the "
                f"repository serves a different file: point {REPOSITORY_ENV} at a correct "
                "mirror (or unset it for Maven Central)"
            )
        os.replace(part, self.libs / jar.name)
