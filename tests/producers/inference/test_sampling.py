"""Every generation setting a user configures reaches the server, in each API's own
shape, as the server's request log records it; per dataset over [inference]."""

from __future__ import annotations

from typing import Any

import pytest

from tests.producers.inference.test_backends import FAST, request, with_simulator
from tokenbudget.core.config import build
from tokenbudget.core.sampling import SAMPLING_KEYS
from tokenbudget.dev.simulator.server import RunningSimulator
from tokenbudget.producers.inference.backends import make_backend
from tokenbudget.producers.inference.http import HttpClient
from tokenbudget.streams import codec
from tokenbudget.streams import events as ev
from tokenbudget.streams.fields import ChatMessage, SamplingParams

SETTINGS: dict[str, Any] = {
    "temperature": 0.6,
    "top_p": 0.95,
    "top_k": 20,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "frequency_penalty": 0.2,
    "presence_penalty": 0.3,
    "stop": ["</answer>", "\n\n\n"],
    "seed": 1234,
    "chat_template_kwargs": {"enable_thinking": False},
    "extra_body": {"priority": 3, "lora_path": "drafter-a"},
}


def test_every_setting_has_a_config_key_and_an_event_field() -> None:
    assert set(SAMPLING_KEYS) == set(SETTINGS)
    assert set(SAMPLING_KEYS) <= set(SamplingParams.__struct_fields__)


def test_a_dataset_overrides_inference_key_by_key(tmp_path: Any) -> None:
    config = build(
        {
            "inference": {"temperature": 0.7, "top_p": 0.9, "stop": ["END"]},
            "datasets": [
                {"name": "a", "path": "a.jsonl", "budget": 10, "top_p": 0.5, "seed": 7},
                {"name": "b", "path": "b.jsonl", "budget": 10},
            ],
        },
        environ={},
    )
    a, b = config.datasets
    assert a.sampling == {"temperature": 0.7, "top_p": 0.5, "stop": ["END"], "seed": 7}
    assert b.sampling == {"temperature": 0.7, "top_p": 0.9, "stop": ["END"]}
    event = SamplingParams(max_new_tokens=100, **a.sampling)
    assert event.request_fields() == a.sampling  # the budget's max_new_tokens apart
    # unset settings take no room in the event
    assert b"top_k" not in codec.encode(
        ev.PromptEvent(prompt_id="p", dataset="b", text="t", sampling=event)
    )


@pytest.mark.parametrize("api", ["sglang", "openai-completions", "openai-chat"])
def test_each_setting_reaches_the_server_in_its_api_shape(api: str) -> None:
    async def body(sim: RunningSimulator, client: HttpClient) -> Any:
        backend = make_backend(api, client, sim.url, model=FAST.model)
        kwargs: dict[str, Any] = {"text": "Tell me a story #short"}
        if api == "openai-chat":
            kwargs = {"messages": (ChatMessage(role="user", content="hi #short"),)}
        await backend.generate(
            request(
                f"{api}-sampling",
                max_new_tokens=50,
                sampling=SETTINGS,
                **kwargs,
            )
        )
        return list(sim.log)

    [record] = with_simulator(body)
    assert record.extra == SETTINGS["extra_body"]  # verbatim, beside the settings
    wire = {k: v for k, v in SETTINGS.items() if k not in ("extra_body", "chat_template_kwargs")}
    if api == "sglang":
        wire["sampling_seed"] = wire.pop("seed")  # SGLang's name in sampling_params
    if api == "openai-chat":
        wire["chat_template_kwargs"] = SETTINGS["chat_template_kwargs"]
    assert record.sampling == wire
