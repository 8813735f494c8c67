"""tokenbudget.localkafka.broker: rendered properties and guards (pure), and one real broker run."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from tokenbudget.core import kafka_admin
from tokenbudget.core.errors import BrokerError, ConfigError
from tokenbudget.dev.ports import free_port
from tokenbudget.localkafka import broker, jars
from tokenbudget.localkafka.process import wait_ready
from tokenbudget.localkafka.properties import (
    _infra_file,
    _scram_arguments,
    broker_command,
    pom_path,
    render_properties,
)
from tokenbudget.localkafka.settings import (
    DEFAULT_KAFKA_VERSION,
    Authorizer,
    BrokerSettings,
    SaslPlaintextListener,
    SaslSslListener,
)
from tokenbudget.localkafka.storage import _format_storage, ensure_jars
from tokenbudget.streams.topics import TopicSpec


def _props(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


# --------------------------------------------------------------------------- pure


@pytest.mark.parametrize("version", ["4.1.1", "4.0.0"])
def test_properties_kafka4_have_share_coordinator_settings(tmp_path: Path, version: str) -> None:
    settings = BrokerSettings(
        home=tmp_path, port=19092, controller_port=19093, kafka_version=version
    )
    props = _props(render_properties(settings))
    assert props["share.coordinator.state.topic.replication.factor"] == "1"
    assert props["share.coordinator.state.topic.min.isr"] == "1"


def test_properties_kafka3_have_no_share_coordinator_settings(tmp_path: Path) -> None:
    settings = BrokerSettings(home=tmp_path, kafka_version="3.9.1")
    text = render_properties(settings)
    assert "share.coordinator" not in "\n".join(
        line for line in text.splitlines() if not line.startswith("#")
    )
    assert _props(text)["process.roles"] == "broker,controller"


def test_properties_ports_quorum_and_dirs(tmp_path: Path) -> None:
    settings = BrokerSettings(home=tmp_path / "h", port=29092, controller_port=29093)
    text = render_properties(settings)
    assert "${" not in text
    props = _props(text)
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:29092"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:29093"
    assert "controller.quorum.bootstrap.servers" not in props  # static quorum
    assert props["log.dirs"] == str((tmp_path / "h").resolve() / "data")
    assert props["node.id"] == "1"
    assert props["controller.listener.names"] == "CONTROLLER"
    assert props["inter.broker.listener.name"] == "PLAINTEXT"
    assert props["listener.security.protocol.map"] == "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    assert props["auto.create.topics.enable"] == "false"
    assert props["num.partitions"] == "4"
    assert props["offsets.topic.num.partitions"] == "4"
    for key in (
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "transaction.state.log.min.isr",
        "default.replication.factor",
    ):
        assert props[key] == "1"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    # the topics carry their own (tokenbudget.core.sizes), as on a cluster of Kafka's defaults
    assert "message.max.bytes" not in props
    assert not any(key.startswith("log.retention") for key in props)
    assert settings.bootstrap == "127.0.0.1:29092"


def test_properties_of_a_cluster_node(tmp_path: Path) -> None:
    """A node of tokenbudget.dev.cluster: its own id, the shared quorum, and a cluster's
    replication defaults for every internal topic."""
    voters = "1@127.0.0.1:9001,2@127.0.0.1:9002,3@127.0.0.1:9003"
    settings = BrokerSettings(
        home=tmp_path,
        controller_port=9002,
        node_id=2,
        quorum_voters=voters,
        replication_factor=3,
        min_insync_replicas=2,
    )
    props = _props(render_properties(settings))
    assert props["node.id"] == "2"
    assert props["controller.quorum.voters"] == voters
    for key in (
        "default.replication.factor",
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "share.coordinator.state.topic.replication.factor",
    ):
        assert props[key] == "3", key
    for key in (
        "min.insync.replicas",
        "transaction.state.log.min.isr",
        "share.coordinator.state.topic.min.isr",
    ):
        assert props[key] == "2", key


def test_a_reassignment_plan_raises_every_partition_to_the_replicas_asked() -> None:
    described = [
        {
            "name": "ns.completions",
            "partitions": [
                {"partition_index": 1, "replica_nodes": [2]},
                {"partition_index": 0, "replica_nodes": [1]},
            ],
        },
        {"name": "ns.budgets", "partitions": [{"partition_index": 0, "replica_nodes": [3, 1]}]},
    ]
    plan = kafka_admin.reassignment_plan(described, [1, 2, 3], 3)
    assert plan["version"] == 1
    moves = {(p["topic"], p["partition"]): p["replicas"] for p in plan["partitions"]}
    assert set(moves) == {("ns.completions", 0), ("ns.completions", 1), ("ns.budgets", 0)}
    for (topic, _partition), replicas in moves.items():
        assert sorted(replicas) == [1, 2, 3], (topic, replicas)
    # the current replicas stay first: the leader does not move
    assert moves[("ns.completions", 0)][0] == 1
    assert moves[("ns.completions", 1)][0] == 2
    assert moves[("ns.budgets", 0)][:2] == [3, 1]


def test_bad_kafka_version_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        render_properties(BrokerSettings(home=tmp_path, kafka_version="latest"))


def test_broker_command(tmp_path: Path) -> None:
    settings = BrokerSettings(
        home=tmp_path, heap_mb=512, jars_root=tmp_path / "jars", kafka_version="3.9.1"
    )
    cmd = broker_command(settings, "/usr/bin/java")
    assert cmd[0] == "/usr/bin/java"
    assert "-Xmx512m" in cmd and "-Xms512m" in cmd and "-XX:+UseG1GC" in cmd
    assert f"-Dlog4j2.configurationFile={tmp_path.resolve() / 'log4j2.properties'}" in cmd
    assert cmd[cmd.index("-cp") + 1] == f"{(tmp_path / 'jars').resolve()}/kafka-3.9.1/libs/*"
    assert cmd[-2:] == ["kafka.Kafka", str(tmp_path.resolve() / "server.properties")]


def test_settings_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENBUDGET_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TOKENBUDGET_KAFKA_PORT", "19500")
    monkeypatch.setenv("TOKENBUDGET_KAFKA_CONTROLLER_PORT", "19501")
    monkeypatch.setenv("TOKENBUDGET_KAFKA_VERSION", "3.9.1")
    monkeypatch.setenv("TOKENBUDGET_JARS", str(tmp_path / "jars"))
    settings = BrokerSettings.from_env()
    assert settings.home == tmp_path / "home"
    assert (settings.port, settings.controller_port) == (19500, 19501)
    assert settings.kafka_version == "3.9.1"
    assert settings.bootstrap == "127.0.0.1:19500"
    assert settings.libs_dir == tmp_path / "jars" / "kafka-3.9.1" / "libs"
    monkeypatch.setenv("TOKENBUDGET_KAFKA_PORT", "ninety")
    with pytest.raises(ConfigError, match="TOKENBUDGET_KAFKA_PORT"):
        BrokerSettings.from_env()


def test_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for env in (
        "TOKENBUDGET_HOME",
        "TOKENBUDGET_JARS",
        "TOKENBUDGET_KAFKA_PORT",
        "TOKENBUDGET_KAFKA_CONTROLLER_PORT",
        "TOKENBUDGET_KAFKA_VERSION",
    ):
        monkeypatch.delenv(env, raising=False)
    settings = BrokerSettings.from_env()
    assert settings.home == Path.home() / ".cache" / "tokenbudget" / "broker"
    assert (settings.port, settings.controller_port, settings.heap_mb) == (9092, 9093, 768)
    assert settings.kafka_version == "4.1.1"
    assert settings.libs_dir == Path.home() / ".cache" / "tokenbudget" / "kafka-4.1.1" / "libs"


def _fake_mvn(bin_dir: Path, body: str) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    mvn = bin_dir / "mvn"
    mvn.write_text("#!/bin/sh\n" + body)
    mvn.chmod(0o755)


def _fake_lock(monkeypatch: pytest.MonkeyPatch, folder: Path, version: str, data: bytes) -> None:
    """Kafka ``version`` locked to one jar (kafka_2.13) with ``data``, in a file:// repo."""
    lock_dir = folder / "locks"
    lock_dir.mkdir(parents=True)
    digest = hashlib.sha256(data).hexdigest()
    entry = jars.Jar("org.apache.kafka", "kafka_2.13", version, digest, len(data))
    (lock_dir / f"jars-{version}.lock").write_text(jars.format_lock([entry], {}))
    monkeypatch.setattr(jars, "LOCK_DIR", lock_dir)
    repo = folder / "repo"
    target = repo / "org" / "apache" / "kafka" / "kafka_2.13" / version / entry.name
    target.parent.mkdir(parents=True)
    target.write_bytes(data)
    monkeypatch.setenv("TOKENBUDGET_MAVEN_REPOSITORY", repo.as_uri())


def test_ensure_jars_keeps_a_cache_maven_filled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = BrokerSettings(home=tmp_path / "home", jars_root=tmp_path / "jars")
    _fake_lock(monkeypatch, tmp_path, "4.1.1", b"jar")
    monkeypatch.setenv("TOKENBUDGET_MAVEN_REPOSITORY", f"http://127.0.0.1:{free_port()}/m2")
    libs = settings.libs_dir
    libs.mkdir(parents=True)
    (libs / "kafka_2.13-4.1.1.jar").write_bytes(b"jar")
    digest = hashlib.sha256(pom_path().read_bytes()).hexdigest()
    (libs.parent / "complete.json").write_text(
        json.dumps(
            {"kafka_version": "4.1.1", "pom_sha256": digest, "jars": ["kafka_2.13-4.1.1.jar"]}
        )
    )
    _fake_mvn(tmp_path / "bin", "echo called >&2; exit 1\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    # Neither the fake mvn nor the (closed) repository is used: the digest matches.
    assert ensure_jars(settings) == libs
    assert "lock_sha256" in json.loads((libs.parent / "complete.json").read_text())


def test_ensure_jars_downloads_a_locked_version_without_mvn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = BrokerSettings(
        home=tmp_path / "home", jars_root=tmp_path / "jars", kafka_version="3.9.1"
    )
    _fake_lock(monkeypatch, tmp_path, "3.9.1", b"kafka 3.9.1")
    monkeypatch.setattr(broker.shutil, "which", lambda name: None)
    libs = ensure_jars(settings)
    assert libs == settings.libs_dir
    assert (libs / "kafka_2.13-3.9.1.jar").read_bytes() == b"kafka 3.9.1"


def test_ensure_jars_runs_mvn_when_cache_incomplete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = BrokerSettings(
        home=tmp_path / "home", jars_root=tmp_path / "jars", kafka_version="3.9.1"
    )
    (tmp_path / "locks").mkdir()
    monkeypatch.setattr(jars, "LOCK_DIR", tmp_path / "locks")  # no lock: Maven fetches
    settings.libs_dir.mkdir(parents=True)
    (settings.libs_dir / "stale.jar").write_bytes(b"old")  # no marker: incomplete
    args_file = tmp_path / "args"
    _fake_mvn(
        tmp_path / "bin",
        f"""echo "$@" > {args_file}
for a in "$@"; do case "$a" in -DoutputDirectory=*) out="${{a#-DoutputDirectory=}}";; esac; done
mkdir -p "$out" && touch "$out/kafka_2.13-3.9.1.jar" "$out/slf4j-api-1.7.36.jar"
""",
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    libs = ensure_jars(settings)
    assert sorted(p.name for p in libs.iterdir()) == [
        "kafka_2.13-3.9.1.jar",
        "slf4j-api-1.7.36.jar",
    ]
    args = args_file.read_text().split()
    assert args[:5] == ["-q", "-B", "-f", str(pom_path()), "dependency:copy-dependencies"]
    assert "-Dkafka.version=3.9.1" in args
    assert json.loads((libs.parent / "complete.json").read_text())["kafka_version"] == "3.9.1"
    args_file.unlink()
    ensure_jars(settings)
    assert not args_file.exists()  # complete now: mvn not run again


def test_ensure_jars_reports_mvn_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = BrokerSettings(
        home=tmp_path / "home", jars_root=tmp_path / "jars", kafka_version="9.9.9"
    )
    _fake_mvn(
        tmp_path / "bin", "echo '[ERROR] Could not resolve dependencies for kafka 9.9.9'\nexit 1\n"
    )
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(BrokerError, match=r"(?s)9\.9\.9.*Could not resolve dependencies"):
        ensure_jars(settings)


def test_ensure_jars_without_mvn_lists_the_locked_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = BrokerSettings(
        home=tmp_path / "home", jars_root=tmp_path / "jars", kafka_version="9.9.9"
    )
    monkeypatch.setattr(broker.shutil, "which", lambda name: None)
    with pytest.raises(BrokerError, match=r"9\.9\.9 has no jar lock.*3\.9\.1, 4\.1\.1.*mvn"):
        ensure_jars(settings)


def test_up_refuses_a_port_held_by_something_else(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        settings = BrokerSettings(
            home=tmp_path / "home",
            port=port,
            controller_port=free_port(),
            jars_root=tmp_path / "jars",
        )
        with pytest.raises(BrokerError, match=f"127.0.0.1:{port}.*in use"):
            broker.up(settings, [])


def test_wait_ready_fails_fast_when_the_process_died(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    log_path = tmp_path / "broker.log"
    log_path.write_text("ERROR something broke\n")
    with pytest.raises(BrokerError, match=r"(?s)exited before it was ready.*something broke"):
        wait_ready(f"127.0.0.1:{free_port()}", 30, pid=proc.pid, log_path=log_path)


def test_wait_ready_open_port_is_not_ready(tmp_path: Path) -> None:
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        with pytest.raises(BrokerError, match="not ready after"):
            wait_ready(f"127.0.0.1:{port}", 2)


def test_status_and_down_without_broker(tmp_path: Path) -> None:
    settings = BrokerSettings(home=tmp_path / "nothing", port=free_port())
    st = broker.status(settings)
    assert (st.running, st.pid, st.ready) == (False, None, False)
    assert st.kafka_version == settings.kafka_version
    assert broker.down(settings) is False


def test_wipe_refuses_foreign_files(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("do not delete")
    with pytest.raises(BrokerError, match=r"thesis\.tex"):
        broker.wipe(BrokerSettings(home=home, port=free_port()))
    assert (home / "thesis.tex").exists()


def test_duplicate_conflicting_specs_rejected() -> None:
    specs = [TopicSpec("a", 4), TopicSpec("a", 2)]
    with pytest.raises(BrokerError, match="twice"):
        kafka_admin.ensure_topics("127.0.0.1:1", specs)


# --------------------------------------------------------------------------- SASL_SSL


def _secured(tmp_path: Path, **listener: Any) -> BrokerSettings:
    keystore = tmp_path / "broker.p12"
    keystore.write_bytes(b"not read by these tests")
    options: dict[str, Any] = {
        "port": 29094,
        "keystore": keystore,
        "keystore_password": "store-pw-1",
        "users": {"alice": "alice-pw-1", "bob": "bob-pw-2"},
        **listener,
    }
    return BrokerSettings(
        home=tmp_path / "h",
        port=29092,
        controller_port=29093,
        sasl_ssl=SaslSslListener(**options),
    )


def test_properties_with_a_sasl_ssl_listener(tmp_path: Path) -> None:
    settings = _secured(tmp_path)
    props = _props(render_properties(settings))
    assert props["listeners"] == (
        "PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093,SASL_SSL://127.0.0.1:29094"
    )
    assert props["advertised.listeners"] == (
        "PLAINTEXT://127.0.0.1:29092,SASL_SSL://127.0.0.1:29094"
    )
    assert props["listener.security.protocol.map"] == (
        "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL"
    )
    assert props["inter.broker.listener.name"] == "PLAINTEXT"  # probes and replication
    prefix = "listener.name.sasl_ssl."
    assert props[prefix + "sasl.enabled.mechanisms"] == "PLAIN,SCRAM-SHA-256,SCRAM-SHA-512"
    assert props[prefix + "ssl.keystore.type"] == "PKCS12"
    assert props[prefix + "ssl.keystore.location"] == str((tmp_path / "broker.p12").resolve())
    assert props[prefix + "ssl.keystore.password"] == "store-pw-1"
    assert props[prefix + "ssl.client.auth"] == "none"
    plain = props[prefix + "plain.sasl.jaas.config"]
    assert 'user_alice="alice-pw-1"' in plain and 'user_bob="bob-pw-2"' in plain
    assert plain.startswith("org.apache.kafka.common.security.plain.PlainLoginModule required")
    assert props[prefix + "scram-sha-512.sasl.jaas.config"].startswith(
        "org.apache.kafka.common.security.scram.ScramLoginModule required"
    )
    assert settings.sasl_ssl_bootstrap == "127.0.0.1:29094"


def test_truststore_requires_client_certificates(tmp_path: Path) -> None:
    truststore = tmp_path / "trust.p12"
    truststore.write_bytes(b"x")
    settings = _secured(tmp_path, truststore=truststore, truststore_password="trust-pw")
    props = _props(render_properties(settings))
    assert props["listener.name.sasl_ssl.ssl.client.auth"] == "required"
    assert props["listener.name.sasl_ssl.ssl.truststore.location"] == str(truststore.resolve())


def test_scram_users_are_added_at_format_time(tmp_path: Path) -> None:
    assert _scram_arguments(BrokerSettings(home=tmp_path)) == []
    assert _scram_arguments(_secured(tmp_path)) == [
        "--add-scram", "SCRAM-SHA-256=[name=alice,password=alice-pw-1]",
        "--add-scram", "SCRAM-SHA-512=[name=alice,password=alice-pw-1]",
        "--add-scram", "SCRAM-SHA-256=[name=bob,password=bob-pw-2]",
        "--add-scram", "SCRAM-SHA-512=[name=bob,password=bob-pw-2]",
    ]  # fmt: skip


def test_listener_passwords_never_show(tmp_path: Path) -> None:
    settings = _secured(tmp_path)
    for shown in (repr(settings), str(settings)):
        assert "store-pw-1" not in shown and "alice-pw-1" not in shown
    # Unquoted in server.properties and StorageTool's argument: a quote or comma would
    # break them. The error names the user, never the password.
    with pytest.raises(ConfigError) as info:
        render_properties(_secured(tmp_path, users={"alice": 'pw",x'}))
    assert info.value.key == "sasl_ssl.users.alice" and 'pw",x' not in str(info.value)
    with pytest.raises(ConfigError, match=r"sasl_ssl\.keystore"):
        render_properties(_secured(tmp_path, keystore=tmp_path / "absent.p12"))


def test_a_failed_format_does_not_show_the_passwords(tmp_path: Path) -> None:
    settings = _secured(tmp_path)
    settings.home.mkdir()
    settings.home.joinpath("server.properties").write_text("")
    fake_java = tmp_path / "java"
    fake_java.write_text('#!/bin/sh\necho "Invalid argument: $*" >&2\nexit 1\n')
    fake_java.chmod(0o755)
    with pytest.raises(BrokerError) as info:
        _format_storage(settings, str(fake_java))
    assert "Invalid argument" in str(info.value) and "--add-scram" in str(info.value)
    assert "alice-pw-1" not in str(info.value) and "bob-pw-2" not in str(info.value)


def test_users_added_after_the_first_format_are_refused(tmp_path: Path) -> None:
    settings = _secured(tmp_path)
    data = settings.home / "data"
    data.mkdir(parents=True)
    (data / "meta.properties").write_text("")
    (settings.home / "format.json").write_text(
        json.dumps({"kafka_version": "4.1.1", "cluster_id": "x", "scram_users": ["alice"]})
    )
    with pytest.raises(BrokerError, match=r"SCRAM users bob .*wipe"):
        _format_storage(settings, "java-is-not-called")


# --------------------------------------------------------------------------- SASL_PLAINTEXT, ACLs


def _authorized(tmp_path: Path, **settings: Any) -> BrokerSettings:
    options: dict[str, Any] = {
        "home": tmp_path / "h",
        "port": 29092,
        "controller_port": 29093,
        "sasl_plaintext": SaslPlaintextListener(29095, {"admin": "a-1", "disp": "d-2"}),
        "authorizer": Authorizer(("admin",)),
        **settings,
    }
    return BrokerSettings(**options)


def test_properties_with_a_sasl_plaintext_listener_and_the_authorizer(tmp_path: Path) -> None:
    settings = _authorized(tmp_path)
    props = _props(render_properties(settings))
    assert props["listeners"] == (
        "PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093,SASL_PLAINTEXT://127.0.0.1:29095"
    )
    assert props["advertised.listeners"] == (
        "PLAINTEXT://127.0.0.1:29092,SASL_PLAINTEXT://127.0.0.1:29095"
    )
    assert props["listener.security.protocol.map"] == (
        "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT"
    )
    prefix = "listener.name.sasl_plaintext."
    assert props[prefix + "sasl.enabled.mechanisms"] == "PLAIN,SCRAM-SHA-256,SCRAM-SHA-512"
    plain = props[prefix + "plain.sasl.jaas.config"]
    assert 'user_admin="a-1"' in plain and 'user_disp="d-2"' in plain
    assert props[prefix + "scram-sha-256.sasl.jaas.config"].startswith(
        "org.apache.kafka.common.security.scram.ScramLoginModule required"
    )
    assert not any(key.startswith("listener.name.sasl_ssl.") for key in props)  # no TLS
    assert props["authorizer.class.name"] == (
        "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    )
    assert props["allow.everyone.if.no.acl.found"] == "false"
    # the broker reaches its controller and itself as ANONYMOUS, on the PLAINTEXT and
    # CONTROLLER listeners: refused, it would not start
    assert props["super.users"] == "User:ANONYMOUS;User:admin"
    assert props["inter.broker.listener.name"] == "PLAINTEXT"
    assert settings.sasl_plaintext_bootstrap == "127.0.0.1:29095"
    assert _scram_arguments(settings) == [
        "--add-scram", "SCRAM-SHA-256=[name=admin,password=a-1]",
        "--add-scram", "SCRAM-SHA-512=[name=admin,password=a-1]",
        "--add-scram", "SCRAM-SHA-256=[name=disp,password=d-2]",
        "--add-scram", "SCRAM-SHA-512=[name=disp,password=d-2]",
    ]  # fmt: skip
    assert "a-1" not in repr(settings) and "d-2" not in repr(settings)


def test_without_an_authorizer_every_client_may_do_anything(tmp_path: Path) -> None:
    props = _props(render_properties(_authorized(tmp_path, authorizer=None)))
    assert not {"authorizer.class.name", "super.users"} & set(props)
    assert props["listener.name.sasl_plaintext.sasl.enabled.mechanisms"]  # the listener stays


def test_both_sasl_listeners_share_their_users_one_password_each(tmp_path: Path) -> None:
    secured = _secured(tmp_path)
    both = _authorized(tmp_path, sasl_ssl=secured.sasl_ssl)
    props = _props(render_properties(both))
    assert props["listeners"].endswith(
        ",SASL_SSL://127.0.0.1:29094,SASL_PLAINTEXT://127.0.0.1:29095"
    )
    assert props["listener.security.protocol.map"].endswith(
        ",SASL_SSL:SASL_SSL,SASL_PLAINTEXT:SASL_PLAINTEXT"
    )
    names = [arg.split("name=")[1].split(",")[0] for arg in _scram_arguments(both)[1::2]]
    assert names == ["alice"] * 2 + ["bob"] * 2 + ["admin"] * 2 + ["disp"] * 2
    twice = SaslPlaintextListener(29095, {"alice": "other-pw"})
    with pytest.raises(ConfigError) as info:
        _scram_arguments(_authorized(tmp_path, sasl_ssl=secured.sasl_ssl, sasl_plaintext=twice))
    assert info.value.key == "sasl_plaintext.users.alice" and "other-pw" not in str(info.value)


def test_bad_user_names_and_a_template_without_the_authorizer_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"authorizer\.super_users"):
        render_properties(_authorized(tmp_path, authorizer=Authorizer(("a;b",))))
    listener = SaslPlaintextListener(29095, {"disp": 'pw"'})
    with pytest.raises(ConfigError) as info:
        render_properties(_authorized(tmp_path, sasl_plaintext=listener))
    assert info.value.key == "sasl_plaintext.users.disp" and 'pw"' not in str(info.value)
    # a template of its own that would silently drop the authorizer
    template = _infra_file("server.properties.template").read_text()
    with pytest.raises(BrokerError, match="no authorizer placeholder"):
        render_properties(_authorized(tmp_path), template.replace("${authorizer}", ""))


def test_a_running_broker_without_the_authorizer_asked_for_is_not_taken(tmp_path: Path) -> None:
    settings = _authorized(tmp_path)
    settings.home.mkdir()
    started = {**broker._started_with(settings), "super_users": None}
    (settings.home / "broker.json").write_text(json.dumps(started))
    with pytest.raises(BrokerError, match=r"super_users None \(asked: \['admin'\]\).*down first"):
        broker._check_started_as_asked(settings, 4242)
    # broker.json of a broker started before these settings existed: it had neither
    older = {k: v for k, v in started.items() if not k.startswith(("sasl", "super"))}
    (settings.home / "broker.json").write_text(json.dumps(older))
    with pytest.raises(BrokerError, match="sasl_plaintext_port None"):
        broker._check_started_as_asked(settings, 4242)
    plain = BrokerSettings(home=settings.home, port=29092, controller_port=29093)
    broker._check_started_as_asked(plain, 4242)  # the broker it is


# --------------------------------------------------------------------------- real broker


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_broker_lifecycle(tmp_path: Path) -> None:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition
    from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient

    settings = BrokerSettings(
        home=tmp_path / "broker",
        port=free_port(),
        controller_port=free_port(),
        heap_mb=512,
        # TOKENBUDGET_KAFKA_VERSION=3.9.1 runs this against another version
        kafka_version=os.environ.get("TOKENBUDGET_KAFKA_VERSION", DEFAULT_KAFKA_VERSION),
    )
    name = f"itest.{uuid.uuid4().hex[:6]}"
    specs = [
        TopicSpec(name, partitions=3, configs={"retention.ms": "3600000"}),
        TopicSpec(f"{name}-changelog", partitions=3, configs={"cleanup.policy": "compact"}),
    ]
    try:
        assert broker.up(settings, specs) == settings.bootstrap
        st = broker.status(settings)
        assert st.running and st.ready and st.pid is not None
        assert st.kafka_version == settings.kafka_version
        assert (settings.home / "data" / "meta.properties").is_file()
        assert "Kafka Server started" in (settings.home / "broker.log").read_text()
        cluster_id = (settings.home / "cluster.id").read_text().strip()

        admin = KafkaAdminClient(bootstrap_servers=settings.bootstrap)
        try:
            topics = {t["name"]: t for t in admin.describe_topics([s.name for s in specs])}
            assert {n: len(t["partitions"]) for n, t in topics.items()} == {
                name: 3,
                f"{name}-changelog": 3,
            }
            configs = admin.describe_configs(
                [
                    ConfigResource(ConfigResourceType.TOPIC, name),
                    ConfigResource(ConfigResourceType.TOPIC, f"{name}-changelog"),
                ]
            )["topic"]
            assert configs[name]["retention.ms"]["value"] == "3600000"
            assert configs[f"{name}-changelog"]["cleanup.policy"]["value"] == "compact"
            assert admin.describe_cluster()["cluster_id"] == cluster_id
        finally:
            admin.close()

        producer = KafkaProducer(bootstrap_servers=settings.bootstrap, acks="all")
        producer.send(name, key=b"k", value=b"survives restarts", partition=1).get(30)
        producer.close()

        kafka_admin.ensure_topics(settings.bootstrap, specs)  # existing, matching: no-op
        with pytest.raises(BrokerError, match="partition"):
            kafka_admin.ensure_topics(settings.bootstrap, [TopicSpec(name, partitions=4)])

        # idempotent: same JVM, nothing restarted
        assert broker.up(settings, specs) == settings.bootstrap
        assert broker.status(settings).pid == st.pid

        assert broker.down(settings) is True
        assert not broker.status(settings).running
        assert broker.down(settings) is False

        broker.up(settings, specs)
        assert (settings.home / "cluster.id").read_text().strip() == cluster_id
        consumer = KafkaConsumer(bootstrap_servers=settings.bootstrap, auto_offset_reset="earliest")
        values: list[bytes] = []
        try:
            consumer.assign([TopicPartition(name, 1)])
            consumer.seek_to_beginning()
            for _ in range(30):
                for records in consumer.poll(timeout_ms=500).values():
                    values.extend(record.value for record in records)
                if values:
                    break
        finally:
            consumer.close()
        assert values == [b"survives restarts"]
        admin = KafkaAdminClient(bootstrap_servers=settings.bootstrap)
        try:
            assert {name, f"{name}-changelog"} <= set(admin.list_topics())
        finally:
            admin.close()
    finally:
        broker.wipe(settings)
    assert not settings.home.exists()
