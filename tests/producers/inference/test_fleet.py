"""A dispatcher driving a fleet of servers (producers/inference/fleet.py and the route step),
without a broker: the harness of ``test_dispatcher_caps`` with several scripted
servers. Requests spread by outstanding work; a conversation returns to its server;
a server that stops taking connections has its requests in flight moved to the
others (their reservations with them, each prompt kept once); one away past the
outage timeout is dropped and the job goes on, until none is left; a drained server
finishes what it has; one added at run time joins once it answers; the
dispatcher's places follow what the fleet can take."""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any

import msgspec
import pytest
from aiohttp import web

from tests.producers.dispatch.test_admission import DS, run, until
from tests.producers.dispatch.test_dispatcher_caps import (
    NO_BACKOFF,
    ScriptedBackend,
    make_dispatcher,
    prompt,
    serve,
)
from tokenbudget.core import config as config_module
from tokenbudget.core.config import Server as ServerSpec
from tokenbudget.core.config import build
from tokenbudget.core.errors import (
    InferenceTransportError,
    InferenceUnavailableError,
    ServerOutageError,
)
from tokenbudget.producers.inference.fleet import Fleet, say_key_in_clear
from tokenbudget.producers.inference.http import Timeouts
from tokenbudget.producers.inference.server import Server
from tokenbudget.producers.inference.server_gate import GateSettings
from tokenbudget.streams import events as ev

QUICK = GateSettings(pause_after=1, health_interval_s=0.01)


def on(backend: ScriptedBackend) -> list[str]:
    """The prompts at ``backend`` now (their texts: q0, q1, ...)."""
    return [c.request.text or "" for c in backend.calls.values() if not c.answer.done()]


def test_requests_spread_by_outstanding_work() -> None:
    async def main() -> None:
        dispatcher, _, _, _, recorder = make_dispatcher(stream=False)
        a, b = ScriptedBackend("http://a"), ScriptedBackend("http://b")
        serve(dispatcher, a, b)
        tasks = [asyncio.create_task(dispatcher.tries.dispatch(prompt(i))) for i in range(4)]
        await until(lambda: len(a.calls) + len(b.calls) == 4, "four requests out")
        assert len(a.calls) == len(b.calls) == 2
        for backend in (a, b):
            for rid in list(backend.calls):
                backend.finish(rid, 10)
        await asyncio.gather(*tasks)
        assert len(recorder.completions()) == 4

    run(main())


def test_the_turns_of_a_conversation_go_back_to_the_server_of_the_previous_turn() -> None:
    async def main() -> None:
        dispatcher, _, _, _, recorder = make_dispatcher(stream=False)
        a, b = ScriptedBackend("http://a"), ScriptedBackend("http://b")
        fleet = serve(dispatcher, a, b)
        turn = msgspec.structs.replace(prompt(0), conversation_id="c1")
        first = asyncio.create_task(dispatcher.tries.dispatch(turn))
        await until(lambda: len(a.calls) + len(b.calls) == 1, "the first turn out")
        answered, other = (a, b) if a.calls else (b, a)
        answered.finish(answered.rid_of(0), 10)
        await first
        # As if it had long requests in flight: any other prompt goes elsewhere...
        fleet.servers[answered.base_url].outstanding += 100_000
        plain = asyncio.create_task(dispatcher.tries.dispatch(prompt(1)))
        await until(lambda: on(other) == ["q1"], "a plain prompt at the other server")
        # ... but the conversation's next turn goes back to it.
        later = msgspec.structs.replace(prompt(2), conversation_id="c1")
        second = asyncio.create_task(dispatcher.tries.dispatch(later))
        await until(lambda: on(answered) == ["q2"], "the next turn at the same server")
        fleet.servers[answered.base_url].outstanding -= 100_000
        other.finish(other.rid_of(0), 10)
        answered.finish(answered.rid_of(1), 10)
        await asyncio.gather(plain, second)
        assert len(recorder.completions()) == 3

    run(main())


def test_a_server_gone_away_has_its_requests_moved_and_each_prompt_kept_once() -> None:
    async def main() -> None:
        dispatcher, _, _, _, recorder = make_dispatcher(stream=False)
        a, b = ScriptedBackend("http://a"), ScriptedBackend("http://b")
        fleet = serve(dispatcher, a, b, gate=QUICK)
        b.healthy = False
        fleet.servers["http://b"].gate.down(InferenceTransportError("not up yet"))
        tasks = [asyncio.create_task(dispatcher.tries.dispatch(prompt(i))) for i in range(2)]
        await until(lambda: len(a.calls) == 2, "both requests at a (b is paused)")
        b.healthy = True
        await until(lambda: fleet.servers["http://b"].state == "up", "b back")
        a.healthy = False
        # a stops taking connections: one request breaks, the other hangs there.
        a.calls[a.rid_of(1)].answer.set_exception(InferenceTransportError("reset"))
        await until(lambda: len(b.calls) == 2, "both prompts sent to b")
        assert fleet.servers["http://a"].state == "paused"
        assert a.calls[a.rid_of(0)].answer.cancelled()  # given up, not waited for
        for rid in list(b.calls):
            b.finish(rid, 30)
        await asyncio.gather(*tasks)
        completions = recorder.completions()
        assert sorted(c.prompt_id for c in completions) == ["p0", "p1"]
        assert {c.request_id for c in completions} == set(b.calls)  # b's answers only
        lease = dispatcher.admission._leases[DS]  # type: ignore[union-attr]
        assert lease.in_flight == 0 and lease.spent == 60  # the moved ones' budget came back
        assert fleet.servers["http://a"].in_flight == 0

    run(main())


def test_a_server_away_past_the_timeout_is_dropped_once_and_the_rest_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> None:
        dispatcher, _, _, _, recorder = make_dispatcher(stream=False)
        a, b = ScriptedBackend("http://a"), ScriptedBackend("http://b")
        gate = GateSettings(pause_after=1, health_interval_s=0.01, outage_timeout_s=0.05)
        fleet = serve(dispatcher, a, b, gate=gate)
        a.healthy = False
        fleet.servers["http://a"].gate.down(InferenceTransportError("refused"))
        await until(lambda: fleet.servers["http://a"].state == "dropped", "a dropped")
        task = asyncio.create_task(dispatcher.tries.dispatch(prompt(0)))
        await until(lambda: len(b.calls) == 1, "the prompt at b")
        b.finish(b.rid_of(0), 10)
        await task
        assert len(recorder.completions()) == 1 and fleet.outage is None
        # Then b goes too: nothing is left, and dispatch ends naming both.
        b.healthy = False
        fleet.servers["http://b"].gate.down(InferenceTransportError("refused"))
        with pytest.raises(ServerOutageError) as info:
            await dispatcher.tries.dispatch(prompt(1))
        assert "every inference server" in str(info.value)
        assert "http://a" in str(info.value) and "http://b" in str(info.value)

    with caplog.at_level(logging.WARNING, logger="tokenbudget.producers.inference.fleet"):
        run(main())
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1 and dropped[0].startswith("the inference server http://a")


def test_a_drained_server_gets_nothing_new_and_finishes_what_it_has() -> None:
    async def main() -> None:
        dispatcher, _, _, _, recorder = make_dispatcher(stream=False)
        a, b = ScriptedBackend("http://a"), ScriptedBackend("http://b")
        fleet = serve(dispatcher, a, b)
        first = asyncio.create_task(dispatcher.tries.dispatch(prompt(0)))
        await until(lambda: len(a.calls) + len(b.calls) == 1, "the first request")
        drained, other = (a, b) if a.calls else (b, a)
        fleet.apply(ev.ServerDrained(url=drained.base_url))
        assert fleet.servers[drained.base_url].state == "draining"
        rest = [asyncio.create_task(dispatcher.tries.dispatch(prompt(i))) for i in (1, 2)]
        await until(lambda: len(other.calls) == 2, "the next ones at the other server")
        assert len(drained.calls) == 1
        drained.finish(drained.rid_of(0), 10)
        await first
        assert fleet.servers[drained.base_url].state == "drained"
        for rid in list(other.calls):
            other.finish(rid, 10)
        await asyncio.gather(*rest)
        assert len(recorder.completions()) == 3

    run(main())


def test_a_server_added_at_run_time_joins_once_it_answers_its_health_check() -> None:
    async def main() -> None:
        added: list[ScriptedBackend] = []

        def open_server(spec: ServerSpec) -> Server:
            backend = ScriptedBackend(spec.url)
            added.append(backend)
            return Server(spec, backend, QUICK, backoff=NO_BACKOFF)

        fleet = Fleet(open_server=open_server)
        fleet.config = build({"inference": {"concurrency": 4}}, environ={})
        capacities: list[int] = []
        fleet.on_capacity = capacities.append
        fleet.apply(ev.ServerAdded(url="http://a"))  # [inference]'s concurrency: 4
        fleet.apply(ev.ServerAdded(url="http://c", concurrency=16))
        assert [b.base_url for b in added] == ["http://a", "http://c"]
        server = fleet.servers["http://c"]
        assert server.state == "paused" and server.spec.concurrency == 16  # probed first
        await until(lambda: fleet.capacity() == 4 + 16, "both up")
        assert capacities[-1] == 20
        # Added again with another concurrency, its window follows; drained, it leaves.
        fleet.apply(ev.ServerAdded(url="http://c", concurrency=2))
        assert server.window.size == 2 and capacities[-1] == 4 + 2
        fleet.apply(ev.ServerDrained(url="http://a"))
        assert fleet.servers["http://a"].state == "drained" and capacities[-1] == 2
        await fleet.close()

    run(main())


def test_the_dispatchers_places_follow_what_the_fleet_can_take() -> None:
    async def main() -> None:
        dispatcher, _, _, _, _ = make_dispatcher(stream=False)
        a, b = ScriptedBackend("http://a"), ScriptedBackend("http://b")
        fleet = Fleet()
        for backend, concurrency in ((a, 4), (b, 5)):
            spec = ServerSpec(url=backend.base_url, concurrency=concurrency, api_key_env="")
            fleet._join(Server(spec, backend, GateSettings(), backoff=NO_BACKOFF))
        dispatcher.compose(dispatcher.publisher.producer, dispatcher.admission, fleet)
        places = dispatcher.places._server  # type: ignore[attr-defined]
        assert places.places == 9
        b.healthy = False
        fleet.servers["http://b"].gate.down(InferenceTransportError("refused"))
        assert places.places == 4  # b is away
        busy = InferenceUnavailableError("HTTP 429", busy=True)
        fleet.servers["http://a"].failed(busy)
        assert places.places == 2  # a said it is busy: its window halved
        await fleet.close()

    run(main())


def test_each_server_s_client_reads_replies_within_the_config_s_limits() -> None:
    config = config_module.build(
        {
            "inference": {
                "servers": [{"url": "http://a:1"}, {"url": "http://b:1"}],
                "read_timeout_s": 9.0,
                "min_tokens_per_s": 7.5,
                "max_reply_bytes": 12_345,
            }
        },
        environ={},
    )
    fleet = Fleet.for_config(config)
    clients = [server.client for server in fleet.servers.values()]
    assert [(c.timeouts, c.max_reply_bytes) for c in clients if c is not None] == [
        (Timeouts(connect=5.0, read=9.0, min_tokens_per_s=7.5), 12_345)
    ] * 2


# ---- servers added at run time: which the config takes, and what key they get --------


class KeyLog:
    """Fake servers that answer every request and keep the Authorization header of
    each, per server: what each server received is the ground truth."""

    def __init__(self) -> None:
        self.received: dict[str, list[str | None]] = {}
        self._runners: list[web.AppRunner] = []

    async def start(self, count: int) -> list[str]:
        urls = []
        for _ in range(count):
            app = web.Application()
            runner = web.AppRunner(app, access_log=None)
            app.router.add_route("*", "/{tail:.*}", self._handler)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            urls.append(f"http://127.0.0.1:{port}")
            self.received[urls[-1]] = []
            self._runners.append(runner)
        return urls

    async def _handler(self, request: web.Request) -> web.Response:
        self.received[f"http://{request.host}"].append(request.headers.get("Authorization"))
        return web.json_response({})

    async def stop(self) -> None:
        for runner in self._runners:
            await runner.cleanup()


class ReadEnviron(dict[str, str]):
    """The environment, noting every variable read by name."""

    def __init__(self, values: dict[str, str]) -> None:
        super().__init__(values)
        self.read: list[str] = []

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.read.append(key)
        return super().get(key, default)

    def __getitem__(self, key: str) -> str:
        self.read.append(key)
        return super().__getitem__(key)


def test_a_server_added_at_run_time_gets_no_key_unless_its_change_names_one_the_config_names(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    environ = ReadEnviron(
        {"TOKENBUDGET_API_KEY": "main-key", "GPU_KEY": "gpu-key", "OTHER_SECRET": "other"}
    )
    monkeypatch.setattr(os, "environ", environ)
    servers = KeyLog()

    async def main() -> list[str]:
        configured, plain, keyed, other = await servers.start(4)
        config = build(
            {"inference": {"url": configured, "added_server_keys": ["GPU_KEY"]}}, environ={}
        )
        fleet = Fleet.for_config(config)
        fleet.apply(ev.ServerAdded(url=plain, by="tokenbudget servers add"))
        fleet.apply(ev.ServerAdded(url=keyed, api_key_env="GPU_KEY"))
        fleet.apply(ev.ServerAdded(url=other, api_key_env="OTHER_SECRET", by="forged"))
        assert list(fleet.servers) == [configured, plain, keyed]  # the refused one is not
        for server in fleet.servers.values():
            await server.backend.health()
        await fleet.close()
        await servers.stop()
        return [configured, plain, keyed, other]

    with caplog.at_level(logging.WARNING, logger="tokenbudget.producers.inference.fleet"):
        configured, plain, keyed, other = run(main())
    assert servers.received == {
        configured: ["Bearer main-key"],  # a configured server: [inference]'s key
        plain: [None],  # added without a key variable: none, not [inference]'s
        keyed: ["Bearer gpu-key"],
        other: [],
    }
    assert "OTHER_SECRET" not in environ.read  # named by an event, never read
    (refused,) = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert "(forged)" in refused and other in refused and "$OTHER_SECRET" in refused
    assert "'inference.added_server_keys'" in refused


def test_an_added_server_outside_the_configs_prefixes_is_refused_and_the_fleet_stays() -> None:
    config = build(
        {
            "inference": {
                "servers": [{"url": "http://a:1"}, {"url": "http://b:1"}],
                "added_servers": ["https://gpu-"],
            }
        },
        environ={},
    )

    async def main() -> None:
        fleet = Fleet.for_config(config)
        fleet.apply(ev.ServerAdded(url="https://cpu-1:30000"))  # outside: refused
        fleet.apply(ev.ServerAdded(url="http://gpu-1:30000"))  # not https: refused
        assert list(fleet.servers) == ["http://a:1", "http://b:1"]
        fleet.apply(ev.ServerAdded(url="https://gpu-1:30000", concurrency=2))  # inside
        assert fleet.servers["https://gpu-1:30000"].spec.concurrency == 2
        fleet.apply(ev.ServerDrained(url="http://b:1"))
        assert fleet.servers["http://b:1"].draining
        fleet.apply(ev.ServerAdded(url="http://b:1"))  # a configured one comes back
        assert not fleet.servers["http://b:1"].draining
        assert list(fleet.servers) == ["http://a:1", "http://b:1", "https://gpu-1:30000"]
        await fleet.close()

    run(main())


def test_a_key_sent_over_plain_http_off_this_machine_is_warned_once_per_server(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TOKENBUDGET_API_KEY", "main-key")
    urls = ["http://gpu-a:1", "http://127.0.0.1:2", "http://localhost:3", "https://gpu-c:4"]
    config = build({"inference": {"servers": [{"url": u} for u in urls]}}, environ={})

    async def main() -> None:
        fleet = Fleet.for_config(config)
        fleet.apply(ev.ServerAdded(url="http://gpu-b:5"))  # no key: nothing to warn about
        fleet.apply(ev.ServerAdded(url="http://gpu-d:6", api_key_env="TOKENBUDGET_API_KEY"))
        say_key_in_clear(fleet.servers["http://gpu-d:6"].spec, fleet.warned)  # said already
        await fleet.close()

    with caplog.at_level(logging.WARNING, logger="tokenbudget.producers.inference.fleet"):
        run(main())
    warned = [r.getMessage() for r in caplog.records if "plain http" in r.getMessage()]
    assert [line.split()[3] for line in warned] == ["http://gpu-a:1", "http://gpu-d:6"]
    assert all("use https://" in line and "SSH tunnel" in line for line in warned)
