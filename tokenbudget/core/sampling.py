"""The sampling settings, declared once.

:class:`Sampling` is what a request may ask of the sampler beside its length. The
config's ``[inference]`` and ``[[datasets]]`` sections take these keys
(:mod:`tokenbudget.core.config`), the prompt and completion events carry them
(``tokenbudget.streams.fields.SamplingParams``, with the budget's ``max_new_tokens``), the
Parquet sink stores them in a column whose type is derived from these fields
(``tokenbudget.sinks.schema.SAMPLING_TYPE``), and the simulator logs them under these names. A
setting added here reaches all of them.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from tokenbudget.core.keydoc import doc


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling settings, all optional: unset ones are left to the server. Each
    says what it is for the config's reference (:func:`tokenbudget.core.keydoc.doc`)."""

    temperature: Annotated[float | None, doc("sampling: the temperature")] = None
    top_p: Annotated[float | None, doc("sampling: nucleus sampling's probability mass")] = None
    top_k: Annotated[int | None, doc("sampling: the most likely tokens sampled from")] = None
    min_p: Annotated[float | None, doc("sampling: the least probability, relative to the top")] = (
        None
    )
    repetition_penalty: Annotated[float | None, doc("sampling: the repetition penalty")] = None
    frequency_penalty: Annotated[float | None, doc("sampling: the frequency penalty")] = None
    presence_penalty: Annotated[float | None, doc("sampling: the presence penalty")] = None
    stop: Annotated[list[str] | None, doc("sampling: strings that end an answer")] = None
    seed: Annotated[
        int | None,
        doc(
            "sampling: the seed (SGLang's `sampling_seed`); with `n` answers per prompt, "
            "answer *k* is sent `seed + k`, so they differ and are reproducible"
        ),
    ] = None
    chat_template_kwargs: Annotated[
        dict[str, Any] | None,
        doc(
            "a table for the chat template (e.g. `{enable_thinking = false}`): applied with "
            '`template = true`, sent with `api = "openai-chat"`'
        ),
    ] = None
    extra_body: Annotated[
        dict[str, Any] | None,
        doc(
            "a table sent verbatim in every request's JSON body (SGLang and OpenAI alike), "
            "for server options tokenbudget has no key for"
        ),
    ] = None


SAMPLING_KEYS: tuple[str, ...] = Sampling.__struct_fields__
# Sent beside the settings rather than as one: its keys go into the request's body.
VERBATIM_KEY = "extra_body"
