"""The order a dataset's prompts are sent in, which decides what a budget keeps.

A budget stops a dataset part way, so the prompts it keeps are a prefix of the order
they were sent in (``[[datasets]] order``):

* ``file``: the file's order. A file sorted by length, by source or by difficulty
  gives a prefix that is not like the rest.
* ``shuffled``: a seeded shuffle (``shuffle_seed``); a prefix of k prompts is a
  random sample, like the source up to sampling noise (of the order of 1/√k).
* ``stratified``: every prefix holds each part of the source in proportion. The
  prompts are sorted by their key (``stratify_by``: the prompt's length, or a field of
  the row), ties in a seeded random order; the sorted list is split in halves, each
  half ordered the same way, and the two orders merged alternately, the half that
  goes first drawn from the seed. A prefix of k prompts then holds ⌈k/2⌉ or ⌊k/2⌋ of
  each half, of each quarter within those, and so on down, so for any key value x
  the number of prefix prompts below x is k·F(x) (F: the source's share below x) to
  within one prompt per level, ⌈log2 n⌉ at most, whatever k. The Kolmogorov-Smirnov
  distance of a prefix from its source is therefore at most ⌈log2 n⌉/k (measured:
  under 5/k for n up to 5,000), where a random prefix's is of the order 1/√k.

A field's values are ordered as None (a row without it), then numbers, then text, then
anything else by its JSON; a categorical field (a source name) is thereby grouped, and
each group is represented in proportion in every prefix.

Order never changes a prompt id: :mod:`tokenbudget.producers.prompts.datasets` fixes ids in file
order
before it orders the prompts.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from tokenbudget.streams.fields import ChatMessage

T = TypeVar("T")


def prompt_length(text: str | None, messages: Sequence[ChatMessage] | None) -> int:
    """The length ``stratify_by = "prompt_length"`` orders by: characters of the
    prompt (of every message's content for chat), which needs no tokenizer."""
    if messages:
        return sum(len(m.content) for m in messages)
    return len(text or "")


def sort_key(value: Any) -> tuple[int, Any]:
    """A total order over a field's values, whatever their types."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return (0, 0)
    if isinstance(value, (int, float)):
        return (1, value)
    if isinstance(value, str):
        return (2, value)
    return (3, json.dumps(value, sort_keys=True, default=str))


def stratified(items: Sequence[T], key: Callable[[T], Any], seed: int) -> list[T]:
    """``items`` in stratified order by ``key`` (see the module docstring); the same
    seed gives the same order."""
    rng = random.Random(seed)
    shuffled = list(items)
    rng.shuffle(shuffled)  # ties keep this seeded order through the stable sort
    ordered = sorted(shuffled, key=lambda item: sort_key(key(item)))
    return _interleave(ordered, rng)


def _interleave(ordered: list[T], rng: random.Random) -> list[T]:
    if len(ordered) <= 1:
        return ordered
    half = len(ordered) // 2
    first = _interleave(ordered[:half], rng)
    second = _interleave(ordered[half:], rng)
    if rng.random() < 0.5:
        first, second = second, first
    merged: list[T] = []
    for index in range(max(len(first), len(second))):
        if index < len(first):
            merged.append(first[index])
        if index < len(second):
            merged.append(second[index])
    return merged
