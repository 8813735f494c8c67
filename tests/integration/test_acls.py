"""Each role's principal kept to its topics by Kafka itself: a broker with a
SASL_PLAINTEXT listener and the StandardAuthorizer (deny by default), the ACLs
applied with ``tokenbudget acls --apply`` as the admin (a super user), then plain
kafka-python clients logged in as each role's principal, as ``[[kafka.roles]]`` gives
it. What a refused write did not write is read from the broker's own end offsets,
through its PLAINTEXT listener (a super user's door: User:ANONYMOUS, on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import secrets
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import GroupAuthorizationFailedError, TopicAuthorizationFailedError

from tokenbudget import cli
from tokenbudget.app.children import cli_command, stop_process
from tokenbudget.core import config as config_module
from tokenbudget.core import kafka_acls, kafka_admin, lifetime, roles, security
from tokenbudget.core.errors import KafkaAuthError
from tokenbudget.core.kafka import (
    GroupLag,
    client_options,
    consumer_options,
    kafka_python_options,
    wait_for_partitions,
)
from tokenbudget.core.roles import ROLES, Role
from tokenbudget.dev import oracle
from tokenbudget.dev.jobs import end_run, start_run, start_simulator, wait_until, write_job
from tokenbudget.dev.oracle import read_server_log
from tokenbudget.dev.ports import free_ports
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import Authorizer, BrokerSettings, SaslPlaintextListener
from tokenbudget.producers.prompts import resume
from tokenbudget.sinks.reading import read_to_end
from tokenbudget.streams import acls, codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetWatcher
from tokenbudget.streams.topics import Topics

# One worker runs them all (ONE_WORKER in tests/conftest.py): their module fixture is costly.
pytestmark = pytest.mark.integration

ADMIN = "admin"
USERS: dict[Role, str] = {
    "operator": "op",
    "producer": "prod",
    "dispatcher": "disp",
    "ledger": "ledg",
    "sink": "sink",
}


def _password_env(user: str) -> str:
    return f"TB_TEST_ACL_PW_{user.upper()}"


@dataclass(frozen=True)
class AclBroker:
    bootstrap: str  # the SASL_PLAINTEXT listener
    door: str  # the PLAINTEXT listener: ANONYMOUS, a super user
    topics: Topics
    config: Path
    security: security.KafkaSecurity
    applied: str  # what `tokenbudget acls --apply` printed


def write_config(folder: Path, bootstrap: str, namespace: str) -> Path:
    lines = [
        "[kafka]",
        f'bootstrap = "{bootstrap}"',
        f'namespace = "{namespace}"',
        'security_protocol = "SASL_PLAINTEXT"',
        'sasl_mechanism = "SCRAM-SHA-512"',
        f'sasl_username = "{ADMIN}"',
        f'sasl_password_env = "{_password_env(ADMIN)}"',
    ]
    for role, user in USERS.items():
        lines += ["[[kafka.roles]]", f'role = "{role}"', f'sasl_username = "{user}"']
        lines.append(f'sasl_password_env = "{_password_env(user)}"')
    lines += ["[inference]", 'url = "http://127.0.0.1:1"', "check_server = false"]
    lines += ["[[datasets]]", 'name = "d"', 'path = "d.jsonl"', 'budget = "1M"']
    (folder / "d.jsonl").write_text('{"prompt": "hello"}\n')
    path = folder / "tokenbudget.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def acl_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclBroker]:
    folder = tmp_path_factory.mktemp("acls")
    passwords = {user: secrets.token_hex(12) for user in (ADMIN, *USERS.values())}
    defaults = BrokerSettings.from_env()
    port, controller_port, sasl_port = free_ports(3)
    settings = BrokerSettings(
        home=folder / "broker",
        port=port,
        controller_port=controller_port,
        heap_mb=512,
        quick_start=True,
        kafka_version=defaults.kafka_version,
        jars_root=defaults.jars_root,
        sasl_plaintext=SaslPlaintextListener(sasl_port, passwords),
        authorizer=Authorizer((ADMIN,)),
    )
    assert settings.sasl_plaintext_bootstrap is not None
    bootstrap = settings.sasl_plaintext_bootstrap
    with pytest.MonkeyPatch.context() as env:
        for user, password in passwords.items():
            env.setenv(_password_env(user), password)
        broker.up(settings, [])
        try:
            topics = Topics(f"t{uuid.uuid4().hex[:10]}")
            config = write_config(folder, bootstrap, topics.namespace)
            applied = _applied(config)
            sec = security.KafkaSecurity.from_config(config_module.load(config))
            security.register(bootstrap, sec)
            with roles.acting_as("operator"):
                kafka_admin.ensure_topics(bootstrap, topics.specs())
            yield AclBroker(bootstrap, settings.bootstrap, topics, config, sec, applied)
        finally:
            broker.down(settings)


def _applied(config: Path) -> str:
    """What ``tokenbudget acls --config F --apply`` prints (it exits 0)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["acls", "--config", str(config), "--apply"]) == 0
    return out.getvalue()


# --------------------------------------------------------------------------- clients


def produce(b: AclBroker, role: Role, topic: str, value: bytes = b"{}") -> int:
    """One record written as ``role``'s principal by an idempotent producer (as every
    producer of ours is: the table grants no IdempotentWrite); its offset."""
    with roles.acting_as(role):
        options = kafka_python_options(client_options(b.bootstrap))
    producer = KafkaProducer(**options, acks="all", enable_idempotence=True)
    try:
        return int(producer.send(topic, key=b"d", value=value).get(30).offset)
    finally:
        producer.close(timeout=5)


def door_topics(b: AclBroker) -> set[str]:
    """The topics the broker has (its super-user door)."""
    consumer = KafkaConsumer(bootstrap_servers=b.door)
    try:
        return set(consumer.topics())
    finally:
        consumer.close()


def end_offsets(b: AclBroker, topic: str) -> int:
    """The sum of ``topic``'s end offsets, as the broker has them (its super-user door)."""
    consumer = KafkaConsumer(bootstrap_servers=b.door, group_id=None)
    try:
        parts = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
        return sum(consumer.end_offsets(parts).values())
    finally:
        consumer.close()


def _consumer(b: AclBroker, role: Role, **options: Any) -> KafkaConsumer:
    with roles.acting_as(role):
        built = kafka_python_options(consumer_options(b.bootstrap))
    return KafkaConsumer(**built, enable_auto_commit=False, **options)


def read_from_start(b: AclBroker, role: Role, topic: str, timeout: float = 60) -> list[bytes]:
    """Every record of ``topic``, read as ``role`` from the start without a group,
    as every process reads the commands and the announcements."""
    consumer = _consumer(b, role, group_id=None)
    try:
        tps = wait_for_partitions(consumer, topic, timeout=30)
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        ends = consumer.end_offsets(tps)
        values: list[bytes] = []
        deadline = time.monotonic() + timeout
        while any(consumer.position(tp) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, f"{topic} not read to its end"
            for records in consumer.poll(timeout_ms=500).values():
                values += [r.value for r in records]
        return values
    finally:
        consumer.close()


def read_in_group(
    b: AclBroker, role: Role, topic: str, group: str, count: int, timeout: float = 60
) -> list[bytes]:
    """``count`` records of ``topic`` read as ``role`` in ``group``, then committed."""
    consumer = _consumer(b, role, group_id=group, auto_offset_reset="earliest")
    consumer.subscribe([topic])
    try:
        values: list[bytes] = []
        deadline = time.monotonic() + timeout
        while len(values) < count:
            assert time.monotonic() < deadline, f"{len(values)} of {count} read"
            for records in consumer.poll(timeout_ms=500).values():
                values += [r.value for r in records]
        consumer.commit()
        return values
    finally:
        consumer.close(autocommit=False)


# --------------------------------------------------------------------------- tests


def test_acls_are_applied_once_each_as_the_table_has_them(acl_broker: AclBroker) -> None:
    b = acl_broker
    principals = {role: b.security.principal(role) for role in ROLES}
    wanted = acls.bindings(b.topics, principals)
    assert b.applied.startswith(f"added {len(wanted)} ACLs on {b.bootstrap}")
    # What the broker's authorizer holds, asked as the admin: the table, no more.
    held = [a for p in sorted(set(principals.values())) for a in kafka_acls.acls_of(b.bootstrap, p)]
    assert sorted(held) == wanted
    # A second --apply adds nothing.
    assert _applied(b.config).startswith(f"added 0 ACLs on {b.bootstrap}")
    again = [
        a for p in sorted(set(principals.values())) for a in kafka_acls.acls_of(b.bootstrap, p)
    ]
    assert sorted(again) == wanted


@pytest.mark.parametrize("name", ["budgets", "control", "prompts"])
def test_a_dispatchers_principal_may_not_write_a_budget_a_command_or_a_prompt(
    acl_broker: AclBroker, name: str
) -> None:
    topic = getattr(acl_broker.topics, name)
    before = end_offsets(acl_broker, topic)
    with pytest.raises(TopicAuthorizationFailedError):
        produce(acl_broker, "dispatcher", topic, codec.encode(ev.BudgetSet(dataset="d", budget=1)))
    assert end_offsets(acl_broker, topic) == before


def test_a_dispatcher_reads_prompts_in_its_group_and_writes_answers(
    acl_broker: AclBroker,
) -> None:
    b, t = acl_broker, acl_broker.topics
    prompts = [json.dumps({"prompt_id": f"p{i}"}).encode() for i in range(3)]
    for prompt in prompts:
        produce(b, "producer", t.prompts, prompt)
    with roles.acting_as("operator"):  # run's drain check: the group's committed offsets
        lag = GroupLag(b.bootstrap)
    try:
        written = end_offsets(b, t.prompts)  # these, and any another test wrote
        assert lag.lag(t.dispatch_group, [t.prompts]) == written
        read = read_in_group(b, "dispatcher", t.prompts, t.dispatch_group, written)
        assert set(prompts) <= set(read)
        assert lag.lag(t.dispatch_group, [t.prompts]) == 0
    finally:
        lag.close()
    before = end_offsets(b, t.completions)
    produce(b, "dispatcher", t.completions)
    produce(b, "dispatcher", t.reservations)
    assert end_offsets(b, t.completions) == before + 1
    # in another role's group it reads nothing
    with pytest.raises(GroupAuthorizationFailedError):
        read_in_group(b, "dispatcher", t.prompts, t.sink_group, 1)


def test_the_producers_principal_may_not_write_an_answer(acl_broker: AclBroker) -> None:
    before = end_offsets(acl_broker, acl_broker.topics.completions)
    with pytest.raises(TopicAuthorizationFailedError):
        produce(acl_broker, "producer", acl_broker.topics.completions)
    assert end_offsets(acl_broker, acl_broker.topics.completions) == before


def test_the_ledgers_principal_may_not_write_a_command(acl_broker: AclBroker) -> None:
    before = end_offsets(acl_broker, acl_broker.topics.control)
    with pytest.raises(TopicAuthorizationFailedError):
        produce(acl_broker, "ledger", acl_broker.topics.control)
    assert end_offsets(acl_broker, acl_broker.topics.control) == before


def test_an_operator_writes_commands_and_creates_and_checks_the_topics(
    acl_broker: AclBroker, caplog: pytest.LogCaptureFixture
) -> None:
    b = acl_broker
    before = end_offsets(b, b.topics.control)
    produce(b, "operator", b.topics.control)
    assert end_offsets(b, b.topics.control) == before + 1
    # The fixture made the topics as the operator; checking them again reads the
    # cluster's and the topics' configs, which it may.
    caplog.set_level(logging.WARNING, logger="tokenbudget.core.kafka_admin")
    with roles.acting_as("operator"):
        kafka_admin.ensure_topics(b.bootstrap, b.topics.specs())
    assert "cannot read" not in caplog.text
    assert {spec.name for spec in b.topics.specs()} <= door_topics(b)
    # A dispatcher creates none, in a namespace of its own or not.
    other = Topics(f"x{uuid.uuid4().hex[:8]}")
    with roles.acting_as("dispatcher"), pytest.raises(KafkaAuthError) as info:
        kafka_admin.ensure_topics(b.bootstrap, other.specs())
    assert f"does not let user '{USERS['dispatcher']}' create topics" in str(info.value)
    assert not {spec.name for spec in other.specs()} & door_topics(b)


@pytest.mark.parametrize("role", ROLES)
def test_every_role_reads_the_commands_and_the_announcements_from_the_start(
    acl_broker: AclBroker, role: Role
) -> None:
    b = acl_broker
    command = codec.encode(ev.BudgetSet(dataset=f"from-{role}", budget=5))
    produce(b, "operator", b.topics.control, command)
    announcement = codec.encode(ev.BudgetSet(dataset=f"announced-{role}", budget=5))
    produce(b, "ledger", b.topics.budgets, announcement)
    assert command in read_from_start(b, role, b.topics.control)
    assert announcement in read_from_start(b, role, b.topics.budgets)


def test_the_sink_reads_no_prompts(acl_broker: AclBroker) -> None:
    produce(acl_broker, "producer", acl_broker.topics.prompts, b'{"prompt_id": "s1"}')
    with pytest.raises(TopicAuthorizationFailedError):
        read_from_start(acl_broker, "sink", acl_broker.topics.prompts)


def _snapshot(b: AclBroker, dataset: str, samples: int, timeout: float = 90) -> ev.LedgerSnapshot:
    async def watch() -> ev.LedgerSnapshot:
        with roles.acting_as("sink"):
            watcher = BudgetWatcher(b.bootstrap, b.topics)
            await watcher.start()
        task = asyncio.create_task(watcher.run())
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                snap = watcher.board.snapshot(dataset)
                if snap is not None and snap.samples >= samples:
                    return snap
                await asyncio.sleep(0.2)
            raise AssertionError(f"no snapshot of {dataset} with {samples} samples")
        finally:
            task.cancel()
            await watcher.stop()

    return asyncio.run(watch())


def test_the_ledger_counts_under_its_principal_and_a_rerun_reads_what_it_recorded(
    acl_broker: AclBroker,
) -> None:
    """The Faust ledger, logged in as the ledger's principal, reads its group, writes
    its changelogs and announces; a rerun's producer and a dispatcher read what it
    recorded (producers/prompts/resume.py), which the sink's principal may not."""
    b, t = acl_broker, acl_broker.topics
    # The child gets only --bootstrap: it logs in as [kafka]'s user of the security
    # it inherits, here the ledger's.
    ledger_login = b.security.logins["ledger"]
    as_ledger = msgspec.structs.replace(
        b.security, sasl_username=ledger_login.username, sasl_password=ledger_login.password
    )
    env = security.subprocess_env(b.bootstrap)
    env[security.ENV_VAR] = json.dumps({b.bootstrap: msgspec.to_builtins(as_ledger)})
    command = cli_command(
        "ledger",
        "--bootstrap",
        b.bootstrap,
        "--namespace",
        t.namespace,
        "--snapshot-interval",
        "0.2",
    )
    ledger = lifetime.spawn(command, env=env)
    try:
        answer = ev.CompletionEvent(
            request_id=uuid.uuid4().hex,
            prompt_id="counted-1",
            dataset="counted",
            prompt_tokens=10,
            completion_tokens=100,
            output_ids=list(range(100)),
            finish_reason="stop",
            max_new_tokens=4096,
        )
        produce(b, "dispatcher", t.completions, codec.encode(answer))
        snap = _snapshot(b, "counted", samples=1)
        assert (snap.samples, snap.completion_tokens) == (1, 100)
        assert ledger.poll() is None
    finally:
        stop_process(ledger)
    with roles.acting_as("producer"):
        assert resume.outcome_records(b.bootstrap, t, timeout=30).get("counted-1") == "completed"
        resume.queued_prompt_ids(b.bootstrap, t, t.dispatch_group)
    with roles.acting_as("dispatcher"):
        view = resume.OutcomeView(b.bootstrap, t)
        try:
            view.refresh(30)
            assert "counted-1" in view.completed
        finally:
            view.close()
    with roles.acting_as("sink"), pytest.raises(GroupAuthorizationFailedError):
        resume.queued_prompt_ids(b.bootstrap, t, t.dispatch_group)


# ---------------------------------------------------------------- a whole job under ACLs


def job_under_acls(folder: Path, b: AclBroker, namespace: str, url: str) -> tuple[Path, dict]:
    """A job of two datasets whose every role logs in as its own principal."""
    datasets = {}
    for name, budget in (("a", 1500), ("b", 1200)):
        data = folder / f"{name}.jsonl"
        data.write_text(
            "".join(json.dumps({"prompt": f"#short {name} {i}"}) + "\n" for i in range(60))
        )
        datasets[name] = (data, budget)
    config = write_job(folder, b.bootstrap, namespace, url, datasets)
    roles_ = [
        "",
        *(
            f'[[kafka.roles]]\nrole = "{role}"\nsasl_username = "{user}"\n'
            f'sasl_password_env = "{_password_env(user)}"'
            for role, user in USERS.items()
        ),
    ]
    text = config.read_text().replace(
        "[kafka]\n",
        "[kafka]\n"
        'security_protocol = "SASL_PLAINTEXT"\n'
        'sasl_mechanism = "SCRAM-SHA-512"\n'
        f'sasl_username = "{ADMIN}"\n'
        f'sasl_password_env = "{_password_env(ADMIN)}"\n',
        1,
    )
    config.write_text(text + "\n".join(roles_) + "\n")
    return config, datasets


def test_a_job_whose_roles_log_in_as_their_own_principals_ends_exact_refusing_forgeries(
    acl_broker: AclBroker, tmp_path: Path
) -> None:
    """``run`` with two dispatcher processes, every part of it (its producer, its own
    dispatcher, the sink, the ledger process, the extra dispatcher) logged in as its
    role's principal under the table's ACLs: a part that used another's login, or an
    ACL missing, would be refused by Kafka and the run would fail. Meanwhile the
    dispatcher's principal tries to write a budget, a grant and a server: Kafka
    refuses each. Graded from the server's own log and the Parquet files."""
    namespace = f"t{uuid.uuid4().hex[:10]}"
    sim = start_simulator(tmp_path, "--tokens-per-second", "20000")
    evil = start_simulator(tmp_path, name="evil")
    run = None
    try:
        config, datasets = job_under_acls(tmp_path, acl_broker, namespace, sim.url)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["acls", "--config", str(config), "--apply"]) == 0
        run = start_run(config, "--dispatchers", "2", log=tmp_path / "run.out")
        topics = Topics(namespace)
        wait_until(
            lambda: bool(read_server_log(sim.log)) or run.poll() is not None, "the first answer"
        )
        forged = {
            topics.budgets: ev.BudgetExceeded(dataset="a", budget=1, used=1, epoch=2**62),
            topics.control: ev.ServerAdded(url=evil.url, api_key_env="TOKENBUDGET_API_KEY"),
        }
        for topic, event in forged.items():
            with pytest.raises(TopicAuthorizationFailedError):
                produce(acl_broker, "dispatcher", topic, codec.encode(event))
        grant = ev.LeaseGranted(
            dataset="a", lease_id="l", holder="h", granted=10**6, expires_at=1e9
        )
        with pytest.raises(TopicAuthorizationFailedError):
            produce(acl_broker, "dispatcher", topics.budgets, codec.encode(grant))
        assert run.wait(300) == 0, (tmp_path / "run.out").read_text()[-3000:]
    finally:
        end_run(run)
        sim.stop()
        evil.stop()
    verdict = oracle.judge(tmp_path / "out", sim.log, datasets)
    assert verdict.ok, "\n".join(verdict.lines())
    assert {n: d.kept_tokens for n, d in verdict.datasets.items()} == {"a": 1500, "b": 1200}
    assert not evil.log.exists() or evil.log.read_text() == ""
    # The drain's snapshot asks went out as the producer, which may write outcomes.
    assert "asking the ledger for snapshots failed" not in (tmp_path / "run.out").read_text()
    # Nothing forged reached the ledger's and the operators' topics.
    announced: list[ev.Event] = []
    read_to_end(acl_broker.door, topics.budgets, announced.append)
    assert not any(isinstance(e, ev.BudgetExceeded) and e.epoch == 2**62 for e in announced)


def test_a_role_refused_by_kafka_ends_the_run_with_one_line_instead_of_waiting(
    acl_broker: AclBroker, tmp_path: Path
) -> None:
    """The ACLs applied for the job, then its dispatcher given the sink's login (a
    config's slip): Kafka refuses it the dispatchers' group, and no attempt can
    change that. The run says so in one line and exits, sending nothing."""
    namespace = f"t{uuid.uuid4().hex[:10]}"
    sim = start_simulator(tmp_path, "--tokens-per-second", "20000")
    run = None
    try:
        config, _ = job_under_acls(tmp_path, acl_broker, namespace, sim.url)
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli.main(["acls", "--config", str(config), "--apply"]) == 0
        own = f'role = "dispatcher"\nsasl_username = "{USERS["dispatcher"]}"\n'
        own += f'sasl_password_env = "{_password_env(USERS["dispatcher"])}"'
        slip = f'role = "dispatcher"\nsasl_username = "{USERS["sink"]}"\n'
        slip += f'sasl_password_env = "{_password_env(USERS["sink"])}"'
        assert own in config.read_text()
        config.write_text(config.read_text().replace(own, slip))
        run = start_run(config, log=tmp_path / "run.out")
        assert run.wait(120) == 2
    finally:
        end_run(run)
        sim.stop()
    lines = (tmp_path / "run.out").read_text().splitlines()
    errors = [line for line in lines if "tokenbudget: error" in line]
    assert len(errors) == 1, errors
    assert "Kafka refused the dispatcher's principal: GroupAuthorizationFailedError" in errors[0]
    assert read_server_log(sim.log) == {}  # nothing was sent


def test_a_wrong_password_of_any_role_stops_run_before_it_starts_naming_its_key(
    acl_broker: AclBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run`` logs in once as every role it will play (its ledger's included) before
    anything starts: the sink's wrong password is one line naming its keys, not a
    sink thread that cannot connect once the job runs."""
    config, _ = job_under_acls(tmp_path, acl_broker, f"t{uuid.uuid4().hex[:10]}", "http://h:1")
    config.write_text(
        config.read_text().replace("[inference]\n", "[inference]\ncheck_server = false\n", 1)
    )
    monkeypatch.setenv(_password_env(USERS["sink"]), "not-the-password")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert cli.main(["run", "--config", str(config)]) == 2
    line = err.getvalue().strip().splitlines()[-1]
    assert f"refused user '{USERS['sink']}'" in line
    index = list(USERS).index("sink")
    assert f"kafka.roles[{index}].sasl_username" in line
    assert f"kafka.roles[{index}].sasl_password_env" in line
