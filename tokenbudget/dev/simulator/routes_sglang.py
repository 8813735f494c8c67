"""SGLang's native API on the simulator (``_SGLangRoutes``): ``/generate``,
``/abort_request``, ``/get_model_info``, its Prometheus ``/metrics`` and ``/health``."""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from tokenbudget.dev.simulator.engine import _Engine, keyed
from tokenbudget.dev.simulator.faults import _Faults
from tokenbudget.dev.simulator.request import _BadRequest, _count, _int_field, _Job, _Parsed
from tokenbudget.dev.simulator.wire import _decode, _encode, _error, _json

# SGLang's SamplingParams default.
_SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
# SGLang reports the EOS id that stopped generation as finish_reason.matched.
_EOS_TOKEN_ID = 2


class _SGLangRoutes:
    """SGLang's native API: ``/generate``, ``/abort_request``, ``/get_model_info`` and
    its Prometheus ``/metrics``; and ``/health`` (``/health_generate``), which vLLM
    answers at the same path."""

    def __init__(self, engine: _Engine, faults: _Faults) -> None:
        self.engine = engine
        self.faults = faults
        self.config = engine.config

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/generate", self.handle_generate),
            # Behind the key as generation is (SGLang's --api-key guards every route but
            # the health checks): an abort stops someone's answer, the info names the model.
            web.post("/abort_request", keyed(self.engine, self.handle_abort)),
            web.get("/health", self.handle_health),
            web.get("/health_generate", self.handle_health),
            web.get("/get_model_info", keyed(self.engine, self.handle_model_info)),
            web.get("/metrics", self.handle_metrics),
        ]

    def _parse(self, p: dict[str, Any], request: web.Request) -> _Parsed:
        text, input_ids = p.get("text"), p.get("input_ids")
        if (text is None) == (input_ids is None):
            raise _BadRequest("Either text or input_ids should be provided.")
        if isinstance(text, list) or (
            isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)
        ):
            raise _BadRequest("batch requests are not supported by the simulator")
        sp = p.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise _BadRequest("sampling_params must be an object")
        max_new = _int_field(sp, "max_new_tokens", _SGLANG_DEFAULT_MAX_NEW_TOKENS)
        if max_new < 0:
            raise _BadRequest(f"max_new_tokens must be at least 0, got {max_new}.")
        rid = p.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise _BadRequest("rid must be a string")
        text, prompt_ids = self.engine.prompt(text, input_ids)
        return _Parsed(
            rid=rid or uuid.uuid4().hex,
            text=text,
            prompt_ids=prompt_ids,
            prompt_tokens=len(prompt_ids) if prompt_ids is not None else _count(text),
            max_new_tokens=max_new,
            stream=bool(p.get("stream", False)),
        )

    async def handle_generate(self, request: web.Request) -> web.StreamResponse:
        return await self.engine.run(request, "sglang", self._parse, self._respond)

    async def _respond(
        self, request: web.Request, job: _Job, parsed: _Parsed, received_at: float
    ) -> web.StreamResponse:
        def body(produced: int, finish: str | None, start: int = 0) -> dict[str, Any]:
            return {
                "text": job.output.text(start, produced),
                "output_ids": job.output.ids[start:produced],
                "meta_info": {
                    "id": job.rid,
                    "finish_reason": _sglang_finish(job, finish, produced),
                    "prompt_tokens": job.prompt_tokens,
                    "completion_tokens": produced,
                    "cached_tokens": 0,
                    "e2e_latency": time.time() - received_at,
                },
            }

        if not parsed.stream:
            await job.done.wait()
            return _json(body(job.produced, job.finish))

        def render(sent: int, produced: int, finish: str | None) -> list[bytes]:
            start = sent if self.config.incremental_streaming else 0
            return [b"data: " + _encode(body(produced, finish, start)) + b"\n\n"]

        return await self.engine.stream(request, job, render, [b"data: [DONE]\n\n"])

    async def handle_abort(self, request: web.Request) -> web.Response:
        try:
            payload = _decode(await request.read() or b"{}")
        except msgspec.DecodeError:
            return _error("sglang", 400, "request body is not valid JSON")
        if not isinstance(payload, dict):
            return _error("sglang", 400, "request body must be a JSON object")
        if payload.get("abort_all"):
            for job in list(self.engine.jobs.values()):
                self.engine.abort(job)
        else:
            rid = payload.get("rid")
            target = self.engine.jobs.get(rid) if isinstance(rid, str) else None
            if target is not None:
                self.engine.abort(target)
        return web.Response(status=200)

    async def handle_health(self, request: web.Request) -> web.Response:
        if self.faults.out():
            return web.Response(status=503)
        return web.Response(status=200)

    async def handle_model_info(self, request: web.Request) -> web.Response:
        info: dict[str, Any] = {"model_path": self.config.model, "is_generation": True}
        if self.config.tokenizer:  # as SGLang names the tokenizer it loaded
            info["tokenizer_path"] = self.config.tokenizer
        return _json(info)

    async def handle_metrics(self, request: web.Request) -> web.Response:
        label = '{model_name="' + _prom_escape(self.config.model) + '"}'
        c = self.engine.counters
        series = [
            ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
             c.prompt_tokens),
            ("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.",
             c.generation_tokens),
            ("sglang:num_requests_total", "counter", "Number of requests processed.", c.requests),
            ("sglang:num_aborted_requests_total", "counter", "Number of requests aborted.",
             c.aborted),
            ("sglang:num_running_reqs", "gauge", "The number of running requests.",
             len(self.engine.jobs)),
            ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", 0),
        ]  # fmt: skip
        lines: list[str] = []
        for name, kind, help_text, value in series:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.append(f"{name}{label} {float(value)}")
        return web.Response(
            text="\n".join(lines) + "\n",
            content_type="text/plain",
            charset="utf-8",
            headers={"X-Prometheus-Format": "0.0.4"},
        )


def _sglang_finish(job: _Job, finish: str | None, produced: int) -> dict[str, Any] | None:
    if finish is None:
        return None
    if finish == "stop":
        return {"type": "stop", "matched": _EOS_TOKEN_ID}
    if finish == "length":
        return {"type": "length", "length": produced}
    return {"type": "abort", "message": f"Abort request {job.rid}"}


def _prom_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
