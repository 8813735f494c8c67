"""The one way a tokenizer is loaded: from a local folder, never downloaded.

The folder is what ``save_pretrained`` writes (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``...). ``transformers`` is imported
only when a folder is loaded (it takes seconds, and most commands never need it),
with the Hugging Face hub switched offline: a folder that lacks a file fails here
instead of fetching it from the network. The config's tokenizer
(``tokenbudget.producers.templates``), ``replay --recount-with`` and ``export --tokenizer`` all
load theirs here.

A folder may ship its tokenizer as Python code, named by an ``auto_map`` in its
``tokenizer_config.json`` (Kimi-K2's tiktoken tokenizer): loading it runs that code,
so it is loaded only when trusted (``[inference] trust_remote_code``), and refused
otherwise, before ``transformers`` would fall back to a built-in class that is not
the folder's tokenizer.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tokenbudget.core.errors import TokenizerCodeError, TokenizerError
from tokenbudget.core.extras import require

# Set before transformers is first imported (it reads them then), unless the user
# set them: no download, and no advice on stderr for every process that loads one.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}
# What trusts a folder's own code: the config's key, and for the commands that take a
# folder on their command line (export --tokenizer, replay --recount-with) their flag.
TRUST_KEY = "[inference] trust_remote_code = true"
TRUST_FLAG = f"--trust-remote-code (or {TRUST_KEY} in --config)"


def load_pretrained(
    folder: Path, origin: str, *, trust_remote_code: bool = False, trusted_by: str = TRUST_KEY
) -> Any:
    """The ``transformers`` tokenizer saved in ``folder``. ``origin`` is the config
    key or command flag the folder came from: :class:`TokenizerError` names it when
    the folder is missing or holds no tokenizer, :class:`TokenizerCodeError` (naming
    ``trusted_by``) when it ships code and ``trust_remote_code`` is off, and
    :class:`~tokenbudget.core.extras.MissingExtraError` when transformers is missing."""
    if not folder.is_dir():
        raise TokenizerError(origin, folder, "not a folder")
    code = shipped_code(folder)
    if code and not trust_remote_code:
        raise _untrusted(origin, folder, code, trusted_by)
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
    transformers = require("transformers", origin)
    try:
        return transformers.AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError) as exc:
        if "trust_remote_code" in str(exc):  # code named elsewhere (its config.json)
            raise _untrusted(origin, folder, [], trusted_by) from exc
        raise TokenizerError(origin, folder, f"cannot load a tokenizer: {exc}") from exc


def shipped_code(folder: Path) -> list[str]:
    """The Python files ``folder``'s ``tokenizer_config.json`` maps its tokenizer to
    (``auto_map``), empty when it names none."""
    try:
        settings = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []  # no readable settings: transformers says what is wrong with them
    auto_map = settings.get("auto_map") if isinstance(settings, dict) else None
    if isinstance(auto_map, dict):
        auto_map = auto_map.get("AutoTokenizer")
    if not isinstance(auto_map, (list, tuple)):
        return []
    # "module.Class", or "repo--module.Class" for code kept in another repository
    modules = {ref.split("--")[-1].rpartition(".")[0] for ref in auto_map if isinstance(ref, str)}
    return sorted(f"{module}.py" for module in modules if module)


def _untrusted(origin: str, folder: Path, code: list[str], trusted_by: str) -> TokenizerCodeError:
    named = f" ({', '.join(code)}, named by auto_map in its tokenizer_config.json)" if code else ""
    return TokenizerCodeError(
        origin,
        folder,
        f"ships its own tokenizer code{named}, which runs only with {trusted_by} "
        "(it executes that code)",
    )
