"""Backends in streaming mode, count sources, API keys and the pre-run server check,
against the simulator."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from tests.producers.tokenizer_fixture import build_tokenizer
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import (
    InferenceProtocolError,
    InferenceRequestError,
    InferenceServerError,
)
from tokenbudget.dev.simulator import server as sim_server
from tokenbudget.dev.simulator.config import Faults, RequestRecord, SimulatorConfig
from tokenbudget.dev.simulator.server import RunningSimulator
from tokenbudget.producers.inference.backends import backend_for_config, check_server, make_backend
from tokenbudget.producers.inference.generation import (
    GenerationRequest,
    InferenceCountError,
    ServerUnreachableError,
    WrongModelError,
)
from tokenbudget.producers.inference.http import HttpClient, Timeouts
from tokenbudget.producers.templates import load_tokenizer
from tokenbudget.streams.fields import ChatMessage

APIS = ["sglang", "openai-completions", "openai-chat"]
FAST = SimulatorConfig(port=0, tokens_per_second=200_000, seed=5)
PROMPTS = ["a #short", "b #code", "c #chat"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def with_simulator(
    config: SimulatorConfig, body: Callable[[RunningSimulator, HttpClient], Awaitable[Any]]
) -> Any:
    async def main() -> Any:
        sim = await sim_server.start(config)
        try:
            async with HttpClient(64, Timeouts(read=30.0)) as client:
                return await body(sim, client)
        finally:
            await sim.stop()

    return asyncio.run(main())


def run_prompts(
    api: str, config: SimulatorConfig = FAST, **options: Any
) -> tuple[list[Any], dict[str, RequestRecord], dict[str, list[int]]]:
    progress: dict[str, list[int]] = {}

    async def body(sim: RunningSimulator, client: HttpClient) -> list[Any]:
        backend = make_backend(
            api,
            client,
            sim.url,
            config.model,
            on_progress=lambda rid, n: progress.setdefault(rid, []).append(n),
            **options,
        )
        return [
            await backend.generate(
                GenerationRequest(rid=f"{api}-{i}", max_new_tokens=100_000, text=text)
            )
            for i, text in enumerate(PROMPTS)
        ]

    results = with_simulator(config, body)
    return results, {}, progress


# OpenAI-compatible streams are always deltas; SGLang's are cumulative unless the
# server runs with --incremental-streaming-output.
@pytest.mark.parametrize(
    ("api", "incremental"),
    [("sglang", False), ("sglang", True), ("openai-completions", True), ("openai-chat", True)],
)
def test_streaming_counts_equal_the_servers(api: str, incremental: bool) -> None:
    config = SimulatorConfig(
        port=0, tokens_per_second=20_000, seed=5, incremental_streaming=incremental
    )
    log: list[RequestRecord] = []
    progress: dict[str, list[int]] = {}

    async def body(sim: RunningSimulator, client: HttpClient) -> list[Any]:
        backend = make_backend(
            api,
            client,
            sim.url,
            config.model,
            stream=True,
            on_progress=lambda rid, n: progress.setdefault(rid, []).append(n),
        )
        out = []
        for i, text in enumerate(PROMPTS):
            out.append(
                await backend.generate(
                    GenerationRequest(rid=f"{api}-{i}", max_new_tokens=100_000, text=text)
                )
            )
        log.extend(sim.log)
        return out

    results = with_simulator(config, body)
    served = {r.rid: r for r in log}
    for result in results:
        record = served[result.rid]
        assert result.completion_tokens == record.completion_tokens > 0
        assert result.prompt_tokens == record.prompt_tokens
        assert len(result.output_ids) == result.completion_tokens
        assert result.text.split() == [f"w{i}" for i in result.output_ids]
        assert result.count_source == "server"
        assert result.first_token_at is not None
        assert result.first_token_at <= record.finished_at + 1
        steps = progress[result.rid]
        assert steps == sorted(steps)
        assert steps[-1] == result.completion_tokens
    # the long answers came in many chunks (so cumulative vs incremental was exercised)
    assert max(len(steps) for steps in progress.values()) >= 5


def test_per_request_callback_wins_over_the_backends() -> None:
    seen: list[tuple[str, int]] = []

    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend("sglang", client, sim.url, stream=True, on_progress=None)
        return await backend.generate(
            GenerationRequest(
                rid="cb",
                max_new_tokens=50,
                text="x #code",
                on_progress=lambda rid, n: seen.append((rid, n)),
            )
        )

    result = with_simulator(FAST, body)
    assert seen and seen[-1] == ("cb", result.completion_tokens) and {r for r, _ in seen} == {"cb"}


@pytest.mark.parametrize("api", APIS)
def test_non_streaming_has_no_first_token_time(api: str) -> None:
    results, _, progress = run_prompts(api)
    assert all(r.first_token_at is None and r.count_source == "server" for r in results)
    assert progress == {}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["openai-completions", "openai-chat"])
def test_usage_alone_or_ids_alone_are_server_counts(api: str, stream: bool) -> None:
    no_ids = SimulatorConfig(port=0, tokens_per_second=100_000, omit_token_ids=True)
    results, _, _ = run_prompts(api, no_ids, stream=stream)
    assert all(r.count_source == "usage" and r.output_ids is None for r in results)
    no_usage = SimulatorConfig(port=0, tokens_per_second=100_000, omit_usage=True)
    results, _, _ = run_prompts(api, no_usage, stream=stream)
    assert all(r.count_source == "server" for r in results)
    assert all(len(r.output_ids) == r.completion_tokens > 0 for r in results)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["openai-completions", "openai-chat"])
def test_no_usage_no_ids_counts_with_the_tokenizer(
    api: str, stream: bool, tokenizer_dir: Path
) -> None:
    bare = SimulatorConfig(
        port=0, tokens_per_second=100_000, seed=5, omit_usage=True, omit_token_ids=True
    )
    log: list[RequestRecord] = []
    tokenizer = load_tokenizer(tokenizer_dir)

    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend(api, client, sim.url, stream=stream, tokenizer=tokenizer)
        messages = (ChatMessage("user", "hello how are you #short"),)
        result = await backend.generate(
            GenerationRequest(rid="t", max_new_tokens=1000, messages=messages)
        )
        log.extend(sim.log)
        return result, messages

    result, messages = with_simulator(bare, body)
    assert result.count_source == "tokenizer"
    assert result.output_ids is None
    # one simulated word is one (unknown) token: the local count is the server's
    assert result.completion_tokens == log[0].completion_tokens > 0
    expected_prompt = (
        len(tokenizer.apply_chat_template(messages))
        if api == "openai-chat"
        else tokenizer.count_prompt("hello how are you #short", None)
    )
    assert result.prompt_tokens == expected_prompt


def test_no_counts_and_no_tokenizer_is_an_error_not_retried() -> None:
    bare = SimulatorConfig(port=0, tokens_per_second=100_000, omit_usage=True, omit_token_ids=True)

    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend("openai-completions", client, sim.url)
        with pytest.raises(InferenceCountError, match=r"\[inference\] tokenizer") as info:
            await backend.generate(GenerationRequest(rid="n", max_new_tokens=5, text="x"))
        return info.value

    assert with_simulator(bare, body).retryable is False


def test_sglang_input_ids_prompt_tokens_are_the_ids_sent() -> None:
    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend("sglang", client, sim.url, stream=True)
        return await backend.generate(
            GenerationRequest(rid="ids", max_new_tokens=100, input_ids=(5, 6, 7, 8, 9, 10))
        ), list(sim.log)

    result, log = with_simulator(FAST, body)
    assert result.prompt_tokens == log[0].prompt_tokens == 6


@pytest.mark.parametrize("api", APIS)
def test_streaming_errors(api: str) -> None:
    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend(api, client, sim.url, stream=True)
        with pytest.raises(InferenceProtocolError):
            await backend.generate(GenerationRequest(rid="m", max_new_tokens=10, text="x"))

    with_simulator(SimulatorConfig(port=0, faults=Faults(malformed=1.0)), body)

    async def fail(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend(api, client, sim.url, stream=True)
        with pytest.raises(InferenceServerError, match="500"):
            await backend.generate(GenerationRequest(rid="f", max_new_tokens=10, text="x"))

    with_simulator(SimulatorConfig(port=0, faults=Faults(http_500=1.0)), fail)


# ---- API key ----------------------------------------------------------------------


@pytest.mark.parametrize("api", APIS)
def test_api_key_is_sent_as_a_bearer_token(api: str) -> None:
    keyed = SimulatorConfig(port=0, tokens_per_second=100_000, api_key="s3cret")

    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        without = make_backend(api, client, sim.url)
        with pytest.raises(InferenceRequestError, match="401") as info:
            await without.generate(GenerationRequest(rid="a", max_new_tokens=5, text="x"))
        assert "s3cret" not in str(info.value)
        keyed_backend = make_backend(api, client, sim.url, api_key="s3cret", stream=True)
        return await keyed_backend.generate(GenerationRequest(rid="b", max_new_tokens=5, text="x"))

    assert with_simulator(keyed, body).completion_tokens > 0


def test_backend_for_config_reads_the_key_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tokenizer_dir: Path
) -> None:
    monkeypatch.setenv("MY_KEY", "k1")
    config = config_module.build(
        {
            "inference": {
                "api": "openai-chat",
                "stream": True,
                "api_key_env": "MY_KEY",
                "tokenizer": str(tokenizer_dir),
            }
        },
        environ={},
    )

    async def main() -> Any:
        async with HttpClient() as client:
            return backend_for_config(config, client)

    backend = asyncio.run(main())
    assert backend.headers == {"Authorization": "Bearer k1"}
    assert backend.stream is True
    assert backend.tokenizer is load_tokenizer(tokenizer_dir)
    monkeypatch.delenv("MY_KEY")

    async def keyless() -> Any:
        async with HttpClient() as client:
            return backend_for_config(config, client)

    assert asyncio.run(keyless()).headers == {}


# ---- the check before a run -------------------------------------------------------


def inference_config(url: str, api: str, model: str = "", **extra: Any) -> config_module.Config:
    return config_module.build(
        {"inference": {"url": url, "api": api, "model": model, **extra}}, environ={}
    )


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("api", APIS)
def test_check_server_passes_and_reports_the_model(api: str) -> None:
    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        assert await check_server(inference_config(sim.url, api)) == (
            [] if api == "sglang" else ["tokenbudget-sim"]
        )
        return await check_server(inference_config(sim.url, api, "tokenbudget-sim"))

    assert with_simulator(FAST, body) == ["tokenbudget-sim"]


@pytest.mark.parametrize("api", APIS)
def test_check_server_unreachable(api: str) -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(ServerUnreachableError) as info:
        asyncio.run(check_server(inference_config(url, api)))
    assert url in str(info.value)
    assert "Is the server running?" in str(info.value)


@pytest.mark.parametrize("api", APIS)
def test_check_server_wrong_model(api: str) -> None:
    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        with pytest.raises(WrongModelError) as info:
            await check_server(inference_config(sim.url, api, "Qwen/Qwen3-8B"))
        return str(info.value)

    message = with_simulator(FAST, body)
    assert "'tokenbudget-sim'" in message and "'Qwen/Qwen3-8B'" in message


def test_check_server_accepts_a_path_for_a_hub_id() -> None:
    served = SimulatorConfig(port=0, model="/models/Qwen/Qwen3-8B")

    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        return await check_server(inference_config(sim.url, "sglang", "Qwen/Qwen3-8B"))

    assert with_simulator(served, body) == ["/models/Qwen/Qwen3-8B"]


def test_check_server_with_a_key(monkeypatch: pytest.MonkeyPatch) -> None:
    keyed = SimulatorConfig(port=0, api_key="s3cret")

    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        config = inference_config(sim.url, "openai-chat", "tokenbudget-sim")
        with pytest.raises(InferenceRequestError, match=r"\$TOKENBUDGET_API_KEY"):
            await check_server(config)
        monkeypatch.setenv("TOKENBUDGET_API_KEY", "s3cret")
        return await check_server(config)

    assert with_simulator(keyed, body) == ["tokenbudget-sim"]
