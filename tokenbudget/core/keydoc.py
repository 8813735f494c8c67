"""A config key's description, declared with the key."""

from __future__ import annotations

import msgspec


def doc(description: str) -> msgspec.Meta:
    """A config key's description, where the key is declared (``Annotated[type,
    doc("...")]``): the one line of it in docs/reference/config.md, which
    docs/gen_reference.py writes from these."""
    return msgspec.Meta(description=description)
