"""``tokenbudget init``: the server asked what it is, each dataset's rows read for
where they hold the prompt, and a config that ``run``'s own checks accept, never
written over a file. (Run unchanged on the broker: tests/integration/test_init.py.)"""

from __future__ import annotations

import asyncio
import json
import tomllib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from aiohttp import web

from tokenbudget import cli
from tokenbudget.app import init
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import ConfigError, InferenceRequestError, TokenBudgetError
from tokenbudget.dev.simulator import server as sim_server
from tokenbudget.dev.simulator.config import SimulatorConfig
from tokenbudget.dev.tiny_tokenizer import build_tokenizer
from tokenbudget.producers.inference.backends import ServerInfo, probe_server
from tokenbudget.producers.inference.generation import ServerUnreachableError
from tokenbudget.producers.prompts.dataset_checks import describe_dataset


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def datasets(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    alpaca = [
        {"instruction": f"add {i} and 1", "input": "", "output": str(i + 1)} for i in range(5)
    ]
    gsm = pa.table({"question": [f"what is {i} + {i}?" for i in range(5)], "answer": ["x"] * 5})
    pq.write_table(gsm, folder / "gsm8k.parquet")
    return {
        "plain": write_jsonl(folder / "plain.jsonl", [{"prompt": f"say {i}"} for i in range(5)]),
        "alpaca": write_jsonl(folder / "code alpaca.jsonl", alpaca),
        "gsm8k": folder / "gsm8k.parquet",
        "dialogs": write_jsonl(
            folder / "dialogs.jsonl",
            [{"dialog": [{"role": "user", "content": f"hi {i}"}]} for i in range(5)],
        ),
    }


def test_each_dataset_is_read_for_where_it_holds_the_prompt(tmp_path: Path) -> None:
    paths = datasets(tmp_path)
    shapes = {
        name: describe_dataset(path, "datasets[0]", str(path)) for name, path in paths.items()
    }
    assert shapes["plain"].mapping is None and not shapes["plain"].chat
    assert shapes["alpaca"].mapping == ("prompt_template", "{instruction}\n\n{input?}")
    assert shapes["gsm8k"].mapping == ("prompt_field", "question")
    assert shapes["gsm8k"].read_as == "Parquet"
    assert shapes["dialogs"].mapping == ("messages_field", "dialog") and shapes["dialogs"].chat
    assert all(s.prompts == s.rows == 5 for s in shapes.values())
    # rows with nothing that reads as a prompt: run's own error, naming the fields
    odd = write_jsonl(tmp_path / "odd.jsonl", [{"a": 1, "b": [2]}])
    with pytest.raises(ConfigError, match=r"datasets\[3\]\.prompt_field.*their fields: a, b"):
        describe_dataset(odd, "datasets[3]", str(odd))


def sglang(tokenizer: str = "") -> ServerInfo:
    return ServerInfo("http://gpu:30000", "sglang", "/models/m", tokenizer)


@pytest.mark.parametrize(
    ("server", "chat", "local", "api", "with_tokenizer"),
    [
        (sglang(), False, False, "sglang", False),
        (sglang("/models/m"), True, True, "sglang", True),  # templated here
        (sglang("/elsewhere/m"), True, False, "openai-chat", False),  # by the server
        (ServerInfo("http://gpu:8000", "openai", "m", ""), True, False, "openai-chat", False),
        (
            ServerInfo("http://gpu:8000", "openai", "m", ""),
            False,
            False,
            "openai-completions",
            False,
        ),
    ],
)
def test_the_api_follows_the_server_and_whether_chat_can_be_templated_here(
    tmp_path: Path, server: ServerInfo, chat: bool, local: bool, api: str, with_tokenizer: bool
) -> None:
    choice = init.choose_api(server, chat, tmp_path if local else None)
    assert (choice.api, choice.tokenizer is not None) == (api, with_tokenizer)


def test_the_config_written_is_one_run_accepts_with_budgets_to_set(tmp_path: Path) -> None:
    paths = datasets(tmp_path / "data")
    tokenizer = build_tokenizer(tmp_path / "tok")
    found = init.find_datasets(list(paths.values()))
    assert [f.name for f in found] == ["plain", "code_alpaca", "gsm8k", "dialogs"]
    server = sglang(str(tokenizer))
    text = init.config_text(server, found, tmp_path)
    out = tmp_path / "job.toml"
    init.write_config(text, out)
    config = config_module.load(out, environ={})
    assert (config.inference.api, config.inference.model) == ("sglang", "/models/m")
    assert config.tokenizer_path == tokenizer
    assert [d.budget for d in config.datasets] == [1_000_000] * 4
    assert text.count('budget = "1M"  # set me') == 4
    by_name = {d.name: d for d in config.datasets}
    assert by_name["dialogs"].template and not by_name["plain"].template
    assert by_name["gsm8k"].columns.prompt_field == "question"
    assert by_name["code_alpaca"].columns.key == "prompt_template"
    # paths inside the config's folder are written relative to it
    assert tomllib.loads(text)["datasets"][2]["path"] == "data/gsm8k.parquet"
    assert by_name["gsm8k"].path == paths["gsm8k"].resolve()
    with pytest.raises(TokenBudgetError, match=r"job\.toml exists: init never writes over a file"):
        init.write_config(text, out)
    assert out.read_text() == text


@asynccontextmanager
async def serving(routes: dict[str, Callable[[web.Request], Any]]) -> AsyncIterator[str]:
    app = web.Application()
    app.add_routes([web.get(path, handler) for path, handler in routes.items()])
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def test_probe_tells_sglang_from_an_openai_compatible_server(tmp_path: Path) -> None:
    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "qwen", "root": "/models/qwen"}]})

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": "key"}, status=401)

    tokenizer = build_tokenizer(tmp_path / "tok")

    async def probe() -> list[Any]:
        found: list[Any] = []
        config = SimulatorConfig(port=0, model="sim-8b", tokenizer=str(tokenizer))
        sim = await sim_server.start(config)
        try:
            found.append(await asyncio.to_thread(probe_server, sim.url))
        finally:
            await sim.stop()
        async with serving({"/v1/models": models}) as url:
            found.append(await asyncio.to_thread(probe_server, url))
        async with serving({"/health": models}) as url:
            with pytest.raises(ServerUnreachableError, match="answers neither"):
                await asyncio.to_thread(probe_server, url)
        async with serving({"/v1/models": refuse}) as url:
            with pytest.raises(InferenceRequestError, match=r"set its API key in \$KEY"):
                await asyncio.to_thread(probe_server, url, key_env="KEY")
        return found

    sim, vllm = asyncio.run(probe())
    assert (sim.kind, sim.model, sim.tokenizer) == ("sglang", "sim-8b", str(tokenizer))
    assert (vllm.kind, vllm.model, vllm.tokenizer) == ("openai", "qwen", "/models/qwen")
    with pytest.raises(ServerUnreachableError, match="cannot reach the inference server"):
        probe_server("http://127.0.0.1:1", timeout=2)


def test_init_refuses_an_existing_file_before_asking_anything(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "job.toml"
    out.write_text("# mine\n")
    args = ["init", "--server", "http://127.0.0.1:1", str(tmp_path / "none.jsonl"), "-o", str(out)]
    assert cli.main(args) == 2
    assert capsys.readouterr().err == (
        f"tokenbudget: error: {out} exists: init never writes over a file;"
        " name another with -o, or remove it\n"
    )
    assert out.read_text() == "# mine\n"
    args[-1] = str(tmp_path / "new.toml")
    assert cli.main(args) == 2
    missing = tmp_path / "none.jsonl"
    assert capsys.readouterr().err == (
        f"tokenbudget: error: {missing} does not exist: name a dataset file or folder\n"
    )
