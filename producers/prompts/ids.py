"""Prompt ids: a hash of the dataset name and the row's identity, its ``id`` when it has
one, else its content (with an occurrence number, so two identical rows stay two
prompts), plus the turn for ``turns = "all"``. The same file therefore yields the
same ids on every run, in any order (``order``, ``shuffle_seed``:
:mod:`tokenbudget.producers.prompts.order`), which is what lets a resumed run
recognise work already done.
"""

from __future__ import annotations

import hashlib
import json

from tokenbudget.streams.fields import ChatMessage


def stable_prompt_id(dataset: str, identity: str) -> str:
    return hashlib.blake2b(f"{dataset}\x00{identity}".encode(), digest_size=16).hexdigest()


def turn_prompt_id(dataset: str, conversation_id: str, turn: int) -> str:
    """The prompt id of a regenerated conversation's turn ``turn`` (from 0): stable,
    so whoever builds that turn's prompt, on any run, gives it the same id."""
    return stable_prompt_id(dataset, f"{conversation_id}@turn{turn}")


def content_identity(text: str | None, messages: tuple[ChatMessage, ...] | None) -> str:
    content = (
        text if text is not None else json.dumps([[m.role, m.content] for m in messages or ()])
    )
    return "content:" + hashlib.blake2b(content.encode(), digest_size=16).hexdigest()
