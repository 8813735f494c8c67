"""The jar locks and the downloader, against a fake Maven repository on 127.0.0.1."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tokenbudget.core.errors import BrokerError
from tokenbudget.localkafka import jarlock, jars
from tokenbudget.localkafka.settings import BrokerSettings

# Two small fake jars (the real ones are 43 MB).
FILES = {
    ("org.example", "alpha", "1.0"): os.urandom(200_000),
    ("org.example.deep", "beta", "2.1"): b"PK\x03\x04beta" * 1000,
}


def _jar(group: str, artifact: str, version: str, data: bytes) -> jars.Jar:
    return jars.Jar(group, artifact, version, hashlib.sha256(data).hexdigest(), len(data))


def _jars() -> list[jars.Jar]:
    return [_jar(*key, data) for key, data in FILES.items()]


def _write_lock(path: Path, entries: list[jars.Jar]) -> Path:
    path.write_text(jars.format_lock(entries, {"kafka-version": "0.0.1"}))
    return path


@dataclass
class Repo:
    """What the fake repository serves and what it was asked."""

    url: str
    files: dict[str, bytes]
    ranges: bool = True  # False: ignore Range headers like some mirrors do
    requests: list[tuple[str, str | None]] = field(default_factory=list)  # (path, Range)


def _handler(repo: Repo) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            wanted = self.headers.get("Range")
            repo.requests.append((self.path, wanted))
            data = repo.files.get(self.path)
            if data is None:
                self.send_error(404)
                return
            start = 0
            if wanted and repo.ranges:
                start = int(wanted.removeprefix("bytes=").split("-")[0])
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            self.send_header("Content-Length", str(len(data) - start))
            self.end_headers()
            self.wfile.write(data[start:])

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler


@pytest.fixture
def repo() -> Iterator[Repo]:
    files = {}
    for (group, artifact, version), data in FILES.items():
        path = f"/maven2/{group.replace('.', '/')}/{artifact}/{version}/{artifact}-{version}.jar"
        files[path] = data
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    state = Repo(f"http://127.0.0.1:{server.server_address[1]}/maven2", files)
    server.RequestHandlerClass = _handler(state)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


@pytest.fixture
def lock(tmp_path: Path) -> Path:
    return _write_lock(tmp_path / "jars-0.0.1.lock", _jars())


def _closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/maven2"  # nothing listens there any more


def _names(libs: Path) -> list[str]:
    return sorted(p.name for p in libs.iterdir())


def _check_libs(libs: Path) -> None:
    assert _names(libs) == ["alpha-1.0.jar", "beta-2.1.jar"]
    for (_, artifact, version), data in FILES.items():
        assert (libs / f"{artifact}-{version}.jar").read_bytes() == data


# --------------------------------------------------------------------------- downloads


def test_download_and_verify(tmp_path: Path, repo: Repo, lock: Path) -> None:
    libs = tmp_path / "kafka-0.0.1" / "libs"
    stream = io.StringIO()
    assert jars.ensure(libs, lock, repository=repo.url, stream=stream) == libs
    _check_libs(libs)
    assert len(repo.requests) == 2
    assert "downloading 2 Kafka jars" in stream.getvalue()  # one line: not a terminal
    assert len(stream.getvalue().splitlines()) == 1
    marker = json.loads((libs.parent / "complete.json").read_text())
    assert set(marker["jars"]) == {"alpha-1.0.jar", "beta-2.1.jar"}
    # Complete now: nothing is fetched again.
    jars.ensure(libs, lock, repository=repo.url, stream=stream)
    assert len(repo.requests) == 2


def test_a_partial_download_resumes_with_range(tmp_path: Path, repo: Repo, lock: Path) -> None:
    libs = tmp_path / "libs"
    libs.mkdir()
    alpha = FILES[("org.example", "alpha", "1.0")]
    (libs / "alpha-1.0.jar.part").write_bytes(alpha[:123_456])
    jars.ensure(libs, lock, repository=repo.url, stream=io.StringIO())
    _check_libs(libs)
    ranges = {path.rsplit("/", 1)[1]: wanted for path, wanted in repo.requests}
    assert ranges == {"alpha-1.0.jar": "bytes=123456-", "beta-2.1.jar": None}


def test_a_server_ignoring_range_restarts_the_download(
    tmp_path: Path, repo: Repo, lock: Path
) -> None:
    repo.ranges = False
    libs = tmp_path / "libs"
    libs.mkdir()
    alpha = FILES[("org.example", "alpha", "1.0")]
    (libs / "alpha-1.0.jar.part").write_bytes(alpha[:1000])
    jars.ensure(libs, lock, repository=repo.url, stream=io.StringIO())
    _check_libs(libs)  # the whole jar, not the part and then the whole jar again


def test_a_complete_part_is_not_fetched_and_an_oversize_one_is_dropped(
    tmp_path: Path, repo: Repo, lock: Path
) -> None:
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / "alpha-1.0.jar.part").write_bytes(FILES[("org.example", "alpha", "1.0")])
    (libs / "beta-2.1.jar.part").write_bytes(b"x" * 100_000)  # longer than beta
    jars.ensure(libs, lock, repository=repo.url, stream=io.StringIO())
    _check_libs(libs)
    assert [(path.rsplit("/", 1)[1], wanted) for path, wanted in repo.requests] == [
        ("beta-2.1.jar", None)
    ]


def test_a_checksum_mismatch_is_an_error_and_leaves_no_file(tmp_path: Path, repo: Repo) -> None:
    entries = _jars()
    bad = jars.Jar(entries[0].group, entries[0].artifact, entries[0].version, "ab" * 32, 200_000)
    lock = _write_lock(tmp_path / "jars-0.0.1.lock", [bad, entries[1]])
    libs = tmp_path / "libs"
    with pytest.raises(BrokerError) as info:
        jars.ensure(libs, lock, repository=repo.url, stream=io.StringIO())
    message = str(info.value)
    assert "alpha-1.0.jar" in message
    assert f"{repo.url}/org/example/alpha/1.0/alpha-1.0.jar" in message
    assert "ab" * 32 in message
    assert bad.sha256 != entries[0].sha256 and entries[0].sha256 in message
    assert "TOKENBUDGET_MAVEN_REPOSITORY" in message
    assert not (libs / "alpha-1.0.jar").exists()
    assert not (libs / "alpha-1.0.jar.part").exists()
    assert not (libs.parent / "complete.json").exists()


def test_a_missing_jar_names_the_url_and_the_mirror_setting(tmp_path: Path, repo: Repo) -> None:
    lock = _write_lock(tmp_path / "jars-0.0.1.lock", [_jar("org.example", "gone", "1", b"x")])
    with pytest.raises(BrokerError, match=r"gone/1/gone-1\.jar.*404.*TOKENBUDGET_MAVEN_REPOSITORY"):
        jars.ensure(tmp_path / "libs", lock, repository=repo.url, stream=io.StringIO())


def test_an_unreachable_repository_names_the_url_and_the_mirror_setting(
    tmp_path: Path, lock: Path
) -> None:
    url = _closed_port_url()
    with pytest.raises(BrokerError, match=rf"{url}/org/example.*TOKENBUDGET_MAVEN_REPOSITORY"):
        jars.ensure(tmp_path / "libs", lock, repository=url, stream=io.StringIO())


def test_a_complete_cache_needs_no_network(tmp_path: Path, repo: Repo, lock: Path) -> None:
    libs = tmp_path / "libs"
    jars.ensure(libs, lock, repository=repo.url, stream=io.StringIO())
    assert jars.ensure(libs, lock, repository=_closed_port_url()) == libs
    # Without its marker (a cache Maven filled): verified by digest, still no network.
    (libs.parent / "complete.json").unlink()
    assert jars.ensure(libs, lock, repository=_closed_port_url()) == libs
    assert (libs.parent / "complete.json").is_file()


def test_a_maven_cache_is_kept_and_strays_removed(tmp_path: Path, lock: Path) -> None:
    libs = tmp_path / "libs"
    libs.mkdir()
    for (_, artifact, version), data in FILES.items():
        (libs / f"{artifact}-{version}.jar").write_bytes(data)
    (libs / "other-9.jar").write_bytes(b"not in the lock")
    (libs.parent / "complete.json").write_text(
        json.dumps({"kafka_version": "0.0.1", "pom_sha256": "0" * 64, "jars": ["x.jar"]})
    )
    jars.ensure(libs, lock, repository=_closed_port_url(), stream=io.StringIO())
    _check_libs(libs)  # the stray jar would have been on the classpath (libs/*)


def test_a_changed_jar_is_fetched_again(tmp_path: Path, repo: Repo, lock: Path) -> None:
    libs = tmp_path / "libs"
    jars.ensure(libs, lock, repository=repo.url, stream=io.StringIO())
    (libs / "beta-2.1.jar").write_bytes(b"truncated")
    jars.ensure(libs, lock, repository=repo.url, stream=io.StringIO())
    _check_libs(libs)
    assert len(repo.requests) == 3


def test_the_repository_environment_variable_is_honoured(
    tmp_path: Path, repo: Repo, lock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENBUDGET_MAVEN_REPOSITORY", repo.url + "/")
    jars.ensure(tmp_path / "libs", lock, stream=io.StringIO())
    _check_libs(tmp_path / "libs")
    assert len(repo.requests) == 2


def test_a_file_repository_works_offline(
    tmp_path: Path, repo: Repo, lock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mirror = tmp_path / "mirror"
    for path, data in repo.files.items():
        target = mirror / path.removeprefix("/maven2/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    monkeypatch.setenv("TOKENBUDGET_MAVEN_REPOSITORY", mirror.as_uri())
    jars.ensure(tmp_path / "libs", lock, stream=io.StringIO())
    _check_libs(tmp_path / "libs")
    assert repo.requests == []


def test_a_repository_that_is_no_url_is_refused(
    tmp_path: Path, lock: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENBUDGET_MAVEN_REPOSITORY", "repo.example.org/maven2")
    with pytest.raises(BrokerError, match="TOKENBUDGET_MAVEN_REPOSITORY"):
        jars.ensure(tmp_path / "libs", lock, stream=io.StringIO())


def test_a_terminal_gets_one_updating_line(tmp_path: Path, repo: Repo, lock: Path) -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    jars.ensure(tmp_path / "libs", lock, repository=repo.url, stream=stream)
    lines = stream.getvalue().split("\n")
    assert "downloading 2 Kafka jars" in lines[0]
    assert "\r" in lines[1] and "[2/2] beta-2.1.jar" in lines[1].rsplit("\r", 1)[1]
    assert lines[2:] == [""]


# --------------------------------------------------------------------------- lock files


def test_a_malformed_lock_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "jars-1.lock"
    path.write_text("# header\norg.example\talpha\t1.0\tnot-a-digest\t12\n")
    with pytest.raises(BrokerError, match=r"jars-1\.lock:2: bad sha256"):
        jars.read_lock(path)


def test_packaged_lock_for_4_1_1() -> None:
    path = jars.lock_file("4.1.1")
    assert path is not None
    lock = jars.read_lock(path)
    found = {(jar.group, jar.artifact): jar.version for jar in lock.jars}
    assert found[("org.apache.kafka", "kafka_2.13")] == "4.1.1"
    assert found[("org.apache.kafka", "kafka-clients")] == "4.1.1"
    for artifact in ("log4j-api", "log4j-core", "log4j-slf4j-impl", "log4j-1.2-api"):
        assert ("org.apache.logging.log4j", artifact) in found
    assert lock.meta["kafka-version"] == "4.1.1"
    cache = BrokerSettings(kafka_version="4.1.1").libs_dir
    if not cache.is_dir():
        pytest.skip(f"no jar cache at {cache} to compare with")
    assert lock.names == {p.name for p in cache.iterdir() if p.suffix == ".jar"}


@pytest.mark.parametrize("version", ["4.1.1", "3.9.1"])
def test_packaged_locks_match_the_pom(version: str) -> None:
    assert version in jars.locked_versions()
    path = jars.lock_file(version)
    assert path is not None
    lock = jars.read_lock(path)
    assert lock.meta["kafka-version"] == version
    assert f"kafka_2.13-{version}.jar" in lock.names
    if not jarlock.POM.is_file():
        pytest.skip("no infra/kafka/pom.xml (not a checkout)")
    digest = hashlib.sha256(jarlock.POM.read_bytes()).hexdigest()
    assert lock.meta["pom-sha256"] == digest, "infra/kafka/pom.xml changed: run make jars-lock"


def test_the_generator_parses_dependency_list_output(tmp_path: Path) -> None:
    jar = tmp_path / "repo" / "kafka_2.13-4.1.1.jar"
    jar.parent.mkdir()
    jar.write_bytes(b"kafka")
    other = tmp_path / "repo" / "slf4j-api-1.7.36.jar"
    other.write_bytes(b"slf4j")
    listing = (
        "\nThe following files have been resolved:\n"
        f"   org.apache.kafka:kafka_2.13:jar:4.1.1:compile:{jar}\n"
        f"   org.slf4j:slf4j-api:jar:1.7.36:runtime:{other} -- module org.slf4j\n"
    )
    resolved = jarlock.parse_listing(listing)
    assert [(r.group, r.artifact, r.version, r.path) for r in resolved] == [
        ("org.apache.kafka", "kafka_2.13", "4.1.1", jar),
        ("org.slf4j", "slf4j-api", "1.7.36", other),
    ]
    entries = jarlock.lock_entries(resolved, "4.1.1")
    assert entries[0] == _jar("org.apache.kafka", "kafka_2.13", "4.1.1", b"kafka")
    text = jars.format_lock(entries, {"kafka-version": "4.1.1"})
    path = tmp_path / "jars-4.1.1.lock"
    path.write_text(text)
    assert jars.read_lock(path).jars == tuple(sorted(entries, key=lambda j: j.group))
    classified = jarlock.parse_listing(f"g:a:jar:linux:1:runtime:{jar}\n")
    with pytest.raises(BrokerError, match="plain jars only"):
        jarlock.lock_entries(classified, "4.1.1")
