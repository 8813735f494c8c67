"""Inference clients against the simulator: real wire formats, errors translated."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from tests.producers.canned import CannedClient, CannedTurns, answer_body
from tests.producers.inference.test_http import Hostile, serve
from tests.producers.retries import generate_with_retries
from tokenbudget.core.errors import (
    InferenceBadCountError,
    InferenceError,
    InferenceProtocolError,
    InferenceReplyTooLargeError,
    InferenceRequestError,
    InferenceServerError,
    InferenceTimeLimitError,
    InferenceTransportError,
    InferenceUnavailableError,
)
from tokenbudget.dev.oracle import text_crc
from tokenbudget.dev.simulator import server as sim_server
from tokenbudget.dev.simulator.config import Faults, SimulatorConfig
from tokenbudget.dev.simulator.server import RunningSimulator
from tokenbudget.producers.inference import generation
from tokenbudget.producers.inference.backends import make_backend
from tokenbudget.producers.inference.generation import (
    GenerationRequest,
    GenerationResult,
    InferenceBackend,
    RetryPolicy,
)
from tokenbudget.producers.inference.http import HttpClient, Timeouts
from tokenbudget.producers.inference.openai import OpenAIChatBackend, OpenAICompletionsBackend
from tokenbudget.producers.inference.replies import RETRY_AFTER_MAX_S, parse_retry_after
from tokenbudget.producers.inference.sglang import SGLangBackend
from tokenbudget.streams.fields import ChatMessage, ToolCall

FAST = SimulatorConfig(port=0, tokens_per_second=1e6, seed=3)
APIS = ["sglang", "openai-completions", "openai-chat"]

Body = Callable[[RunningSimulator, HttpClient], Awaitable[Any]]


def with_simulator(body: Body, config: SimulatorConfig = FAST) -> Any:
    async def main() -> Any:
        sim = await sim_server.start(config)
        try:
            async with HttpClient(64, Timeouts(read=30.0)) as client:
                return await body(sim, client)
        finally:
            await sim.stop()

    return asyncio.run(main())


def request(rid: str, *, max_new_tokens: int = 100_000, **kwargs: Any) -> GenerationRequest:
    if "text" not in kwargs and "messages" not in kwargs and "input_ids" not in kwargs:
        kwargs["text"] = "Tell me a story #short"
    return GenerationRequest(rid=rid, max_new_tokens=max_new_tokens, **kwargs)


def test_make_backend_picks_the_class() -> None:
    client = HttpClient()
    try:
        assert type(make_backend("sglang", client, "http://h:1/")) is SGLangBackend
        assert type(make_backend("openai-completions", client, "http://h")) is (
            OpenAICompletionsBackend
        )
        assert type(make_backend("openai-chat", client, "http://h")) is OpenAIChatBackend
        backend = make_backend("sglang", client, "http://h:1/", model="m")
        assert backend.base_url == "http://h:1"
        assert backend.model == "m"
        with pytest.raises(KeyError):
            make_backend("grpc", client, "http://h")
    finally:
        asyncio.run(client.aclose())


@pytest.mark.parametrize("api", APIS)
def test_completion_tokens_match_what_the_server_generated(api: str) -> None:
    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend(api, client, sim.url, model=FAST.model)
        await backend.health()
        prompts = ["a #short", "b #code", "c #chat", "plain words here"]
        results = [
            await backend.generate(request(f"{api}-{i}", text=text))
            for i, text in enumerate(prompts)
        ]
        return results, list(sim.log)

    results, log = with_simulator(body)
    logged = {record.rid: record for record in log}
    assert len(logged) == len(results)
    for result in results:
        record = logged[result.rid]
        assert record.api == api
        assert result.completion_tokens == record.completion_tokens
        assert result.completion_tokens > 0
        assert result.prompt_tokens == record.prompt_tokens
        assert result.finish_reason == "stop"
        assert len(result.output_ids) == result.completion_tokens
        assert result.text  # the simulator renders one word per token
    # The lengths differ by prompt, so matching the log is not a coincidence.
    assert len({r.completion_tokens for r in results}) > 1


def test_sglang_output_ids_match_completion_tokens_for_chat_and_ids() -> None:
    async def body(sim: RunningSimulator, client: HttpClient) -> list[GenerationResult]:
        backend = SGLangBackend(client, sim.url)
        chat = request(
            "chat",
            messages=(ChatMessage("system", "be brief"), ChatMessage("user", "hello #short")),
        )
        ids = request("ids", input_ids=(11, 12, 13, 14))
        return [await backend.generate(chat), await backend.generate(ids)]

    chat, ids = with_simulator(body)
    assert len(chat.output_ids) == chat.completion_tokens > 0
    assert len(ids.output_ids) == ids.completion_tokens > 0
    assert ids.prompt_tokens == 4


@pytest.mark.parametrize("api", APIS)
def test_max_new_tokens_caps_with_finish_length(api: str) -> None:
    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend(api, client, sim.url, model=FAST.model)
        # "#long-code" averages thousands of tokens: 5 always caps it.
        result = await backend.generate(
            request("capped", text="write it all #long-code", max_new_tokens=5)
        )
        return result, list(sim.log)

    result, log = with_simulator(body)
    assert result.finish_reason == "length"
    assert result.completion_tokens == 5
    assert len(result.output_ids) == 5
    assert log[0].max_new_tokens == 5
    assert log[0].completion_tokens == 5


@pytest.mark.parametrize("api", APIS)
def test_http_500_is_a_retryable_server_error(api: str) -> None:
    async def body(sim: RunningSimulator, client: HttpClient) -> InferenceError:
        backend = make_backend(api, client, sim.url, model=FAST.model)
        with pytest.raises(InferenceServerError) as info:
            await backend.generate(request("r500"))
        return info.value

    error = with_simulator(body, SimulatorConfig(port=0, faults=Faults(http_500=1.0)))
    assert error.retryable is True
    assert "500" in str(error)


@pytest.mark.parametrize("api", APIS)
def test_malformed_body_is_a_protocol_error(api: str) -> None:
    async def body(sim: RunningSimulator, client: HttpClient) -> InferenceError:
        backend = make_backend(api, client, sim.url, model=FAST.model)
        with pytest.raises(InferenceProtocolError) as info:
            await backend.generate(request("bad"))
        return info.value

    error = with_simulator(body, SimulatorConfig(port=0, faults=Faults(malformed=1.0)))
    assert isinstance(error, InferenceError)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", APIS)
def test_an_answer_that_trickles_for_ever_times_out_by_its_max_new_tokens(
    api: str, stream: bool
) -> None:
    """A byte every 0.2 s: the request for 3 tokens at 10 tokens/s is given 1 s (0.2 +
    0.5 + 3 / 10), then ends as a timed-out attempt."""
    server = Hostile(None, piece=1, gap=0.2, headers={"Content-Type": "text/event-stream"})

    async def body(url: str) -> Any:
        timeouts = Timeouts(connect=0.2, read=0.5, min_tokens_per_s=10.0)
        async with HttpClient(2, timeouts) as client:
            backend = make_backend(api, client, url, stream=stream)
            try:
                with pytest.raises(InferenceTimeLimitError) as raised:
                    await backend.generate(request("slow", max_new_tokens=3))
                return raised.value
            finally:
                await server.finished()

    error = serve(server, body)
    assert "within 1 s: 3 tokens at [inference] min_tokens_per_s = 10" in str(error)
    assert server.cut


@pytest.mark.parametrize("api", APIS)
def test_connection_refused_is_a_transport_error(api: str) -> None:
    async def main() -> InferenceError:
        url = f"http://127.0.0.1:{_closed_port()}"
        async with HttpClient(4, Timeouts(read=10.0)) as client:
            backend = make_backend(api, client, url)
            with pytest.raises(InferenceTransportError) as info:
                await backend.generate(request("refused"))
            with pytest.raises(InferenceTransportError):
                await backend.health()
            return info.value

    error = asyncio.run(main())
    assert error.retryable is True
    assert isinstance(error.__cause__, aiohttp.ClientError)


@pytest.mark.parametrize("api", APIS)
def test_http_400_is_a_request_error_not_retried(api: str) -> None:
    req = request("neg", max_new_tokens=-1)

    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend(api, client, sim.url, model=FAST.model)
        attempts: list[InferenceError] = []
        with pytest.raises(InferenceRequestError) as info:
            await generate_with_retries(
                backend, req, RetryPolicy(retries=5, backoff=0.0), on_error=attempts.append
            )
        return info.value, attempts

    error, attempts = with_simulator(body)
    assert error.retryable is False
    assert "400" in str(error)
    assert len(attempts) == 1  # not retried


def test_generate_with_retries_gives_up_after_the_retries() -> None:
    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = SGLangBackend(client, sim.url)
        attempts: list[InferenceError] = []
        with pytest.raises(InferenceServerError):
            await generate_with_retries(
                backend,
                request("again"),
                RetryPolicy(retries=2, backoff=0.0, backoff_max=0.0),
                on_error=attempts.append,
            )
        return attempts, len(sim.log)

    attempts, served = with_simulator(body, SimulatorConfig(port=0, faults=Faults(http_500=1.0)))
    assert len(attempts) == 3  # the first try and two retries
    assert served == 3
    assert all(isinstance(e, InferenceServerError) for e in attempts)


def test_generate_with_retries_counts_attempts_on_success() -> None:
    class Flaky(InferenceBackend):
        api = "flaky"

        def __init__(self) -> None:
            self.calls = 0

        async def generate(self, request: GenerationRequest) -> GenerationResult:
            self.calls += 1
            if self.calls < 3:
                raise InferenceTransportError("reset")
            return GenerationResult(request.rid, 1, 2, [1, 2], "ok", "stop")

    backend = Flaky()
    result, attempts = asyncio.run(
        generate_with_retries(backend, request("f"), RetryPolicy(retries=3, backoff=0.0))
    )
    assert attempts == 3
    assert result.completion_tokens == 2


def test_retry_delay_grows_and_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    policy = RetryPolicy(retries=10, backoff=0.5, backoff_max=10.0)
    monkeypatch.setattr(generation.random, "random", lambda: 1.0)  # no jitter
    full = [policy.delay(a) for a in range(1, 9)]
    assert full == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    monkeypatch.setattr(generation.random, "random", lambda: 0.0)  # most jitter
    assert [policy.delay(a) for a in range(1, 9)] == [d / 2 for d in full]


def test_retry_delay_jitter_stays_within_bounds() -> None:
    policy = RetryPolicy(backoff=0.5, backoff_max=10.0)
    for attempt in range(1, 12):
        base = min(10.0, 0.5 * 2 ** (attempt - 1))
        for _ in range(50):
            assert base / 2 <= policy.delay(attempt) <= base


# ---- malformed answers, without a server --------------------------------------------


def _answering(payload: Any, status: int = 200) -> Callable[[str], InferenceBackend]:
    def make(api: str) -> InferenceBackend:
        return make_backend(api, CannedClient(status, json=payload), "http://server")

    return make


async def _generate(backend: InferenceBackend) -> GenerationResult:
    try:
        return await backend.generate(request("m"))
    finally:
        await backend.client.aclose()


@pytest.mark.parametrize(
    ("api", "payload", "match"),
    [
        ("sglang", {"text": "x", "output_ids": [1]}, "meta_info"),
        ("sglang", {"text": "x", "meta_info": {"prompt_tokens": 1, "completion_tokens": 1}},
         "output_ids"),
        ("sglang", {"output_ids": [1], "meta_info": {"prompt_tokens": 1}}, "completion_tokens"),
        ("sglang", [1, 2, 3], "meta_info"),
        ("sglang", {"output_ids": [1], "meta_info": {"prompt_tokens": 1, "completion_tokens": 1,
                                                     "finish_reason": {"type": "exploded"}}},
         "finish_reason"),
        ("openai-completions", {"choices": [], "usage": {}}, "choices"),
        ("openai-completions", {"choices": [{"text": "x"}]}, "usage"),
        ("openai-chat", {"choices": [{"message": {"content": "x"}}],
                         "usage": {"prompt_tokens": 1}}, "completion_tokens"),
        ("openai-chat", {"choices": [{"message": {}, "finish_reason": "eaten"}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1}}, "finish_reason"),
    ],
)  # fmt: skip
def test_unexpected_shapes_are_protocol_errors(api: str, payload: Any, match: str) -> None:
    backend = _answering(payload)(api)
    with pytest.raises(InferenceProtocolError, match=match):
        asyncio.run(_generate(backend))


# What a buggy or hostile server may send for a count: each is refused.
NOT_COUNTS = [-1_000_000, -1, 3.5, 2.0, True, False, 2**31, 2**63, "7", None, [2]]
# Where each API carries its counts, as the error names them.
COUNT_FIELDS = {
    "sglang": {
        "prompt_tokens": "meta_info.prompt_tokens",
        "completion_tokens": "meta_info.completion_tokens",
    },
    "openai-completions": {
        "prompt_tokens": "usage.prompt_tokens",
        "completion_tokens": "usage.completion_tokens",
        "reasoning_tokens": "usage.completion_tokens_details.reasoning_tokens",
    },
    "openai-chat": {
        "prompt_tokens": "usage.prompt_tokens",
        "completion_tokens": "usage.completion_tokens",
        "reasoning_tokens": "usage.completion_tokens_details.reasoning_tokens",
    },
}
PATHS = {"sglang": "/generate", "openai-completions": "/v1/completions",
         "openai-chat": "/v1/chat/completions"}  # fmt: skip


def _hostile(api: str, stream: bool, **counts: Any) -> InferenceBackend:
    client = CannedTurns([answer_body(api, stream=stream, **counts)])
    return make_backend(api, client, "http://hostile:1", stream=stream)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", APIS)
def test_an_answer_with_counts_is_read_with_them(api: str, stream: bool) -> None:
    """The answers the refusals below are made of, with honest counts, are read as sent."""
    result = asyncio.run(_generate(_hostile(api, stream, reasoning_tokens=1)))
    assert (result.prompt_tokens, result.completion_tokens) == (3, 2)
    assert (result.output_ids, result.text) == ([7, 8], " a b")
    assert result.reasoning_tokens == (None if api == "sglang" else 1)  # SGLang sends none


@pytest.mark.parametrize("value", NOT_COUNTS, ids=repr)
@pytest.mark.parametrize(
    ("api", "count"),
    [(api, count) for api, fields in COUNT_FIELDS.items() for count in fields],
)
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_a_count_that_is_not_one_is_refused_naming_the_field_and_the_server(
    api: str, count: str, stream: bool, value: Any
) -> None:
    """Negative, not an integer (a float, even a whole one; a bool; a string; null where
    a count is required) or beyond any answer: refused as a malformed answer (tried
    again, within ``retries``), naming where it was; a reasoning count of null is none."""
    backend = _hostile(api, stream, **{count: value})
    if count == "reasoning_tokens" and value is None:
        assert asyncio.run(_generate(backend)).reasoning_tokens is None
        return
    with pytest.raises(InferenceBadCountError) as raised:
        asyncio.run(_generate(backend))
    message = str(raised.value)
    assert message.startswith(f"http://hostile:1{PATHS[api]}: {COUNT_FIELDS[api][count]} is ")
    assert "not a token count" in message and len(message) < 300
    assert raised.value.retryable and not raised.value.server_away


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("api", APIS)
def test_the_simulator_s_hostile_answers_are_refused(api: str, stream: bool) -> None:
    """Its lying counts (each of BAD_COUNTS, in either count) and its endless
    bodies: every backend refuses them as such, and its log says which it sent."""

    async def refused(config: SimulatorConfig, error: type[InferenceError]) -> list[str]:
        sim = await sim_server.start(config)
        try:
            async with HttpClient(4, Timeouts(read=10.0), 256 * 1024) as client:
                backend = make_backend(api, client, sim.url, stream=stream)
                for i in range(12):
                    with pytest.raises(error):
                        await backend.generate(request(f"r{i}"))
            return [record.fault for record in sim.log]
        finally:
            await sim.stop()

    lying = SimulatorConfig(port=0, seed=5, faults=Faults(bad_counts=1.0))
    assert asyncio.run(refused(lying, InferenceBadCountError)) == ["bad_counts"] * 12
    endless = SimulatorConfig(port=0, faults=Faults(endless=1.0))
    assert asyncio.run(refused(endless, InferenceReplyTooLargeError)) == ["endless"] * 12


def test_old_sglang_token_ids_field_is_accepted() -> None:
    payload = {
        "text": " w1 w2",
        "token_ids": [1, 2],
        "meta_info": {"prompt_tokens": 3, "completion_tokens": 2, "finish_reason": None},
    }
    result = asyncio.run(_generate(_answering(payload)("sglang")))
    assert result.output_ids == [1, 2]
    assert result.completion_tokens == 2
    assert result.finish_reason == "stop"


def test_openai_without_token_ids_counts_from_usage() -> None:
    payload = {
        "choices": [{"text": "hi", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 4, "completion_tokens": 9},
    }
    result = asyncio.run(_generate(_answering(payload)("openai-completions")))
    assert result.completion_tokens == 9
    # no ids from the server: none, and the row says how it was counted
    assert result.output_ids is None and result.count_source == "usage"
    assert result.finish_reason == "length"


@pytest.mark.parametrize(("status", "error"), [(404, InferenceRequestError),
                                               (422, InferenceRequestError),
                                               (500, InferenceServerError),
                                               (408, InferenceUnavailableError),
                                               (429, InferenceUnavailableError),
                                               (502, InferenceUnavailableError),
                                               (503, InferenceUnavailableError),
                                               (504, InferenceUnavailableError)])  # fmt: skip
def test_status_codes(status: int, error: type[InferenceError]) -> None:
    backend = _answering({"error": "no"}, status)("openai-chat")
    with pytest.raises(error, match=str(status)) as raised:
        asyncio.run(_generate(backend))
    # Only "busy or away" statuses spare the prompt; a wrong request fails it.
    assert raised.value.server_away == (error is InferenceUnavailableError)
    assert raised.value.retryable == (error is not InferenceRequestError)


@pytest.mark.parametrize("api", ["sglang", "openai-completions", "openai-chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_retry_after_of_a_busy_server_reaches_the_error(api: str, stream: bool) -> None:
    async def go() -> None:
        client = CannedClient(429, json={"error": "busy"}, headers={"Retry-After": "7"})
        async with client:
            backend = make_backend(api, client, "http://server", stream=stream)
            await backend.generate(request("busy"))

    with pytest.raises(InferenceUnavailableError) as raised:
        asyncio.run(go())
    assert raised.value.retry_after == 7.0


def test_parse_retry_after() -> None:
    assert parse_retry_after("12") == 12.0
    assert parse_retry_after(" 0.5 ") == 0.5
    assert parse_retry_after("-3") == 0.0
    assert parse_retry_after("100000") == RETRY_AFTER_MAX_S
    assert parse_retry_after("Thu, 01 Jan 1970 00:01:40 GMT", now=40.0) == 60.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


def test_retry_delay_is_never_shorter_than_retry_after() -> None:
    policy = RetryPolicy(retries=3, backoff=0.1, backoff_max=1.0)
    assert all(policy.delay(attempt, 5.0) == 5.0 for attempt in range(1, 6))
    assert all(policy.delay(attempt) <= 1.0 for attempt in range(1, 6))


@pytest.mark.parametrize("api", APIS)
def test_every_answer_names_the_model_the_server_reports(api: str) -> None:
    """Even the answers to the first requests, in flight together before SGLang's
    /get_model_info has answered, and with no model configured here."""
    served = dataclasses.replace(FAST, model="org/served-model")

    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend(api, client, sim.url)
        return await asyncio.gather(*(backend.generate(request(f"m{i}")) for i in range(8)))

    results = with_simulator(body, served)
    assert [r.model for r in results] == ["org/served-model"] * 8


# --- a thinking model's reasoning ---------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("style", ["reasoning_content", "reasoning"])
def test_chat_keeps_the_reasoning_the_server_sent_in_either_field(style: str, stream: bool) -> None:
    """SGLang's field and vLLM's, whole and streamed: the reasoning and the answer are
    what the server's log says it sent, and so are the thinking tokens."""
    thinking = dataclasses.replace(FAST, tokens_per_second=50_000, reasoning_style=style)

    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend("openai-chat", client, sim.url, stream=stream)
        prompts = ["a #short", "b #code", "c #short"]
        requests = [request(f"r{i}", text=p) for i, p in enumerate(prompts)]
        requests.append(request("cut", text="d #code", max_new_tokens=20))
        return [await backend.generate(r) for r in requests], list(sim.log)

    results, log = with_simulator(body, thinking)
    logged = {record.rid: record for record in log}
    for result in results:
        record = logged[result.rid]
        assert result.completion_tokens == record.completion_tokens
        assert result.reasoning_tokens == record.reasoning_tokens
        assert text_crc(result.reasoning) == record.reasoning_crc != 0
        assert text_crc(result.text) == record.content_crc
    *whole, cut = results
    assert all(0 < r.reasoning_tokens < r.completion_tokens and r.text for r in whole)
    # cut by the limit while still thinking: all of it is thinking, no answer
    assert cut.finish_reason == "length" and cut.text == ""
    assert cut.reasoning_tokens == cut.completion_tokens == 20


def _answering_stream(chunks: list[Any]) -> InferenceBackend:
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    client = CannedClient(200, content=body, headers={"Content-Type": "text/event-stream"})
    return make_backend("openai-chat", client, "http://server", stream=True)


USAGE = {"prompt_tokens": 4, "completion_tokens": 9}


@pytest.mark.parametrize(
    ("message", "usage", "reasoning", "tokens"),
    [
        ({"content": "42", "reasoning_content": "six times seven"},
         {**USAGE, "completion_tokens_details": {"reasoning_tokens": 6}}, "six times seven", 6),
        ({"content": "42", "reasoning": "six times seven", "reasoning_content": None},
         {**USAGE, "completion_tokens_details": {"reasoning_tokens": 6}}, "six times seven", 6),
        # vLLM while renaming the field sends both
        ({"content": "42", "reasoning": "hmm", "reasoning_content": "hmm"}, USAGE, "hmm", None),
        # details missing, empty or null: no split known (one not a count is refused:
        # test_a_count_that_is_not_one_is_refused_naming_the_field_and_the_server)
        ({"content": "42", "reasoning_content": "hmm"},
         {**USAGE, "completion_tokens_details": None}, "hmm", None),
        ({"content": "42"}, {**USAGE, "completion_tokens_details": {}}, None, None),
        ({"content": "42"},
         {**USAGE, "completion_tokens_details": {"reasoning_tokens": None}}, None, None),
        # a count above the answer's is the answer's (all of it thinking)
        ({"content": None, "reasoning_content": "hmm"},
         {**USAGE, "completion_tokens_details": {"reasoning_tokens": 12}}, "hmm", 9),
        ({"content": "42", "reasoning_content": ""}, USAGE, None, None),
    ],
)  # fmt: skip
def test_parsing_the_reasoning_and_its_tokens(
    message: dict[str, Any], usage: dict[str, Any], reasoning: str | None, tokens: int | None
) -> None:
    payload = {"choices": [{"message": message, "finish_reason": "stop"}], "usage": usage}
    result = asyncio.run(_generate(_answering(payload)("openai-chat")))
    assert (result.reasoning, result.reasoning_tokens) == (reasoning, tokens)
    assert result.text == (message["content"] or "")
    assert result.completion_tokens == 9  # thinking and answer together


def test_streamed_reasoning_deltas_in_either_field_are_joined() -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    chunks = [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "six "}),
        chunk({"reasoning": "times"}),  # a server may name it either way
        chunk({"reasoning_content": " seven", "content": "4"}),  # crossing into the answer
        chunk({"content": "2"}, "stop"),
        {"choices": [], "usage": {**USAGE, "completion_tokens_details": {"reasoning_tokens": 7}}},
    ]
    progress: list[int] = []
    backend = _answering_stream(chunks)
    backend.on_progress = lambda rid, tokens: progress.append(tokens)
    result = asyncio.run(_generate(backend))
    assert (result.reasoning, result.text) == ("six times seven", "42")
    assert result.reasoning_tokens == 7 and result.completion_tokens == 9
    assert result.first_token_at is not None  # the first thinking chunk is the first token
    assert progress[:3] == [0, 1, 2]  # thinking chunks count as progress
    # no reasoning deltas and no details: none
    bare = [chunks[0], chunk({"content": "42"}, "stop"), {"choices": [], "usage": USAGE}]
    plain = asyncio.run(_generate(_answering_stream(bare)))
    assert (plain.reasoning, plain.reasoning_tokens, plain.text) == (None, None, "42")


@pytest.mark.parametrize("api", ["sglang", "openai-completions"])
def test_raw_apis_keep_the_thinking_inline(api: str) -> None:
    """No reasoning field on raw text: the thinking is in the text, with its marker."""
    thinking = dataclasses.replace(FAST, reasoning_style="reasoning_content")

    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend(api, client, sim.url)
        return await backend.generate(request("raw", text="a #short")), sim.log[-1]

    result, record = with_simulator(body, thinking)
    assert result.reasoning is None and result.reasoning_tokens is None
    assert "</think>" in result.text and text_crc(result.text) == record.content_crc
    assert 0 < record.reasoning_tokens < result.completion_tokens


# --- tool use ------------------------------------------------------------------------------

SEARCH = [{"type": "function", "function": {"name": "search", "parameters": {}}}]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_sends_tool_use_and_reads_the_calls_the_model_answers_with(stream: bool) -> None:
    """The tools and a history of calls and results go out as the chat API takes them
    (the server's log says what each message held); an answer that calls a function
    ends the turn (stop) with its call, not as a malformed answer."""
    calling = dataclasses.replace(FAST, tool_calls=True)
    called = ChatMessage(
        "assistant", "", tool_calls=(ToolCall("call_7", "search", '{"query": "q"}'),)
    )
    history = (
        ChatMessage("user", "#short q"),
        called,
        ChatMessage("tool", "sunny", tool_call_id="call_7"),
        ChatMessage("user", "#short and tomorrow?"),
    )

    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend("openai-chat", client, sim.url, stream=stream)
        result = await backend.generate(request("t", messages=history, tools=SEARCH))
        return result, sim.log[-1]

    result, record = with_simulator(body, calling)
    assert result.finish_reason == "stop" and result.text == ""
    [call] = result.tool_calls or ()
    assert (call.id, call.name) == (record.call_ids[0], "search")
    assert json.loads(call.arguments) == {"query": "#short and tomorrow?"}
    assert result.completion_tokens == record.completion_tokens > 0
    assert record.extra["tools"] == SEARCH
    assert record.messages == [
        {"role": "user", "crc": text_crc("#short q")},
        {"role": "assistant", "crc": 0, "calls": ["call_7"]},
        {"role": "tool", "crc": text_crc("sunny"), "tool_call_id": "call_7"},
        {"role": "user", "crc": text_crc("#short and tomorrow?")},
    ]


def test_streamed_calls_are_joined_from_their_indexed_parts() -> None:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

    def part(index: int, **fields: Any) -> dict[str, Any]:
        return chunk({"tool_calls": [{"index": index, **fields}]})

    chunks = [
        chunk({"role": "assistant", "content": None}),
        part(0, id="call_a", type="function", function={"name": "search", "arguments": ""}),
        part(0, function={"arguments": '{"query": '}),
        part(1, id="call_b", type="function", function={"name": "fetch", "arguments": "{}"}),
        part(0, function={"arguments": '"q"}'}),
        chunk({}, "tool_calls"),
        {"choices": [], "usage": USAGE},
    ]
    result = asyncio.run(_generate(_answering_stream(chunks)))
    assert result.finish_reason == "stop" and result.text == ""
    assert result.tool_calls == (
        ToolCall("call_a", "search", '{"query": "q"}'),
        ToolCall("call_b", "fetch", "{}"),
    )
    nameless = [chunks[0], part(0, function={"arguments": "{}"}), chunk({}, "tool_calls")]
    with pytest.raises(InferenceProtocolError, match="without a function name"):
        asyncio.run(_generate(_answering_stream([*nameless, {"choices": [], "usage": USAGE}])))


def test_a_cumulative_sglang_stream_reports_each_chunks_count_whatever_its_text_and_keys() -> None:
    """Progress is read from the end of a cumulative chunk, where SGLang puts
    ``meta_info``: text that looks like that key, a key that ends in its name, and the
    name nested in another object after it must not be taken for it."""
    words = ["a", ' "meta_info": {"completion_tokens": 999}', " b", " c", " d", " e"]
    finished = {"type": "length", "length": 6}

    def meta(n: int) -> dict[str, Any]:
        return {
            "prompt_tokens": 3,
            "completion_tokens": n,
            "finish_reason": finished if n == 6 else None,
        }

    def chunk(n: int) -> dict[str, Any]:
        return {
            "text": "".join(words[:n]),
            "output_ids": list(range(1, n + 1)),
            "meta_info": meta(n),
        }

    decoy = {"meta_info": {"completion_tokens": 999}}
    chunks = [
        chunk(1),
        chunk(2),  # its text holds the key's name, quoted
        {**chunk(3), 'x"meta_info': decoy["meta_info"]},  # a key that ends in the name
        {**chunk(4), "extra": decoy},  # the name nested after the real one
        chunk(5),
        {"meta_info": meta(6), **chunk(6)},  # the key first: read whole
    ]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    seen: list[int] = []
    backend = make_backend(
        "sglang",
        # 7-byte reads: each completes one event at most, each reports progress
        CannedClient(200, content=body, headers={"Content-Type": "text/event-stream"}),
        "http://server",
        stream=True,
        on_progress=lambda rid, tokens: seen.append(tokens),
    )
    result = asyncio.run(_generate(backend))
    assert seen == [1, 2, 3, 4, 5, 6]
    assert (result.completion_tokens, result.output_ids) == (6, [1, 2, 3, 4, 5, 6])
    assert result.text == "".join(words)


@pytest.mark.parametrize(
    ("last", "text"),
    [
        ({"token_ids": [1, 2, 3]}, "a b c"),  # an older server's name for the ids
        ({"output_ids": [1, 2, 3], "text": None}, ""),  # what the typed read refuses
        ({"output_ids": [1.0, 2, 3]}, "a b c"),
    ],
)
def test_the_last_chunk_of_a_cumulative_sglang_stream_is_the_answer(
    last: dict[str, Any], text: str
) -> None:
    meta = {"prompt_tokens": 3, "finish_reason": None}
    chunks = [
        {"text": "a", "output_ids": [1], "meta_info": {**meta, "completion_tokens": 1}},
        {"text": "a b", "output_ids": [1, 2], "meta_info": {**meta, "completion_tokens": 2}},
        {
            "text": "a b c",
            **last,
            "meta_info": {**meta, "completion_tokens": 3, "finish_reason": {"type": "stop"}},
        },
    ]
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    client = CannedClient(200, content=body, headers={"Content-Type": "text/event-stream"})
    result = asyncio.run(_generate(make_backend("sglang", client, "http://server", stream=True)))
    assert (result.output_ids, result.text, result.completion_tokens) == ([1, 2, 3], text, 3)
    assert all(type(i) is int for i in result.output_ids)


def test_stream_chunks_msgspec_refuses_are_read_as_pythons_decoder_reads_them() -> None:
    """Invalid UTF-8 (replaced) and -Infinity (a logprob) in an OpenAI-compatible
    stream: read as before the chunks were decoded with msgspec."""
    first = (
        b'data: {"choices": [{"index": 0, "delta": {"content": "caf\xe9"}, "logprob": -Infinity}]}'
    )
    last = json.dumps(
        {
            "choices": [{"index": 0, "delta": {"content": "!"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2},
        }
    ).encode()
    body = first + b"\n\ndata: " + last + b"\n\ndata: [DONE]\n\n"
    client = CannedClient(200, content=body, headers={"Content-Type": "text/event-stream"})
    backend = make_backend("openai-chat", client, "http://server", stream=True)
    result = asyncio.run(_generate(backend))
    assert (result.text, result.completion_tokens) == ("caf\ufffd!", 2)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", APIS)
def test_a_reply_nested_past_the_parser_is_a_protocol_error(api: str, stream: bool) -> None:
    """JSON nested 100,000 deep makes Python's and msgspec's decoders raise a
    RecursionError: a malformed answer (retried within ``retries``), not a bug."""
    nested = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    if stream:
        content = b"data: " + nested + b"\n\ndata: [DONE]\n\n"
        headers = {"Content-Type": "text/event-stream"}
    else:
        content, headers = nested, {"Content-Type": "application/json"}
    client = CannedClient(200, content=content, headers=headers, chunk=1 << 20)
    backend = make_backend(api, client, "http://server", stream=stream)
    with pytest.raises(InferenceProtocolError, match="is not JSON"):
        asyncio.run(backend.generate(request("deep")))


@pytest.mark.parametrize("bad", ["-8", "2147483648", "true", '"8"', "8.5", "null"])
@pytest.mark.parametrize(("api", "stream"), [(api, False) for api in APIS] + [("sglang", True)])
def test_token_ids_that_are_not_token_ids_are_refused_naming_the_field(
    api: str, stream: bool, bad: str
) -> None:
    """An id past int32 failed only when the completion was encoded (the prompt then
    failed as a dispatch error), a bool or a fraction was taken as an int."""
    body = answer_body(api, stream=stream).replace(b"[7, 8]", f"[7, {bad}]".encode())
    headers = {"Content-Type": "text/event-stream" if stream else "application/json"}
    client = CannedClient(200, content=body, headers=headers)
    backend = make_backend(api, client, "http://server", stream=stream)
    field = "output_ids" if api == "sglang" else "token_ids"
    with pytest.raises(InferenceProtocolError, match=rf"{field} is \[7, .*not token ids"):
        asyncio.run(backend.generate(request("ids")))


@pytest.mark.parametrize("api", APIS)
def test_integral_float_ids_are_taken_as_their_integers(api: str) -> None:
    body = answer_body(api, stream=False).replace(b"[7, 8]", b"[7.0, 8]")
    client = CannedClient(200, content=body, headers={"Content-Type": "application/json"})
    result = asyncio.run(make_backend(api, client, "http://server").generate(request("f")))
    assert result.output_ids == [7, 8] and all(type(i) is int for i in result.output_ids)
