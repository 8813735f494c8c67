"""What a dataset's name may be: one rule for the config and for every event that
names a dataset.

A name becomes a folder under the sink's path, a Prometheus label, a Kafka key and a
line in ``status``, and events come from outside: a name such as ``../../x``, one
with a NUL byte or an escape code, or one longer than a file name may be must never
get that far. Hence letters, digits, ``_``, ``-`` and ``.``, starting with a letter,
digit or ``_`` (so never ``.``, ``..`` nor a hidden or option-like name), at most
:data:`MAX_DATASET_NAME` characters.
"""

from __future__ import annotations

import re

MAX_DATASET_NAME = 200
DATASET_NAME_PATTERN = rf"^[A-Za-z0-9_][A-Za-z0-9_.\-]{{0,{MAX_DATASET_NAME - 1}}}$"
_DATASET_NAME = re.compile(DATASET_NAME_PATTERN)
DATASET_NAME_RULE = (
    "use letters, digits, '_', '-' and '.', starting with a letter, digit or '_', "
    f"at most {MAX_DATASET_NAME} characters"
)


def dataset_name_problem(name: str) -> str | None:
    """Why ``name`` is not a dataset's name, or None."""
    if _DATASET_NAME.fullmatch(name) is None:
        return f"{name[: MAX_DATASET_NAME + 20]!r}: {DATASET_NAME_RULE}"
    return None
