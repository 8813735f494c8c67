"""The one way a tokenizer is loaded: from a local folder, never downloaded.

The folder is what ``save_pretrained`` writes (``tokenizer.json``,
``tokenizer_config.json``, ``chat_template.jinja``...). ``transformers`` is imported
only when a folder is loaded (it takes seconds, and most commands never need it),
with the Hugging Face hub switched offline: a folder that lacks a file fails here
instead of fetching it from the network. The config's tokenizer
(``tokenbudget.producers.tokenizers``), ``replay --recount-with`` and ``export --tokenizer`` all
load theirs here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tokenbudget.core.errors import TokenizerError
from tokenbudget.core.extras import require

# Set before transformers is first imported (it reads them then), unless the user
# set them: no download, and no advice on stderr for every process that loads one.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TRANSFORMERS_VERBOSITY": "error",
}


def load_pretrained(folder: Path, origin: str) -> Any:
    """The ``transformers`` tokenizer saved in ``folder``. ``origin`` is the config
    key or command flag the folder came from: :class:`TokenizerError` names it when
    the folder is missing or holds no tokenizer, and
    :class:`~tokenbudget.core.extras.MissingExtraError` when transformers is missing."""
    if not folder.is_dir():
        raise TokenizerError(origin, folder, "not a folder")
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
    transformers = require("transformers", origin)
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise TokenizerError(origin, folder, f"cannot load a tokenizer: {exc}") from exc
