"""A small tokenizer built offline for tests: no hub, no download.

The builder lives in :mod:`tokenbudget.dev.tiny_tokenizer` (the demo uses it too); the
tests keep importing these names from here.
"""

from __future__ import annotations

from tokenbudget.dev.tiny_tokenizer import CHAT_TEMPLATE, CORPUS, SPECIAL, build_tokenizer

__all__ = ["CHAT_TEMPLATE", "CORPUS", "SPECIAL", "build_tokenizer"]
