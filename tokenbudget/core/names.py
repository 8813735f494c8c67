"""What a dataset's name and a job's may be: one rule each, for the config and for
every event that names a dataset; and the name of a job whose config gives none.

A name becomes a folder under the sink's path, a Prometheus label, a Kafka key and a
line in ``status``, and events come from outside: a name such as ``../../x``, one
with a NUL byte or an escape code, or one longer than a file name may be must never
get that far. Hence letters, digits, ``_``, ``-`` and ``.``, starting with a letter,
digit or ``_`` (so never ``.``, ``..`` nor a hidden or option-like name), at most
:data:`MAX_DATASET_NAME` characters.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

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


# ------------------------------------------------------------------------------- jobs

# A namespace prefixes every topic and group of a job: Kafka takes letters, digits,
# '.', '_' and '-' in a topic name; '.' is what separates the namespace from the
# topic's role, so it is not the namespace's.
_NAMESPACE = re.compile(r"[A-Za-z0-9_\-]{1,100}")
NAMESPACE_RULE = "use letters, digits, '_' and '-' (at most 100)"
# The job of a config built from no file (a library's caller, a test): the namespace
# every job shared before jobs had names.
UNNAMED_JOB = "tokenbudget"


def namespace_problem(name: str) -> str | None:
    """Why ``name`` cannot name a job's topics, or None."""
    return None if _NAMESPACE.fullmatch(name) else f"{name[:120]!r}: {NAMESPACE_RULE}"


def job_name_of(config_file: Path) -> str:
    """A config file's job, when it names none: its file name's stem, then a short
    hash of its absolute path, so that the ``job.toml`` of two folders are two jobs,
    and a rerun of the same file is the same one."""
    path = config_file.expanduser().resolve()
    stem = re.sub(r"[^A-Za-z0-9_\-]+", "-", path.stem).strip("-")[:60] or "job"
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    return f"{stem}-{digest}"
