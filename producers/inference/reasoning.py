"""Whether a thinking model's kept answer began: the rule that marks a row
``unfinished``, in one place.

A row is unfinished when it stopped on ``length`` or ``budget`` before its answer
began: every kept token was thinking. How that is told, in order:

1. the server reported ``reasoning_tokens``: no kept token beyond them;
2. the server split the reasoning off (``reasoning`` is set): the answer is blank;
3. raw text (``/generate``, ``/v1/completions``, or a chat server without a reasoning
   parser) of a dataset that declared it thinks (``reasoning = "save"``): nothing
   but blanks follows the last end-of-thinking marker (``[inference]
   reasoning_end``, ``</think>`` by default), or there is none;
4. otherwise it cannot be told, and the row is not marked.

An answer cut at the budget's line keeps its ids but no text: rule 1 applies to the
part kept; without reasoning_tokens, the cut answer is unfinished when the whole
answer the server generated was.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tokenbudget.core import metrics
from tokenbudget.core.apis import API_TRAITS

if TYPE_CHECKING:
    from tokenbudget.core.config import Config
    from tokenbudget.core.sections import ReasoningMode
    from tokenbudget.producers.inference.generation import GenerationResult
    from tokenbudget.streams.events import CompletionEvent
    from tokenbudget.streams.fields import StopReason

log = logging.getLogger(__name__)

# Stop reasons that cut an answer (the model did not end it).
CUT = frozenset({"length", "budget"})


def answer_began(result: GenerationResult, *, raw_thinks: bool, end_marker: str) -> bool | None:
    """Whether the answer after the thinking began (rules 1-3), None when it cannot
    be told. ``raw_thinks``: the dataset declared that the model thinks, so raw text
    is read for ``end_marker``."""
    if result.reasoning_tokens is not None:
        return result.completion_tokens > result.reasoning_tokens
    if result.reasoning is not None:
        return bool(result.text.strip())
    if raw_thinks and end_marker and result.text:
        _, marker, after = result.text.rpartition(end_marker)
        return bool(marker) and bool(after.strip())
    return None


def unfinished(
    kept: GenerationResult,
    generated: GenerationResult,
    stop_reason: StopReason,
    *,
    raw_thinks: bool,
    end_marker: str,
) -> bool:
    """Whether the kept answer was cut before it began (see the module's rules).
    ``generated`` is the whole answer, ``kept`` what of it fits the request and the
    budget."""
    if stop_reason not in CUT:
        return False
    if kept.completion_tokens < generated.completion_tokens and kept.reasoning_tokens is None:
        # Cut here, as ids only: its text is gone, the whole answer's tells.
        kept = generated
    began = answer_began(kept, raw_thinks=raw_thinks, end_marker=end_marker)
    return began is False


class ReasoningRows:
    """What a dispatcher does about each kept answer's reasoning: marks it unfinished
    (the rules above, with each dataset's ``reasoning`` mode), warns once per
    dataset that asked to save reasoning the server does not send, and counts the
    split of the kept tokens between thinking and answer."""

    def __init__(
        self, modes: Mapping[str, ReasoningMode | None], end_marker: str, api: str, url: str
    ) -> None:
        self.modes = dict(modes)
        self.end_marker = end_marker
        self.api = api
        self.url = url
        self.warned: set[str] = set()

    @classmethod
    def for_config(cls, config: Config) -> ReasoningRows:
        inference = config.inference
        modes = {d.name: d.reasoning for d in config.datasets}
        urls = ", ".join(server.url for server in config.servers)
        return cls(modes, inference.reasoning_end, inference.api, urls)

    def unfinished(
        self,
        dataset: str,
        kept: GenerationResult,
        generated: GenerationResult,
        stop_reason: StopReason,
    ) -> bool:
        saves = self.modes.get(dataset) == "save"
        if saves and API_TRAITS[self.api].reasoning_fields:
            self._warn_if_unsplit(dataset, generated)
        return unfinished(
            kept, generated, stop_reason, raw_thinks=saves, end_marker=self.end_marker
        )

    def _warn_if_unsplit(self, dataset: str, generated: GenerationResult) -> None:
        if generated.reasoning is not None or generated.reasoning_tokens is not None:
            return
        if dataset in self.warned:
            return
        self.warned.add(dataset)
        log.warning(
            'dataset %s has reasoning = "save", but an answer from the inference server '
            "at %s came with no reasoning field (message.reasoning_content or "
            "message.reasoning; said once per dataset): a server started without "
            "--reasoning-parser NAME (the model's parser, e.g. qwen3, deepseek-r1, "
            "kimi_k2) leaves the thinking inside the answer's text",
            dataset,
            self.url,
        )

    @staticmethod
    def count(event: CompletionEvent) -> None:
        """The kept answer's tokens by part, and whether it was unfinished."""
        parts = metrics.COMPLETION_TOKEN_PARTS
        tokens, thinking = event.completion_tokens, event.reasoning_tokens
        if thinking is None:
            parts.labels(dataset=event.dataset, part="unsplit").inc(tokens)
        else:
            parts.labels(dataset=event.dataset, part="reasoning").inc(thinking)
            parts.labels(dataset=event.dataset, part="answer").inc(tokens - thinking)
        if event.unfinished:
            metrics.UNFINISHED_ANSWERS.labels(dataset=event.dataset).inc()
