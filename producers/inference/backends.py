"""The inference backends, by API, and the servers checked before a job sends them work.

    InferenceBackend            generate / abort / health   (generation.py)
    ├── SGLangBackend           POST /generate (text or input_ids), /abort_request
    │                                                       (sglang.py)
    ├── OpenAICompletionsBackend  POST /v1/completions      (openai.py)
    └── OpenAIChatBackend       POST /v1/chat/completions   (openai.py)

What an API can do beyond its wire format (abort by id, its health route, chat
or raw text, where its reasoning comes) is its row of
:data:`tokenbudget.core.apis.API_TRAITS`, which :data:`BACKENDS` covers; what any
server's reply may hold, and how it is bounded, is
:mod:`tokenbudget.producers.inference.replies`.

Here: :data:`BACKENDS` and the backend made for one server of the config (its client,
its key from the environment, its tokenizer when the server returns no counts), and
the checks ``run``, ``init`` and ``status`` make of the servers before any work is
sent: reachable, serving the configured model, answering one token
(:func:`check_servers`, :func:`probe_server`).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from tokenbudget.core.apis import API_TRAITS
from tokenbudget.core.errors import (
    InferenceError,
    InferenceRequestError,
    InferenceTransportError,
)
from tokenbudget.producers.inference.generation import (
    GenerationRequest,
    InferenceBackend,
    ProgressCallback,
    ServerUnreachableError,
    WrongModelError,
)
from tokenbudget.producers.inference.http import HttpClient, Reply, Timeouts
from tokenbudget.producers.inference.openai import OpenAIChatBackend, OpenAICompletionsBackend
from tokenbudget.producers.inference.sglang import SGLangBackend
from tokenbudget.producers.templates import config_tokenizer
from tokenbudget.streams.fields import ChatMessage

if TYPE_CHECKING:
    from tokenbudget.core.config import Config, Server


# The client of each API, by the name its class declares (the rows of
# tokenbudget.core.apis.API_TRAITS, which this covers).
BACKENDS: dict[str, type[InferenceBackend]] = {
    backend.api: backend for backend in (SGLangBackend, OpenAICompletionsBackend, OpenAIChatBackend)
}


def make_backend(
    api: str,
    client: HttpClient,
    url: str,
    model: str = "",
    **options: Any,
) -> InferenceBackend:
    """``options``: ``stream``, ``api_key``, ``tokenizer``, ``on_progress``."""
    return BACKENDS[api](client, url, model, **options)


def api_key_of(server: Server) -> str | None:
    """The API key of ``server``, from the environment variable it names."""
    name = server.api_key_env
    return os.environ.get(name) or None if name else None


def api_key_from_env(config: Config) -> str | None:
    """The API key of the config's first server."""
    return api_key_of(config.servers[0])


def backend_for_server(
    config: Config,
    client: HttpClient,
    server: Server,
    *,
    on_progress: ProgressCallback | None = None,
) -> InferenceBackend:
    """The backend of one server of the fleet: ``[inference]``'s api, model and
    stream, the server's URL and key, and the tokenizer for servers that return no
    counts."""
    inference = config.inference
    tokenizer = config_tokenizer(config)
    return make_backend(
        inference.api,
        client,
        server.url,
        inference.model,
        stream=inference.stream,
        api_key=api_key_of(server),
        tokenizer=tokenizer,
        on_progress=on_progress,
    )


def backend_for_config(
    config: Config, client: HttpClient, *, on_progress: ProgressCallback | None = None
) -> InferenceBackend:
    """The backend of the config's first server (the whole fleet of a one-server job)."""
    return backend_for_server(config, client, config.servers[0], on_progress=on_progress)


@dataclass(frozen=True)
class ServerCheck:
    """One server as probed before a run: up (with the models it named) or why not."""

    url: str
    up: bool
    models: tuple[str, ...] = ()
    problem: str = ""  # why it is not up


async def prepare(config: Config) -> list[ServerCheck]:
    """Before a run: load the tokenizer (off the event loop, once per process) and,
    unless ``[inference] check_server = false``, probe every server of the fleet
    (:func:`check_servers`); [] when they are not checked."""
    await asyncio.to_thread(config_tokenizer, config)
    if config.inference.check_server:
        return await check_servers(config)
    return []


def _same_model(configured: str, served: str) -> bool:
    if configured == served:
        return True
    # SGLang reports the model path it loaded; a config may name the hub id.
    return configured.rstrip("/").rsplit("/", 1)[-1] == served.rstrip("/").rsplit("/", 1)[-1]


async def check_servers(config: Config, *, timeout: float = 10.0) -> list[ServerCheck]:
    """Probe every server of the fleet at once (:func:`check_server`): those that do
    not answer are reported down. Raises :class:`ServerUnreachableError` when none is
    up (naming each and why), and what :func:`check_server` raises for a server that
    answers wrongly (another model, a key refused): a mistake to fix, not an outage."""

    async def probe(server: Server) -> ServerCheck:
        try:
            models = await check_server(config, server=server, timeout=timeout)
        except ServerUnreachableError as exc:
            return ServerCheck(server.url, False, problem=str(exc))
        return ServerCheck(server.url, True, tuple(models))

    checks = list(await asyncio.gather(*(probe(s) for s in config.servers)))
    if not any(check.up for check in checks):
        if len(checks) == 1:
            raise ServerUnreachableError(checks[0].problem)
        raise ServerUnreachableError(
            f"none of the {len(checks)} inference servers answers: "
            + "; ".join(check.problem for check in checks)
        )
    return checks


async def check_server(
    config: Config, *, server: Server | None = None, timeout: float = 10.0
) -> list[str]:
    """GET ``/health`` (SGLang) or ``/v1/models`` (OpenAI-compatible) of ``server``
    (default: the config's first) and, with ``[inference] model`` set, check the
    server serves it; a server without that route (404: a proxy, a router) is sent a
    one-token request instead. Returns the model names the server reported. Raises
    :class:`ServerUnreachableError` or :class:`WrongModelError` (both
    :class:`InferenceError`) with what to fix."""
    inference = config.inference
    server = server or config.servers[0]
    url = server.url
    key = api_key_of(server)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    client = HttpClient(2, Timeouts.of(inference, read=timeout), inference.max_reply_bytes)
    async with client:

        async def get(path: str) -> Reply:
            try:
                response = await client.request("GET", url + path, None, headers)
            except InferenceTransportError as exc:
                cause = exc.__cause__ or exc
                raise ServerUnreachableError(
                    f"cannot reach the inference server at {url} ({inference.api}): "
                    f"GET {path} failed ({type(cause).__name__}: {cause}). Is the server"
                    " running?"
                ) from exc
            if response.status in (401, 403):
                raise InferenceRequestError(
                    f"the inference server at {url} refused GET {path} with HTTP "
                    f"{response.status}: set the API key in ${server.api_key_env}"
                )
            return response

        served: list[str] = []
        traits = API_TRAITS[inference.api]
        health = await get(traits.health_route)
        if health.status == 404:
            await _one_token(config, client, url, key)
        elif health.status >= 400 and not traits.health_lists_models:
            raise ServerUnreachableError(
                f"the inference server at {url} is not healthy: GET {traits.health_route} "
                f"answered HTTP {health.status}: {health.text[:200]}"
            )
        elif health.status >= 400:
            raise ServerUnreachableError(
                f"the server at {url} does not answer GET {traits.health_route} (HTTP "
                f"{health.status}): is it an OpenAI-compatible server "
                f"(api = {inference.api!r})?"
            )
        elif traits.health_lists_models:
            served += _model_ids(health.content)
        if traits.model_info_route and inference.model:
            info = await get(traits.model_info_route)
            with_path = _json_or_none(info.content) if info.status < 400 else None
            if isinstance(with_path, dict) and isinstance(with_path.get("model_path"), str):
                served.append(with_path["model_path"])
            # --served-model-name shows only here; a failure here is not fatal
            models = await get("/v1/models")
            served += _model_ids(models.content) if models.status < 400 else []
        served = list(dict.fromkeys(served))
        if inference.model and served and not any(_same_model(inference.model, s) for s in served):
            raise WrongModelError(
                f"the inference server at {url} serves {', '.join(map(repr, served))}, "
                f"but [inference] model is {inference.model!r}"
            )
        return served


def _model_ids(content: bytes) -> list[str]:
    listing = _json_or_none(content)
    data = listing.get("data") if isinstance(listing, dict) else None
    return [m["id"] for m in data or () if isinstance(m, dict) and "id" in m]


async def _one_token(config: Config, client: HttpClient, url: str, key: str | None) -> None:
    """A server without a health route is asked for one token instead."""
    backend = make_backend(config.inference.api, client, url, config.inference.model, api_key=key)
    request = GenerationRequest(
        rid=f"tokenbudget-probe-{random.getrandbits(48):012x}",
        max_new_tokens=1,
        text="ping",
        messages=(ChatMessage(role="user", content="ping"),),
    )
    try:
        await backend.generate(request)
    except InferenceError as exc:
        raise ServerUnreachableError(
            f"the inference server at {url} has no health route and did not answer a "
            f"one-token request: {exc}"
        ) from exc


def _json_or_none(content: bytes) -> Any:
    try:
        return json.loads(content)
    except (ValueError, RecursionError):
        return None


@dataclass(frozen=True)
class ServerInfo:
    """What a server says of itself."""

    url: str
    # The API whose model-info route answered ("sglang": /get_model_info), else
    # "openai" (an OpenAI-compatible server: /v1/models only).
    kind: str
    model: str  # as the server names it ("" if it does not)
    tokenizer: str  # the tokenizer folder the server names ("" if none)


def probe_server(
    url: str, *, api_key: str | None = None, key_env: str = "", timeout: float = 10.0
) -> ServerInfo:
    """Which API ``url`` speaks, asked as a client would: SGLang answers
    ``GET /get_model_info`` (the model's and the tokenizer's paths), an
    OpenAI-compatible server (vLLM, llama.cpp, SGLang too) ``GET /v1/models`` (the
    model's id; vLLM's ``root`` is the folder it loaded). Raises
    :class:`ServerUnreachableError` when neither answers, and
    :class:`InferenceRequestError` when it wants a key (``key_env`` names its
    variable)."""
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout, headers=headers) as client:

        def get(path: str) -> httpx.Response:
            try:
                return client.get(url + path)
            except httpx.HTTPError as exc:
                raise ServerUnreachableError(
                    f"cannot reach the inference server at {url}: GET {path} failed"
                    f" ({type(exc).__name__}: {exc}). Is the server running?"
                ) from exc

        unanswered = []
        for api, traits in API_TRAITS.items():
            if not traits.model_info_route:
                continue
            info = get(traits.model_info_route)
            body = _json_or_none(info.content) if info.status_code < 400 else None
            if isinstance(body, dict) and isinstance(body.get("model_path"), str):
                tokenizer = body.get("tokenizer_path")
                return ServerInfo(
                    url, api, body["model_path"], tokenizer if isinstance(tokenizer, str) else ""
                )
            unanswered.append(f"GET {traits.model_info_route} ({api}: HTTP {info.status_code})")
        models = get("/v1/models")
        if models.status_code in (401, 403):
            raise InferenceRequestError(
                f"the inference server at {url} refused GET /v1/models with HTTP"
                f" {models.status_code}: set its API key in ${key_env}"
            )
        listing = _json_or_none(models.content) if models.status_code < 400 else None
        data = listing.get("data") if isinstance(listing, dict) else None
        if isinstance(data, list):
            first = next((m for m in data if isinstance(m, dict)), {})
            root = first.get("root")
            return ServerInfo(
                url, "openai", str(first.get("id") or ""), root if isinstance(root, str) else ""
            )
        raise ServerUnreachableError(
            f"the server at {url} answers neither {' nor '.join(unanswered)} nor GET"
            f" /v1/models (OpenAI-compatible: HTTP {models.status_code}); is it an"
            " inference server, and its URL the root?"
        )
