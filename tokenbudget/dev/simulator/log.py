"""The simulator's request log: its own account of every request it answered."""

from __future__ import annotations

from aiohttp import web

from tokenbudget.dev.simulator.config import RequestRecord
from tokenbudget.dev.simulator.wire import _encode


class _RequestLog:
    """The simulator's account of every request, one :class:`RequestRecord` each: kept
    in memory (``GET /sim/log``, :attr:`RunningSimulator.log`) and appended to
    ``log_file``, one JSON line each, when given (kept across restarts)."""

    def __init__(self, log_file: str | None) -> None:
        self.records: list[RequestRecord] = []
        self._file = open(log_file, "ab") if log_file else None  # noqa: SIM115

    def record(self, record: RequestRecord) -> None:
        self.records.append(record)
        if self._file is not None:
            self._file.write(_encode(record) + b"\n")
            self._file.flush()

    async def handle_log(self, request: web.Request) -> web.Response:
        return web.Response(body=_encode(self.records), content_type="application/json")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
