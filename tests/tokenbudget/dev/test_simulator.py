"""The simulator must speak the real SGLang / OpenAI wire formats and be reproducible."""

from __future__ import annotations

import asyncio
import itertools
import json
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.producers.tokenizer_fixture import build_tokenizer
from tokenbudget.core.errors import ConfigError
from tokenbudget.dev.simulator.config import PROFILES, Faults, SimulatorConfig
from tokenbudget.dev.simulator.generation import completion_length, ids_crc
from tokenbudget.dev.simulator.server import RunningSimulator, start
from tokenbudget.producers.templates import load_tokenizer

FAST = SimulatorConfig(port=0, tokens_per_second=1e6, seed=7)


def run(
    config: SimulatorConfig,
    body: Callable[[RunningSimulator, httpx.AsyncClient], Awaitable[Any]],
) -> Any:
    async def main() -> Any:
        sim = await start(config)
        try:
            async with httpx.AsyncClient(base_url=sim.url, timeout=10.0) as client:
                return await body(sim, client)
        finally:
            await sim.stop()

    return asyncio.run(main())


async def sse_events(response: httpx.Response) -> list[str]:
    """Raw ``data:`` payloads of an SSE response, in order."""
    buf = ""
    events: list[str] = []
    async for piece in response.aiter_text():
        buf += piece
        while "\n\n" in buf:
            event, buf = buf.split("\n\n", 1)
            assert event.startswith("data: "), event
            events.append(event[len("data: ") :])
    assert buf == ""
    return events


def natural(text: str, seed: int = FAST.seed) -> int:
    return completion_length(PROFILES["demo"], seed, text)


# --- pure length model -------------------------------------------------------------------


def test_long_code_mean_matches_profile() -> None:
    lengths = [natural(f"#long-code task {i}", seed=0) for i in range(300)]
    mean = sum(lengths) / len(lengths)
    assert abs(mean - 3793) / 3793 < 0.10, mean


def test_rules_first_match_and_default() -> None:
    short = [natural(f"#short q{i}") for i in range(200)]
    default = [natural(f"plain q{i}") for i in range(200)]
    assert sum(short) / 200 < 500 < sum(default) / 200
    assert natural("x #long-code y") == natural("x #long-code y")
    assert min(short) >= 1


def test_bad_profile_is_config_error() -> None:
    with pytest.raises(ConfigError):
        asyncio.run(start(replace(FAST, profile="nope")))
    with pytest.raises(ConfigError):
        asyncio.run(start(replace(FAST, faults=Faults(http_500=0.7, reset=0.7))))


# --- SGLang native -----------------------------------------------------------------------


def test_generate_non_stream_shape_and_cap() -> None:
    text = "#long-code write a parser"
    full = natural(text)

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        r = await c.post(
            "/generate",
            json={"text": text, "sampling_params": {"max_new_tokens": 100_000}, "rid": "r1"},
        )
        assert r.status_code == 200
        out = r.json()
        meta = out["meta_info"]
        assert meta["id"] == "r1"
        assert meta["completion_tokens"] == len(out["output_ids"]) == full
        assert meta["finish_reason"] == {"type": "stop", "matched": 2}
        assert meta["prompt_tokens"] == 4 and meta["cached_tokens"] == 0
        assert isinstance(meta["e2e_latency"], float)
        assert isinstance(out["text"], str) and len(out["text"].split()) == full
        assert all(0 <= i < 32000 for i in out["output_ids"])

        r = await c.post(
            "/generate", json={"text": text, "sampling_params": {"max_new_tokens": 50}}
        )
        capped = r.json()
        assert capped["meta_info"]["finish_reason"] == {"type": "length", "length": 50}
        assert capped["meta_info"]["completion_tokens"] == len(capped["output_ids"]) == 50
        assert capped["output_ids"] == out["output_ids"][:50]

        r = await c.post("/generate", json={"input_ids": [5, 6, 7]})
        ids_out = r.json()
        ids_finish = ids_out["meta_info"]["finish_reason"]["type"]
        assert ids_out["meta_info"]["prompt_tokens"] == 3
        assert ids_out["meta_info"]["completion_tokens"] <= 128  # SGLang's default cap

        bad_requests: list[dict[str, Any]] = [
            {"sampling_params": {}},
            {"text": "x", "input_ids": [1]},
            {"text": "x", "sampling_params": {"max_new_tokens": -1}},
        ]
        for bad in bad_requests:
            r = await c.post("/generate", json=bad)
            assert r.status_code == 400 and "message" in r.json()["error"]

        assert [rec.finish for rec in sim.log] == ["stop", "length", ids_finish]
        assert sim.log[0].completion_tokens == full and sim.log[0].api == "sglang"
        assert sim.log[0].text_head == text

        log = (await c.get("/sim/log")).json()
        assert log[0]["rid"] == "r1" and log[1]["max_new_tokens"] == 50

        metrics = (await c.get("/metrics")).text
        generated = full + 50 + ids_out["meta_info"]["completion_tokens"]
        label = '{model_name="tokenbudget-sim"}'
        assert f"sglang:generation_tokens_total{label} {generated:.1f}" in metrics
        assert 'sglang:num_requests_total{model_name="tokenbudget-sim"} 3.0' in metrics
        assert "sglang:prompt_tokens_total" in metrics
        assert "sglang:num_aborted_requests_total" in metrics

    run(FAST, body)


def test_templated_ids_find_their_marker_through_the_tokenizer(tmp_path: Path) -> None:
    """A chat templated by the client arrives as ids; decoded with --tokenizer, its
    marker picks the same length rule the text would."""
    from tokenbudget.dev.tiny_tokenizer import CORPUS, build_tokenizer
    from tokenbudget.producers.templates import load_tokenizer
    from tokenbudget.streams.fields import ChatMessage

    texts = [f"#chat story {i}" for i in range(40)]
    folder = build_tokenizer(tmp_path / "tok", [*CORPUS, *texts], whole_words=["#chat"])
    tokenizer = load_tokenizer(folder)
    prompts = [tokenizer.apply_chat_template([ChatMessage("user", t)]) for t in texts]
    decoded = [tokenizer.decode(ids) for ids in prompts]
    assert all("#chat" in text for text in decoded)

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> list[int]:
        lengths = []
        for ids in prompts:
            r = await c.post(
                "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 9999}}
            )
            assert r.json()["meta_info"]["prompt_tokens"] == len(ids)
            lengths.append(r.json()["meta_info"]["completion_tokens"])
        assert [rec.text_head for rec in sim.log] == [text[:80] for text in decoded]
        return lengths

    lengths = run(replace(FAST, tokenizer=str(folder)), body)
    assert lengths == [min(9999, natural(text)) for text in decoded]
    # the #chat rule (mean 1,500), not the default one (1,000) the bare ids would get
    assert sum(lengths) / len(lengths) > 1250

    async def bare(sim: RunningSimulator, c: httpx.AsyncClient) -> int:
        body = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": 9999}}
        return int((await c.post("/generate", json=body)).json()["meta_info"]["completion_tokens"])

    # without a tokenizer the ids stay ids: no marker, the default rule
    assert run(FAST, bare) == natural(" ".join(map(str, prompts[0])))
    with pytest.raises(ConfigError, match=r"simulator\.tokenizer"):
        asyncio.run(start(replace(FAST, tokenizer=str(tmp_path / "absent"))))


def test_lengths_deterministic_across_instances() -> None:
    prompts = [f"#chat hello {i}" for i in range(5)] + ["#math 2+2", "no marker"]

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> list[list[int]]:
        results = []
        for p in prompts:
            r = await c.post(
                "/generate", json={"text": p, "sampling_params": {"max_new_tokens": 10**6}}
            )
            results.append(r.json()["output_ids"])
        return results

    first = run(FAST, body)
    second = run(FAST, body)
    assert first == second
    assert [len(ids) for ids in first] == [natural(p) for p in prompts]
    other_seed = run(replace(FAST, seed=8), body)
    assert [len(x) for x in other_seed] != [len(x) for x in first]


def test_info_endpoints() -> None:
    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        r = await c.get("/health")
        assert r.status_code == 200 and r.content == b""
        assert (await c.get("/get_model_info")).json() == {
            "model_path": "tokenbudget-sim",
            "is_generation": True,
        }
        models = (await c.get("/v1/models")).json()
        assert models["object"] == "list"
        assert models["data"][0]["id"] == "tokenbudget-sim"
        assert models["data"][0]["owned_by"] == "tokenbudget"
        r = await c.post("/abort_request", json={"rid": "nobody", "abort_all": False})
        assert r.status_code == 200

    run(FAST, body)


def test_generate_stream_cumulative() -> None:
    text = "#code stream me"
    full = natural(text)

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        req = {"text": text, "sampling_params": {"max_new_tokens": 10**6}, "stream": True}
        async with c.stream("POST", "/generate", json=req) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = await sse_events(r)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len(chunks) >= 3
        for prev, cur in itertools.pairwise(chunks):
            assert cur["text"].startswith(prev["text"])
            assert cur["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
        for ch in chunks[:-1]:
            assert ch["meta_info"]["finish_reason"] is None
            assert ch["meta_info"]["completion_tokens"] == len(ch["output_ids"])
        last = chunks[-1]["meta_info"]
        assert last["finish_reason"]["type"] == "stop"
        assert last["completion_tokens"] == full == len(chunks[-1]["output_ids"])

    # Slow enough that a ~1200-token answer arrives in several chunks even when a
    # loaded machine stalls the event loop: at 50,000 tokens/s the whole answer took
    # 24 ms, and one stall of half that left only two chunks (seen in CI).
    run(replace(FAST, tokens_per_second=5_000), body)


def test_abort_mid_stream() -> None:
    text = "#long-code abort me"
    full = natural(text)

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        req = {
            "text": text,
            "rid": "victim",
            "sampling_params": {"max_new_tokens": 10**6},
            "stream": True,
        }
        events: list[str] = []
        async with c.stream("POST", "/generate", json=req) as r:
            buf = ""
            aborted = False
            async for piece in r.aiter_text():
                buf += piece
                while "\n\n" in buf:
                    event, buf = buf.split("\n\n", 1)
                    events.append(event.removeprefix("data: "))
                    if not aborted:
                        aborted = True
                        a = await c.post("/abort_request", json={"rid": "victim"})
                        assert a.status_code == 200
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])["meta_info"]
        assert last["finish_reason"] == {"type": "abort", "message": "Abort request victim"}
        assert last["completion_tokens"] < full
        assert sim.log[-1].finish == "abort" and sim.log[-1].completion_tokens < full
        metrics = (await c.get("/metrics")).text
        assert 'sglang:num_aborted_requests_total{model_name="tokenbudget-sim"} 1.0' in metrics

    run(replace(FAST, tokens_per_second=2000), body)


def test_abort_all_non_stream() -> None:
    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        req = {"text": "#reasoning slow", "sampling_params": {"max_new_tokens": 10**6}}
        pending = asyncio.ensure_future(c.post("/generate", json={**req, "rid": "dup"}))
        await asyncio.sleep(0.2)
        # SGLang rejects a rid that is still decoding.
        dup = await c.post("/generate", json={**req, "rid": "dup"})
        assert dup.status_code == 400
        await c.post("/abort_request", json={"rid": "", "abort_all": True})
        out = (await pending).json()["meta_info"]
        assert out["finish_reason"]["type"] == "abort"
        assert out["completion_tokens"] < natural("#reasoning slow")

    run(replace(FAST, tokens_per_second=2000), body)


def test_client_disconnect_keeps_decoding() -> None:
    text = "#short disconnect"
    full = natural(text)

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        req = {"text": text, "sampling_params": {"max_new_tokens": 10**6}, "stream": True}
        async with c.stream("POST", "/generate", json=req) as r:
            async for _ in r.aiter_bytes():
                break  # hang up after the first chunk
        for _ in range(200):
            if sim.log:
                break
            await asyncio.sleep(0.02)
        assert sim.log[-1].finish == "stop"
        assert sim.log[-1].completion_tokens == full

    run(replace(FAST, tokens_per_second=2000), body)


# --- OpenAI-compatible -------------------------------------------------------------------


def test_openai_completions_non_stream() -> None:
    text = "#math integrate x"

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        req = {"model": "m", "prompt": text, "max_tokens": 10**6, "return_token_ids": True}
        r = await c.post("/v1/completions", json=req, headers={"X-Request-Id": "abc"})
        out = r.json()
        assert out["id"] == "cmpl-abc" and out["object"] == "text_completion"
        assert isinstance(out["created"], int) and out["model"] == "tokenbudget-sim"
        (choice,) = out["choices"]
        assert choice["index"] == 0 and choice["logprobs"] is None
        assert choice["finish_reason"] == "stop"
        assert len(choice["token_ids"]) == natural(text)
        assert out["usage"] == {
            "prompt_tokens": 3,
            "completion_tokens": natural(text),
            "total_tokens": 3 + natural(text),
        }
        assert len(out["prompt_token_ids"]) == 3

        plain = (await c.post("/v1/completions", json={"prompt": text})).json()
        assert plain["choices"][0]["finish_reason"] == "length"
        assert plain["usage"]["completion_tokens"] == 16  # OpenAI/vLLM default max_tokens
        assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain

        ids = (await c.post("/v1/completions", json={"prompt": [1, 2, 3, 4]})).json()
        assert ids["usage"]["prompt_tokens"] == 4
        assert sim.log[0].rid == "abc" and sim.log[0].api == "openai-completions"

    run(FAST, body)


def test_openai_chat_non_stream() -> None:
    messages = [{"role": "system", "content": "be brief "}, {"role": "user", "content": "#chat hi"}]
    text = "be brief #chat hi"

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        req = {"model": "m", "messages": messages, "return_token_ids": True, "max_tokens": 10}
        out = (await c.post("/v1/chat/completions", json=req)).json()
        assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
        (choice,) = out["choices"]
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str)
        assert choice["finish_reason"] == "length"
        assert len(choice["token_ids"]) == 10 == out["usage"]["completion_tokens"]
        assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 10
        assert "prompt_token_ids" in out

        req = {"messages": messages, "max_completion_tokens": 10**6, "max_tokens": 1}
        out = (await c.post("/v1/chat/completions", json=req)).json()
        assert out["usage"]["completion_tokens"] == natural(text)
        assert out["choices"][0]["finish_reason"] == "stop"
        assert sim.log[-1].api == "openai-chat" and sim.log[-1].text_head == text

    run(FAST, body)


def test_openai_completions_stream_usage() -> None:
    text = "#chat tell me a story"

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        req = {
            "prompt": text,
            "max_tokens": 10**6,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        async with c.stream("POST", "/v1/completions", json=req) as r:
            events = await sse_events(r)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        *content, usage_chunk = chunks
        assert len(content) >= 2
        assert usage_chunk["choices"] == []
        ids: list[int] = []
        text_out = ""
        for ch in content:
            assert ch["object"] == "text_completion" and ch["usage"] is None
            ids += ch["choices"][0]["token_ids"]
            text_out += ch["choices"][0]["text"]
        assert [ch["choices"][0]["finish_reason"] for ch in content[:-1]] == [None] * (
            len(content) - 1
        )
        assert content[-1]["choices"][0]["finish_reason"] == "stop"
        assert usage_chunk["usage"]["completion_tokens"] == len(ids) == natural(text)
        assert len(text_out.split()) == len(ids)

    run(replace(FAST, tokens_per_second=50_000), body)


def test_openai_chat_stream_usage() -> None:
    messages = [{"role": "user", "content": "#short hi"}]

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        req = {
            "messages": messages,
            "stream": True,
            "max_tokens": 40,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        async with c.stream("POST", "/v1/chat/completions", json=req) as r:
            events = await sse_events(r)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        *content, usage_chunk = chunks[1:]
        ids = [i for ch in content for i in ch["choices"][0]["token_ids"]]
        assert all(set(ch["choices"][0]["delta"]) == {"content"} for ch in content)
        assert content[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        assert usage_chunk["choices"] == []
        assert (
            usage_chunk["usage"]["completion_tokens"] == len(ids) == min(40, natural("#short hi"))
        )

    run(FAST, body)


# --- faults ------------------------------------------------------------------------------


def test_fault_http_500() -> None:
    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"text": "x"})
        assert r.status_code == 500 and "error" in r.json()
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500 and r.json()["code"] == 500
        assert [rec.finish for rec in sim.log] == ["fault", "fault"]

    run(replace(FAST, faults=Faults(http_500=1.0)), body)


def test_fault_malformed() -> None:
    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"text": "x"})
        assert r.status_code == 200
        with pytest.raises(json.JSONDecodeError):
            json.loads(r.content)
        req = {"prompt": "x", "stream": True}
        async with c.stream("POST", "/v1/completions", json=req) as r:
            raw = (await r.aread()).decode()
        assert "[DONE]" not in raw
        with pytest.raises(json.JSONDecodeError):
            json.loads(raw.split("\n\n")[0].removeprefix("data: "))

    run(replace(FAST, faults=Faults(malformed=1.0)), body)


def test_fault_reset_and_timeout() -> None:
    async def reset(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.TransportError):
            await c.post("/generate", json={"text": "x"})

    async def hang(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.TimeoutException):
            await c.post("/generate", json={"text": "y"}, timeout=0.3)

    run(replace(FAST, faults=Faults(reset=1.0)), reset)
    run(replace(FAST, faults=Faults(timeout=1.0)), hang)


def test_busy_and_unavailable_faults_say_when_to_come_back() -> None:
    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"text": "x"})
        assert (r.status_code, r.headers["Retry-After"]) == (429, "2.5")
        r = await c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        )
        assert (r.status_code, r.headers["Retry-After"]) == (429, "2.5")
        assert [(rec.finish, rec.fault) for rec in sim.log] == [("fault", "busy")] * 2

    run(replace(FAST, faults=Faults(busy=1.0, retry_after_s=2.5)), body)

    async def unavailable(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"

    run(replace(FAST, faults=Faults(unavailable=1.0)), unavailable)


def test_a_stream_reset_mid_way_sends_part_of_the_answer_then_drops_the_connection() -> None:
    slow = replace(FAST, tokens_per_second=2000.0, faults=Faults(reset_mid_stream=1.0))

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        text = "#code write something long"
        ids: list[int] = []
        with pytest.raises(httpx.TransportError):
            req = {"text": text, "stream": True, "sampling_params": {"max_new_tokens": 400}}
            async with c.stream("POST", "/generate", json=req) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        ids = json.loads(line[6:])["output_ids"]
        assert 0 < len(ids) < min(400, natural(text))
        # The request decodes on at the server: its tokens are generated, not received.
        for _ in range(200):
            if sim.log:
                break
            await asyncio.sleep(0.02)
        [record] = sim.log
        assert record.fault == "reset_mid_stream" and record.completion_tokens > len(ids)
        # a plain (non-streamed) request is reset whole instead
        with pytest.raises(httpx.TransportError):
            await c.post("/generate", json={"text": "y"})

    run(slow, body)


def test_an_outage_answers_503_to_everything_health_included_until_it_ends() -> None:
    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        assert (await c.post("/sim/outage", json={"seconds": 60})).status_code == 200
        assert (await c.get("/health")).status_code == 503
        r = await c.post("/generate", json={"text": "x"})
        assert r.status_code == 503 and "Retry-After" in r.headers
        await c.post("/sim/outage", json={"seconds": 0})
        assert (await c.get("/health")).status_code == 200
        r = await c.post("/generate", json={"text": "x"})
        assert r.status_code == 200
        assert [rec.fault for rec in sim.log] == ["outage", ""]

    run(FAST, body)


def test_a_simulator_with_a_key_keeps_its_log_outages_aborts_and_model_behind_it() -> None:
    keyed = replace(FAST, api_key="s3cret")

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        key = {"Authorization": "Bearer s3cret"}
        wrong = {"Authorization": "Bearer guess"}
        assert (await c.post("/generate", json={"text": "x"}, headers=key)).status_code == 200
        for headers in ({}, wrong):
            assert (await c.get("/sim/log", headers=headers)).status_code == 401
            outage = await c.post("/sim/outage", json={"seconds": 60}, headers=headers)
            assert outage.status_code == 401
            abort = await c.post("/abort_request", json={"rid": "r"}, headers=headers)
            assert abort.status_code == 401
            assert (await c.get("/get_model_info", headers=headers)).status_code == 401
        assert (await c.get("/get_model_info", headers=key)).status_code == 200
        assert (await c.get("/health")).status_code == 200  # no outage began
        [record] = (await c.get("/sim/log", headers=key)).json()
        assert record["text_head"] == "x"
        assert (await c.post("/sim/outage", json={"seconds": 60}, headers=key)).status_code == 200
        assert (await c.get("/health")).status_code == 503

    run(keyed, body)


def test_the_request_log_file_is_the_servers_own_account(tmp_path: Any) -> None:
    log_file = tmp_path / "requests.jsonl"

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"text": "hello", "rid": "a1"})
        ids = r.json()["output_ids"]
        lines = [json.loads(line) for line in log_file.read_text().splitlines()]
        assert [(line["rid"], line["completion_tokens"]) for line in lines] == [("a1", len(ids))]
        assert lines[0]["output_crc"] == ids_crc(ids) != 0

    run(replace(FAST, log_file=str(log_file)), body)
    run(replace(FAST, log_file=str(log_file)), _append_one)
    assert len(log_file.read_text().splitlines()) == 2  # a restart appends


async def _append_one(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
    await c.post("/generate", json={"text": "again", "rid": "a2"})


def test_the_log_holds_a_crc_of_the_whole_prompt_text_the_request_carried(
    tmp_path: Any,
) -> None:
    log_file = tmp_path / "requests.jsonl"
    text = "Add the numbers\n\n" + "1 2 3 " * 40  # longer than text_head

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> None:
        await c.post("/generate", json={"text": text, "rid": "t"})
        await c.post("/v1/completions", json={"prompt": text + "!", "max_tokens": 4})
        await c.post("/generate", json={"input_ids": [5, 6, 7], "rid": "ids"})

    run(replace(FAST, log_file=str(log_file)), body)
    lines = [json.loads(line) for line in log_file.read_text().splitlines()]
    expected = [zlib.crc32(text.encode()), zlib.crc32((text + "!").encode()), 0]
    assert [line["text_crc"] for line in lines] == expected  # ids: no text was sent


def test_the_log_holds_the_length_an_answer_would_have_had_without_its_limit() -> None:
    text = "#long-code a long answer"
    whole = natural(text)
    records = run(FAST, _two_rooms(text, whole))
    assert records == [
        ("cut", whole // 2, whole // 2, "length", whole),
        ("room", whole + 10, whole, "stop", whole),
    ]


def _two_rooms(
    text: str, whole: int
) -> Callable[[RunningSimulator, httpx.AsyncClient], Awaitable[list[tuple[Any, ...]]]]:
    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> list[tuple[Any, ...]]:
        for rid, room in (("cut", whole // 2), ("room", whole + 10)):
            params = {"max_new_tokens": room}
            await c.post("/generate", json={"text": text, "rid": rid, "sampling_params": params})
        return [
            (r.rid, r.max_new_tokens, r.completion_tokens, r.finish, r.natural_tokens)
            for r in sim.log
        ]

    return body


def test_the_thinking_profile_spreads_answers_around_a_mean_of_20k() -> None:
    lengths = [completion_length(PROFILES["thinking"], 0, f"q{i}") for i in range(2000)]
    assert abs(sum(lengths) / len(lengths) - 20_000) < 1_000
    assert sorted(lengths)[len(lengths) // 2] < 16_000 < 80_000 < max(lengths)


# --- a thinking model --------------------------------------------------------------------

THINKING = replace(FAST, tokens_per_second=20_000, reasoning_style="reasoning_content")
PROMPT = [{"role": "user", "content": "#short think about it"}]


async def chat(
    c: httpx.AsyncClient, *, stream: bool, max_tokens: int = 10**6, **extra: Any
) -> dict[str, Any]:
    """One chat answer as a client sees it: message fields (deltas joined when
    streamed), finish_reason, token ids and usage."""
    req = {"messages": PROMPT, "max_tokens": max_tokens, "return_token_ids": True, **extra}
    if not stream:
        out = (await c.post("/v1/chat/completions", json=req)).json()
        (choice,) = out["choices"]
        return {**choice["message"], "finish": choice["finish_reason"],
                "ids": choice["token_ids"], "usage": out["usage"]}  # fmt: skip
    req.update(stream=True, stream_options={"include_usage": True})
    async with c.stream("POST", "/v1/chat/completions", json=req) as r:
        events = await sse_events(r)
    chunks = [json.loads(e) for e in events[:-1]]
    joined: dict[str, Any] = {"ids": [], "deltas": []}
    for ch in chunks:
        if ch["usage"]:
            joined["usage"] = ch["usage"]
        for choice in ch["choices"]:
            delta = choice["delta"]
            joined["deltas"].append(delta)
            joined["ids"] += choice.get("token_ids", [])
            joined["finish"] = choice["finish_reason"] or joined.get("finish")
            for name, value in delta.items():
                if isinstance(value, str):
                    joined[name] = joined.get(name, "") + value
                elif name == "tool_calls":
                    joined[name] = value
    return joined


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("style", ["reasoning_content", "reasoning"])
def test_a_thinking_chat_answer_sends_its_thinking_in_the_styles_field(
    style: str, stream: bool, tmp_path: Path
) -> None:
    log_file = tmp_path / "log.jsonl"
    config = replace(THINKING, reasoning_style=style, log_file=str(log_file))
    other = "reasoning" if style == "reasoning_content" else "reasoning_content"

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> dict[str, Any]:
        return await chat(c, stream=stream)

    answer = run(config, body)
    [logged] = [json.loads(line) for line in log_file.read_text().splitlines()]
    ids, thinking = answer["ids"], answer["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert answer["finish"] == "stop" and len(ids) == answer["usage"]["completion_tokens"]
    assert 0 < thinking < len(ids) == logged["completion_tokens"]
    assert logged["reasoning_tokens"] == thinking
    # the thinking, then one token ending it (in neither text), then the answer
    words = [f"w{i}" for i in ids]
    assert answer[style].split() == words[: thinking - 1]
    assert answer["content"].split() == words[thinking:]
    assert other not in answer
    assert logged["reasoning_crc"] == zlib.crc32(answer[style].encode())
    assert logged["content_crc"] == zlib.crc32(answer["content"].encode())
    if stream:  # the thinking streams in its own field, all of it before the answer
        fields = [(bool(d.get(style)), bool(d.get("content"))) for d in answer["deltas"]]
        first_answer = next(i for i, (_, content) in enumerate(fields) if content)
        assert not any(thought for thought, _ in fields[first_answer + 1 :])


def test_an_answer_cut_while_thinking_has_no_content() -> None:
    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> list[dict[str, Any]]:
        return [await chat(c, stream=False, max_tokens=5), await chat(c, stream=True, max_tokens=5)]

    plain, streamed = run(THINKING, body)
    assert plain["content"] is None and len(plain["reasoning_content"].split()) == 5
    assert streamed.get("content", "") == "" and streamed["reasoning_content"]
    for answer in (plain, streamed):
        assert answer["finish"] == "length"
        assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == 5


@pytest.mark.parametrize("switch", ["enable_thinking", "thinking"])
def test_thinking_turned_off_by_the_template_switch_answers_straight_away(switch: str) -> None:
    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> dict[str, Any]:
        return await chat(c, stream=False, chat_template_kwargs={switch: False})

    answer = run(THINKING, body)
    assert answer["reasoning_content"] is None
    assert answer["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
    assert len(answer["content"].split()) == len(answer["ids"]) == natural(PROMPT[0]["content"])


def test_raw_apis_send_the_thinking_inline_closed_by_its_token(tmp_path: Path) -> None:
    tokenizer = build_tokenizer(tmp_path / "tok", thinking=True)
    config = replace(THINKING, tokenizer=str(tokenizer))

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> list[Any]:
        whole = {"max_new_tokens": 10**6}
        out = await c.post("/generate", json={"text": "#short go", "sampling_params": whole})
        closed = await c.post(
            "/generate", json={"text": "#short go </think>", "sampling_params": whole}
        )
        return [out.json(), closed.json(), list(sim.log)]

    out, closed, log = run(config, body)
    words = out["text"].split()
    think = words.index("</think>") + 1
    assert words.count("</think>") == 1 and 1 < think < len(words)
    assert log[0].reasoning_tokens == think and log[0].content_crc == zlib.crc32(
        out["text"].encode()
    )
    # the id ending the thinking is the tokenizer's own "</think>", and only there
    end_id = out["output_ids"][think - 1]
    assert load_tokenizer(tokenizer).encode("</think>", special=False) == [end_id]
    assert out["output_ids"].count(end_id) == 1
    assert "</think>" not in closed["text"] and log[1].reasoning_tokens == 0


def test_tool_calls_answer_requests_that_offer_tools() -> None:
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    config = replace(THINKING, tool_calls=True)

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> list[Any]:
        answers = [await chat(c, stream=s, tools=tools) for s in (False, True)]
        return [*answers, await chat(c, stream=False), list(sim.log)]

    plain, streamed, without, log = run(config, body)
    for answer in (plain, streamed):
        [call] = answer["tool_calls"]
        assert answer["finish"] == "tool_calls" and not answer.get("content")
        assert call["type"] == "function" and call["function"]["name"] == "search"
        # the user's turn, passed on: what a dataset can record for the call
        assert json.loads(call["function"]["arguments"]) == {"query": PROMPT[0]["content"]}
        assert answer["reasoning_content"]  # it thought before calling
    # the same call, streamed or not (its id is the request's)
    assert plain["tool_calls"][0]["function"] == streamed["tool_calls"][0]["function"]
    assert streamed["tool_calls"][0]["index"] == 0 and "index" not in plain["tool_calls"][0]
    assert without["finish"] == "stop" and without["content"] and "tool_calls" not in without
    assert [r.tool_calls for r in log] == [1, 1, 0]
    assert log[0].content_crc == 0  # no content was sent
    assert log[0].call_ids == [plain["tool_calls"][0]["id"]] and log[2].call_ids == []


def test_a_tool_result_is_answered_in_text_and_the_log_says_what_each_message_held() -> None:
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    config = replace(FAST, tool_calls=True)  # no thinking: calls all the same
    call = {"id": "call_1", "type": "function",
            "function": {"name": "search", "arguments": '{"query": "q"}'}}  # fmt: skip
    history = [
        {"role": "user", "content": "#short q"},
        {"role": "assistant", "content": None, "tool_calls": [call],
         "reasoning_content": "hmm"},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip

    async def body(sim: RunningSimulator, c: httpx.AsyncClient) -> list[Any]:
        first = (await c.post("/v1/chat/completions", json={
            "messages": history[:1], "tools": tools})).json()  # fmt: skip
        answered = (await c.post("/v1/chat/completions", json={
            "messages": history, "tools": tools})).json()  # fmt: skip
        return [first, answered, list(sim.log)]

    first, answered, log = run(config, body)
    assert first["choices"][0]["finish_reason"] == "tool_calls"
    message = answered["choices"][0]["message"]
    assert answered["choices"][0]["finish_reason"] == "stop" and message["content"]
    assert "tool_calls" not in message and log[1].tool_calls == 0
    assert log[1].messages == [
        {"role": "user", "crc": zlib.crc32(b"#short q")},
        {"role": "assistant", "crc": 0, "calls": ["call_1"], "reasoning": True},
        {"role": "tool", "crc": zlib.crc32(b"sunny"), "tool_call_id": "call_1"},
    ]


def test_an_unknown_reasoning_style_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"simulator\.reasoning_style.*reasoning_content"):
        run(replace(FAST, reasoning_style="thoughts"), _append_one)
