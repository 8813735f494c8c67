"""Each role wired from its config in one place: the producer, a dispatcher and the
sink get the config's job, the board they are given and, in ``run``, their own
role's Kafka login (a standalone command's process plays its role itself); the
standalone commands' signals stop them as documented. The parts are faked: what
is checked is how they are built and started, and whose login their clients use."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.tokenbudget.app.commands.job import write_job
from tokenbudget.app import assembly
from tokenbudget.app.supervision import SinkThread
from tokenbudget.core import config as config_module
from tokenbudget.core import roles, security
from tokenbudget.core.config import Config
from tokenbudget.core.roles import Role
from tokenbudget.streams.budget_board import BudgetBoard

BOOTSTRAP = "assembly-test:9092"
USERS: dict[str, str] = {"producer": "tb-producer", "dispatcher": "tb-dispatch", "sink": "tb-sink"}


def username() -> str:
    """Whom a client built here and now logs in as."""
    return str(security.client_options(BOOTSTRAP)["sasl_plain_username"])


@pytest.fixture(autouse=True)
def logins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A cluster where the producer, the dispatcher and the sink log in as their own
    users, and everything else (here: the operator this process plays) as ``admin``."""
    monkeypatch.setenv("ASSEMBLY_TEST_PASSWORD", "secret")
    password = security.SecretSource(key="kafka.sasl_password_env", env="ASSEMBLY_TEST_PASSWORD")
    cluster = security.KafkaSecurity(
        protocol="SASL_PLAINTEXT",
        sasl_mechanism="PLAIN",
        sasl_username="admin",
        sasl_password=password,
        logins={role: security.Login(username=u, password=password) for role, u in USERS.items()},
    )
    monkeypatch.setitem(security._REGISTRY, BOOTSTRAP, cluster)
    played = roles.play("operator")
    yield
    roles.play(played)


@pytest.fixture
def config(tmp_path: Path) -> Config:
    return config_module.load(str(write_job(tmp_path, namespace="ns")))


class FakeProducer:
    def __init__(self, config: Config, bootstrap: str, board: BudgetBoard, **wiring: Any) -> None:
        self.config, self.bootstrap, self.board, self.wiring = config, bootstrap, board, wiring
        self.built_as = username()

    async def run(
        self, stop: asyncio.Event | None, interrupt: asyncio.Event | None
    ) -> dict[str, Any]:
        self.ran_as = username()
        self.stop, self.interrupt = stop, interrupt
        assert interrupt is not None
        await interrupt.wait()
        return {}


class FakeDispatcher:
    def __init__(self, config: Config, bootstrap: str, board: BudgetBoard, **options: Any) -> None:
        self.config, self.bootstrap, self.board, self.options = config, bootstrap, board, options
        self.handed_back = False

    def hand_back(self) -> None:
        self.handed_back = True

    async def run(self, stop: asyncio.Event) -> str:
        self.ran_as = username()
        await stop.wait()
        return "report"


@pytest.fixture(autouse=True)
def fakes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(assembly, "PromptProducer", FakeProducer)
    monkeypatch.setattr(assembly, "Dispatcher", FakeDispatcher)


def test_runs_producer_logs_in_as_the_producer_and_holds_halted_datasets(config: Config) -> None:
    async def main() -> None:
        board = BudgetBoard()
        producing = assembly.start_producer(
            config, BOOTSTRAP, board, login="producer", hold_halted=True
        )
        await asyncio.sleep(0)
        producer = producing.producer
        assert isinstance(producer, FakeProducer)
        assert (producer.built_as, producer.ran_as) == ("tb-producer", "tb-producer")
        assert producer.board is board and producer.config is config
        assert producer.stop is producing.stop is not None  # run sets it once drained
        assert username() == "admin"  # the caller's own login is left as it was
        await producing.end()
        assert producing.task.done() and producing.interrupt.is_set()

    asyncio.run(main())


def test_the_standalone_producer_logs_in_as_its_process_and_ends_at_halted_datasets(
    config: Config,
) -> None:
    async def main() -> None:
        roles.play("producer")  # as `tokenbudget produce` does
        interrupt = asyncio.Event()  # the command's signal handlers set it
        producing = assembly.start_producer(config, BOOTSTRAP, BudgetBoard(), interrupt=interrupt)
        interrupt.set()
        assert await producing.task == {}
        producer = producing.producer
        assert isinstance(producer, FakeProducer)
        assert producer.ran_as == "tb-producer"
        assert producer.stop is None and producer.interrupt is interrupt

    asyncio.run(main())


def test_the_producer_skips_what_the_sink_stored_and_resumes_from_the_kept_completions(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept: list[tuple[str, str, frozenset[str]]] = []

    def kept_completions(bootstrap: str, topics: Any, datasets: frozenset[str]) -> dict[str, Any]:
        kept.append((bootstrap, topics.namespace, datasets))
        return {}

    monkeypatch.setattr(assembly, "kept_completions", kept_completions)
    (config.sink_path / "dataset=a").mkdir(parents=True)

    async def main() -> None:
        producing = assembly.start_producer(config, BOOTSTRAP, BudgetBoard())
        producer = producing.producer
        assert isinstance(producer, FakeProducer)
        stored: Callable[[], set[str]] = producer.wiring["stored_prompt_ids"]
        assert stored() == set()  # read from the config's sink folder
        producer.wiring["kept_completions"](frozenset({"a"}))
        await producing.end()

    asyncio.run(main())
    assert kept == [(BOOTSTRAP, "ns", frozenset({"a"}))]


def start_dispatcher(config: Config, **options: Any) -> assembly.Dispatching:
    return assembly.start_dispatcher(config, BOOTSTRAP, BudgetBoard(), **options)


def test_runs_dispatcher_logs_in_as_the_dispatcher_under_its_instance(config: Config) -> None:
    async def main() -> None:
        dispatching = start_dispatcher(
            config, instance="ns-dispatch-0", keep_log=True, login="dispatcher"
        )
        await asyncio.sleep(0)
        dispatcher = dispatching.dispatcher
        assert isinstance(dispatcher, FakeDispatcher)
        assert dispatcher.ran_as == "tb-dispatch"
        assert dispatcher.options == {"keep_log": True, "instance": "ns-dispatch-0"}
        await dispatching.finish()
        assert dispatching.task.result() == "report" and not dispatcher.handed_back

    asyncio.run(main())


def test_a_dispatcher_stopped_by_an_interrupted_run_hands_its_requests_back(
    config: Config,
) -> None:
    async def main() -> None:
        dispatching = start_dispatcher(config, login="dispatcher")
        await dispatching.finish(hand_back=True)
        dispatcher = dispatching.dispatcher
        assert isinstance(dispatcher, FakeDispatcher)
        assert dispatcher.handed_back and dispatching.task.done()

    asyncio.run(main())


def test_a_dispatcher_that_failed_is_left_for_the_supervisor_to_report(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Broken(FakeDispatcher):
        async def run(self, stop: asyncio.Event) -> str:
            raise RuntimeError("a poison record")

    monkeypatch.setattr(assembly, "Dispatcher", Broken)

    async def main() -> None:
        dispatching = start_dispatcher(config)
        await dispatching.finish()  # does not raise: supervise() said so already
        assert isinstance(dispatching.task.exception(), RuntimeError)

    asyncio.run(main())


@pytest.mark.parametrize("signals", [False, True])
def test_the_standalone_dispatchers_signals_finish_on_sigterm_and_hand_back_on_sigint(
    config: Config, monkeypatch: pytest.MonkeyPatch, signals: bool
) -> None:
    async def main() -> None:
        handlers: dict[int, Callable[[], object]] = {}
        loop = asyncio.get_running_loop()
        monkeypatch.setattr(loop, "add_signal_handler", lambda s, h: handlers.update({s: h}))
        roles.play("dispatcher")  # as `tokenbudget dispatch` does
        dispatching = start_dispatcher(config, instance=None, signals=signals)
        dispatcher = dispatching.dispatcher
        assert isinstance(dispatcher, FakeDispatcher)
        assert dispatcher.options == {"keep_log": False, "instance": None}
        if not signals:  # run's: run installs its own
            assert handlers == {}
            await dispatching.finish()
            return
        assert set(handlers) == {signal.SIGTERM, signal.SIGINT}
        handlers[signal.SIGTERM]()
        assert dispatching.stop.is_set() and not dispatcher.handed_back
        handlers[signal.SIGINT]()
        assert dispatcher.handed_back
        assert await dispatching.task == "report"
        assert dispatcher.ran_as == "tb-dispatch"

    asyncio.run(main())


class FakeSink:
    def __init__(self, bootstrap: str, topics: Any, settings: Any) -> None:
        self.bootstrap, self.topics, self.settings = bootstrap, topics, settings

    def run(self, stop: threading.Event) -> None:
        self.ran_as = username()
        stop.wait(10)

    def where(self) -> str:
        return "nowhere"


def test_the_sink_is_the_configs_and_logs_in_as_whoever_runs_it(
    config: Config, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(assembly, "ParquetSink", FakeSink)
    sink = assembly.build_sink(config, BOOTSTRAP)
    assert isinstance(sink, FakeSink)
    assert (sink.bootstrap, sink.topics.namespace, sink.topics.sink_group) == (
        BOOTSTRAP,
        "ns",
        "ns-sink",
    )
    assert sink.settings.path == config.sink_path
    threads: dict[Role | None, str] = {}
    for login in ("sink", None):
        running = SinkThread(sink, login=login)
        running.finish()
        threads[login] = sink.ran_as
    # run's thread as the sink; without a login, as the process plays (here: operator)
    assert threads == {"sink": "tb-sink", None: "admin"}


def test_logged_in_as_none_leaves_the_role_being_played() -> None:
    with assembly.logged_in_as(None):
        assert roles.current_role() == "operator"
        with assembly.logged_in_as("sink"):
            assert roles.current_role() == "sink" and username() == "tb-sink"
        assert username() == "admin"


class FakeWatcher:
    def __init__(self, bootstrap: str, topics: Any, *, fleet_reports: bool) -> None:
        self.bootstrap, self.topics, self.fleet_reports = bootstrap, topics, fleet_reports
        self.board = BudgetBoard()
        self.events: list[str] = []

    async def start(self) -> None:
        self.events.append("start")

    async def run(self) -> None:
        self.events.append("run")
        await asyncio.sleep(60)

    async def stop(self) -> None:
        self.events.append("stop")


def test_the_watcher_runs_until_stopped(monkeypatch: pytest.MonkeyPatch, config: Config) -> None:
    monkeypatch.setattr(assembly, "BudgetWatcher", FakeWatcher)

    async def main() -> None:
        topics = assembly.Topics("ns")
        watching = await assembly.start_watcher(BOOTSTRAP, topics, fleet_reports=True)
        watcher = watching.watcher
        assert isinstance(watcher, FakeWatcher) and watcher.fleet_reports
        assert watching.board is watcher.board
        await asyncio.sleep(0)
        await watching.stop()
        assert watching.task.cancelled()
        assert watcher.events == ["start", "run", "stop"]

    asyncio.run(main())
