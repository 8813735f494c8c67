"""The simulator's parts composed on one aiohttp application (``_SimServer``) and its
entry points: :func:`start` in the running event loop (a :class:`RunningSimulator`),
:func:`serve` until a signal (the ``tokenbudget simulate`` command)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Mapping

from aiohttp import web

from tokenbudget.core import tasks
from tokenbudget.core.errors import ConfigError
from tokenbudget.dev.simulator.config import RequestRecord, SimulatorConfig, _validate
from tokenbudget.dev.simulator.engine import _Engine, keyed
from tokenbudget.dev.simulator.faults import _Faults
from tokenbudget.dev.simulator.log import _RequestLog
from tokenbudget.dev.simulator.routes_openai import _OpenAIRoutes
from tokenbudget.dev.simulator.routes_sglang import _SGLangRoutes

_log = logging.getLogger(__name__)

_SHUTDOWN_TIMEOUT = 2.0


# The routes that serve each API (tokenbudget.core.apis.API_TRAITS, which this covers):
# SGLang's own, and the OpenAI-compatible ones its server and vLLM's share.
ROUTES: Mapping[str, type[_SGLangRoutes | _OpenAIRoutes]] = {
    "sglang": _SGLangRoutes,
    "openai-completions": _OpenAIRoutes,
    "openai-chat": _OpenAIRoutes,
}


class _SimServer:
    """The simulator's parts, composed: the request log, the faults, the generation
    engine and the routes of each API, on one aiohttp application."""

    def __init__(self, config: SimulatorConfig) -> None:
        self.config = config
        self.stopping = asyncio.Event()
        self.log = _RequestLog(config.log_file)
        self.faults = _Faults(config, self.log, self.stopping)
        self.engine = _Engine(config, self.log, self.faults, self.stopping)
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.add_routes(
            [
                *(
                    route
                    for routes in dict.fromkeys(ROUTES.values())
                    for route in routes(self.engine, self.faults).routes()
                ),
                web.get("/sim/log", keyed(self.engine, self.log.handle_log)),
                web.post("/sim/outage", keyed(self.engine, self.faults.handle_outage)),
            ]
        )

    async def shutdown(self) -> None:
        await self.engine.shutdown()
        self.log.close()


class RunningSimulator:
    """A simulator listening in the current event loop; ``await stop()`` to shut it down."""

    def __init__(self, server: _SimServer, runner: web.AppRunner, host: str, port: int) -> None:
        self._server = server
        self._runner = runner
        self.port = port
        url_host = f"[{host}]" if ":" in host else host
        self.url = f"http://{url_host}:{port}"
        self.log: list[RequestRecord] = server.log.records

    async def stop(self) -> None:
        await self._server.shutdown()
        await self._runner.cleanup()

    async def __aenter__(self) -> RunningSimulator:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


async def start(config: SimulatorConfig) -> RunningSimulator:
    """Start a simulator in the running event loop; ``port=0`` picks a free port."""
    _validate(config)
    server = _SimServer(config)
    # No access log: at hundreds of requests per second it would drown everything else.
    runner = web.AppRunner(
        server.app, access_log=None, handle_signals=False, shutdown_timeout=_SHUTDOWN_TIMEOUT
    )
    await runner.setup()
    # aiohttp's default backlog of 128 makes a burst of hundreds of client connections hit
    # SYN retransmits (1 s, 3 s, ...); uvicorn under SGLang/vLLM listens with 2048.
    site = web.TCPSite(runner, config.host, config.port, backlog=2048)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise ConfigError(
            "simulator.port", f"cannot listen on {config.host}:{config.port}: {exc}"
        ) from exc
    port = int(runner.addresses[0][1])
    return RunningSimulator(server, runner, config.host, port)


def serve(config: SimulatorConfig) -> None:
    """Run a simulator until SIGINT or SIGTERM (the ``tokenbudget simulate`` command)."""
    tasks.run(_serve_until_signalled(config))


async def _serve_until_signalled(config: SimulatorConfig) -> None:
    sim = await start(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed: list[signal.Signals] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    print(
        f"tokenbudget simulator on {sim.url} (profile {config.profile}, "
        f"{config.tokens_per_second:g} tok/s per request, model {config.model})",
        file=sys.stderr,
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        await sim.stop()
        _log.info("simulator on %s stopped after %d requests", sim.url, len(sim.log))
