"""The sampling settings, declared once.

:class:`Sampling` is what a request may ask of the sampler beside its length. The
config's ``[inference]`` and ``[[datasets]]`` sections take these keys
(:mod:`tokenbudget.config`), the prompt and completion events carry them
(``streams.events.SamplingParams``, with the budget's ``max_new_tokens``), the
Parquet sink stores them in a column whose type is derived from these fields
(``sinks.parquet.SAMPLING_TYPE``), and the simulator logs them under these names. A
setting added here reaches all of them.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Sampling(msgspec.Struct, frozen=True, kw_only=True):
    """Sampling settings, all optional: unset ones are left to the server."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: list[str] | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {enable_thinking = false}
    extra_body: dict[str, Any] | None = None  # sent verbatim in every request's body


SAMPLING_KEYS: tuple[str, ...] = Sampling.__struct_fields__
# Sent beside the settings rather than as one: its keys go into the request's body.
VERBATIM_KEY = "extra_body"
