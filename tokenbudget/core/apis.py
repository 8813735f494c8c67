"""What each inference API (``[inference] api``) can do, declared once per API.

Every rule that depends on the API reads its row of :data:`API_TRAITS`, never its
name: the config's accepted values and key doc, its cross-key checks (a chat
template applied here, ``turns = "regenerate"``, ``reasoning = "disable"``), the
pre-run health check, how a request is stopped, which answers carry split-off
reasoning, what ``tokenbudget init`` writes, the simulator's wire formats. The
client of each API is its backend (``tokenbudget.producers.inference.backends``,
whose registry covers this table); adding an API is a backend and a row here
(docs/architecture.md, Adding an inference API).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal


@dataclass(frozen=True)
class ApiTraits:
    """One API as the rest of the job sees it."""

    # Its part of `[inference] api`'s key doc, after the name ("" for none).
    doc: str
    # Takes chat messages and renders them with the server's chat template; else the
    # prompt goes as one raw string or token ids, and chat turns need a template
    # applied here (`template = true`) first.
    chat: bool
    # Served by any OpenAI-compatible server (vLLM, llama.cpp, SGLang too), with its
    # request and error bodies; else a server's own API.
    openai_compatible: bool
    # Stops a request by its id and answers with what it generated; else a request
    # is stopped by closing its connection (what came is lost).
    abort_by_id: bool
    # The GET route that says the server is up (404: it has none, a one-token
    # request is sent instead).
    health_route: str
    # The health route answers the served models (OpenAI's model listing).
    health_lists_models: bool
    # The GET route naming the model's path and the tokenizer's ("": none): asked
    # to check `[inference] model`, and by `tokenbudget init` to tell the API.
    model_info_route: str
    # The answer's fields a reasoning parser splits the thinking into (): the API
    # never splits it off, the thinking stays in the text).
    reasoning_fields: tuple[str, ...]


API_TRAITS: Mapping[str, ApiTraits] = {
    "sglang": ApiTraits(
        doc="native `/generate`",
        chat=False,
        openai_compatible=False,
        abort_by_id=True,
        health_route="/health",
        health_lists_models=False,
        model_info_route="/get_model_info",
        reasoning_fields=(),
    ),
    "openai-completions": ApiTraits(
        doc="`/v1/completions`",
        chat=False,
        openai_compatible=True,
        abort_by_id=False,
        health_route="/v1/models",
        health_lists_models=True,
        model_info_route="",
        reasoning_fields=(),
    ),
    "openai-chat": ApiTraits(
        doc="`/v1/chat/completions`",
        chat=True,
        openai_compatible=True,
        abort_by_id=False,
        health_route="/v1/models",
        health_lists_models=True,
        model_info_route="",
        # SGLang's reasoning parser writes reasoning_content, vLLM's reasoning (older
        # releases reasoning_content): the first that holds text is the thinking.
        reasoning_fields=("reasoning_content", "reasoning"),
    ),
}

# `[inference] api` when the config names none.
DEFAULT_API = "sglang"

# The accepted values of `[inference] api`, in the table's order (the config's
# refusal lists them so). For the type checker any string: the table is the check.
if TYPE_CHECKING:
    Api = str
else:
    Api = Literal[tuple(API_TRAITS)]


def openai_api(*, chat: bool) -> str:
    """The OpenAI-compatible API that takes chat messages (``chat``) or raw text."""
    (name,) = (n for n, t in API_TRAITS.items() if t.openai_compatible and t.chat == chat)
    return name


def api_doc() -> str:
    """`[inference] api`'s key doc: every API with what it is."""
    items = [f"`{name}`" + (f" ({t.doc})" if t.doc else "") for name, t in API_TRAITS.items()]
    return ", ".join(items[:-1]) + " or " + items[-1]
