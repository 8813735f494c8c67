"""The simulator's pure, deterministic generation: an answer's length and ids are a
function of ``(seed, prompt text)`` under a profile's length rules (a rerun reproduces
them), the ids' synthetic text (``_Output``), and the crc32s the request log checks
text and ids by."""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenbudget.core.errors import ConfigError
from tokenbudget.dev.simulator.config import THINK_END, LengthRule


def _rng_for(seed: int, text: str) -> random.Random:
    # Python's hash() is salted per process; a rerun must reproduce the same lengths.
    digest = hashlib.blake2b(
        f"{seed}\x1f{text}".encode("utf-8", "surrogatepass"), digest_size=16
    ).digest()
    return random.Random(int.from_bytes(digest, "big"))


def _rule_for(rules: Sequence[LengthRule], text: str) -> LengthRule:
    for rule in rules:
        if rule.marker in text:
            return rule
    # A profile without a "" rule still needs an answer; the last rule is the catch-all.
    return rules[-1]


def _draw_length(rules: Sequence[LengthRule], rng: random.Random, text: str) -> int:
    rule = _rule_for(rules, text)
    # Parametrise so the distribution's MEAN (not median) is rule.mean: budgets are sums.
    mu = math.log(rule.mean) - rule.sigma * rule.sigma / 2.0
    return max(1, round(rng.lognormvariate(mu, rule.sigma)))


def completion_length(rules: Sequence[LengthRule], seed: int, text: str) -> int:
    """Natural (uncapped) completion length in tokens for ``text`` under ``rules``."""
    if not rules:
        raise ConfigError("simulator.profile", "a profile needs at least one LengthRule")
    return _draw_length(rules, _rng_for(seed, text), text)


def chat_prompt_text(messages: Sequence[dict[str, Any]]) -> str:
    """The prompt text the simulator sees for a chat request: all contents concatenated."""
    parts: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            # OpenAI content-part arrays: only text parts carry prompt text.
            parts.extend(
                p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
    return "".join(parts)


def _generate(
    rules: Sequence[LengthRule],
    seed: int,
    text: str,
    max_new_tokens: int,
    vocab_size: int,
    think_end: int | None = None,
) -> tuple[list[int], str, int, int]:
    """(ids, finish, thinking tokens, natural length): with ``think_end`` (the id
    ending the thinking) the answer thinks first, that id closing its thinking, and no
    other id is it; the natural length is the answer's had max_new_tokens not cut it."""
    rng = _rng_for(seed, text)
    natural = _draw_length(rules, rng, text)
    n = min(natural, max_new_tokens)
    # Ids come from the same stream after the length draw, so a capped answer is a prefix
    # of the uncapped one.
    ids = [int(rng.random() * vocab_size) for _ in range(n)]
    think = 0
    if think_end is not None and natural > 1:
        # Its own stream, so the ids stay those of the same prompt without thinking.
        share = _rng_for(seed, f"think\x1f{text}").uniform(0.3, 0.8)
        think = min(natural - 1, max(1, round(natural * share)))
        ids = [(i + 1) % vocab_size if i == think_end else i for i in ids]
        if think <= n:
            ids[think - 1] = think_end
    return ids, ("length" if natural > max_new_tokens else "stop"), think, natural


def _prompt_ids_from_text(text: str, vocab_size: int) -> list[int]:
    words = text.split()
    if not words:
        return [1]
    return [zlib.crc32(w.encode("utf-8", "surrogatepass")) % vocab_size for w in words]


class _Output:
    """Generated ids and their synthetic text, with cheap prefix/delta slicing. The
    first ``think`` tokens are thinking, the last of them the one ending it."""

    __slots__ = ("_offsets", "_text", "ids", "think")

    def __init__(self, ids: list[int], think: int = 0) -> None:
        self.ids = ids
        self.think = think
        self._text: str | None = None
        self._offsets: list[int] | None = None

    def _render(self) -> tuple[str, list[int]]:
        if self._text is None or self._offsets is None:
            # Each token renders with a leading space (like BPE word tokens), so streamed
            # deltas concatenate to exactly the full text.
            pieces = [f" w{i}" for i in self.ids]
            if 0 < self.think <= len(pieces):
                pieces[self.think - 1] = f" {THINK_END}"
            self._text = "".join(pieces)
            self._offsets = list(itertools.accumulate(map(len, pieces), initial=0))
        return self._text, self._offsets

    def text(self, start: int, end: int) -> str:
        text, offsets = self._render()
        return text[offsets[start] : offsets[end]]

    def reasoning(self, start: int, end: int) -> str:
        """The thinking among tokens ``start:end``, as a reasoning parser sends it
        (without the token ending it)."""
        end = min(end, self.think - 1)
        return self.text(start, end) if end > start else ""

    def answer(self, start: int, end: int) -> str:
        """The answer among tokens ``start:end`` (after the thinking)."""
        start = max(start, self.think)
        return self.text(start, end) if end > start else ""

    def thinking_tokens(self, produced: int) -> int:
        return min(produced, self.think)


def _crc(text: str | None) -> int:
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) if text else 0


def ids_crc(ids: Sequence[int]) -> int:
    """crc32 of token ids as little-endian int32 bytes (how completions carry them)."""
    if not len(ids):
        return 0
    return zlib.crc32(np.asarray(ids, dtype="<i4").tobytes())
