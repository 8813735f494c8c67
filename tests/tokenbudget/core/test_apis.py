"""The inference APIs' traits table: the one list of APIs, which the config accepts,
the backends, the simulator's routes and the key's doc all cover."""

from __future__ import annotations

import pytest

from tokenbudget.core.apis import API_TRAITS, DEFAULT_API, api_doc, openai_api
from tokenbudget.core.config import build
from tokenbudget.core.errors import ConfigError
from tokenbudget.dev.simulator.server import ROUTES
from tokenbudget.producers.inference.backends import BACKENDS


def test_the_backends_the_table_and_the_config_have_the_same_apis() -> None:
    assert set(BACKENDS) == set(API_TRAITS)
    for api in API_TRAITS:
        assert build({"inference": {"api": api}}, environ={}).inference.api == api
    with pytest.raises(ConfigError) as info:
        build({"inference": {"api": "vllm"}}, environ={})
    listed = ", ".join(repr(api) for api in API_TRAITS)
    assert str(info.value).endswith(f"'vllm' is not a valid value; use one of {listed}")


def test_each_backend_is_the_one_of_its_row() -> None:
    assert {api: backend.api for api, backend in BACKENDS.items()} == {a: a for a in API_TRAITS}


def test_the_simulator_serves_every_api() -> None:
    assert set(ROUTES) == set(API_TRAITS)


def test_the_default_and_the_doc_come_from_the_table() -> None:
    assert DEFAULT_API in API_TRAITS
    assert build({}, environ={}).inference.api == DEFAULT_API
    assert api_doc() == (
        "`sglang` (native `/generate`), `openai-completions` (`/v1/completions`) or "
        "`openai-chat` (`/v1/chat/completions`)"
    )


def test_the_traits_the_branches_read() -> None:
    chat, completions, sglang = (
        API_TRAITS["openai-chat"],
        API_TRAITS["openai-completions"],
        API_TRAITS["sglang"],
    )
    assert (openai_api(chat=True), openai_api(chat=False)) == ("openai-chat", "openai-completions")
    assert [name for name, t in API_TRAITS.items() if t.chat] == ["openai-chat"]
    assert [name for name, t in API_TRAITS.items() if t.abort_by_id] == ["sglang"]
    assert (sglang.health_route, sglang.model_info_route) == ("/health", "/get_model_info")
    assert not sglang.health_lists_models and not sglang.openai_compatible
    for openai in (chat, completions):
        assert (openai.health_route, openai.model_info_route) == ("/v1/models", "")
        assert openai.health_lists_models and openai.openai_compatible
    assert chat.reasoning_fields == ("reasoning_content", "reasoning")
    assert completions.reasoning_fields == sglang.reasoning_fields == ()
