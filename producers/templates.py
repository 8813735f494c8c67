"""The model's tokenizer, loaded from a local folder: chat templates and counts.

Two uses, both optional (``[inference] tokenizer``):

* ``template = true`` datasets: the chat template is applied here and the prompt is
  sent as ``input_ids``, so the prompt tokens recorded are exactly the ids sent;
* servers that return neither usage nor token ids: completions and prompts are
  counted with the tokenizer, and the completion says so (``count_source``).

The folder is loaded by :func:`tokenbudget.core.tokenizer.load_pretrained` (nothing is
downloaded, ``transformers`` is imported only then).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenbudget.core.errors import ConfigError, TokenizerCodeError, TokenizerError
from tokenbudget.core.extras import require
from tokenbudget.core.tokenizer import load_pretrained
from tokenbudget.streams.fields import ChatMessage

if TYPE_CHECKING:
    from tokenbudget.core.config import Config


class LocalTokenizer:
    """A thin, thread-safe wrapper over a ``transformers`` tokenizer."""

    def __init__(self, tokenizer: Any, path: Path) -> None:
        self._tokenizer = tokenizer
        self.path = path
        # Rust tokenizers are not re-entrant across threads while truncation or
        # padding settings change; one lock keeps every call simple and safe.
        self._lock = threading.Lock()

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tokenizer, "chat_template", None))

    def apply_chat_template(
        self, messages: Sequence[ChatMessage], options: Mapping[str, Any] | None = None
    ) -> list[int]:
        """The ids a server would build for these messages, ready for an answer;
        ``options`` are the template's own switches (``chat_template_kwargs``)."""
        if not self.has_chat_template:
            raise ConfigError("inference.tokenizer", f"{self.path} has no chat_template to apply")
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        with self._lock:
            ids = self._tokenizer.apply_chat_template(
                conversation,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                **(options or {}),
            )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # older/newer transformers
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        with self._lock:
            text = self._tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=False
            )
        return str(text)

    def encode(self, text: str, *, special: bool) -> list[int]:
        with self._lock:
            return [int(i) for i in self._tokenizer.encode(text, add_special_tokens=special)]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens left out."""
        with self._lock:
            return str(self._tokenizer.decode(list(ids), skip_special_tokens=True))

    def count_prompt(self, text: str | None, messages: Sequence[ChatMessage] | None) -> int:
        """Prompt tokens as the server counts them: the chat template for messages
        (when there is one), the text with the model's special tokens otherwise."""
        if messages:
            if self.has_chat_template:
                return len(self.apply_chat_template(messages))
            text = "\n".join(m.content for m in messages)
        return len(self.encode(text or "", special=True))

    def count_completion(self, text: str) -> int:
        return len(self.encode(text, special=False)) if text else 0


@functools.lru_cache(maxsize=8)
def _load(path: str, trust_remote_code: bool) -> LocalTokenizer:
    folder = Path(path)
    try:
        tokenizer = load_pretrained(
            folder, "[inference] tokenizer", trust_remote_code=trust_remote_code
        )
    except TokenizerCodeError as exc:
        raise ConfigError("inference.trust_remote_code", f"{folder}: {exc.reason}") from exc
    except TokenizerError as exc:
        raise ConfigError("inference.tokenizer", f"{folder}: {exc.reason}") from exc
    require("jinja2", "chat templates")
    return LocalTokenizer(tokenizer, folder)


def load_tokenizer(path: str | Path, *, trust_remote_code: bool = False) -> LocalTokenizer:
    """Load (once per process) the tokenizer saved in ``path``; ``trust_remote_code``
    runs the code the folder ships, if any (else such a folder is refused)."""
    return _load(str(Path(path).resolve()), trust_remote_code)


def config_tokenizer(config: Config) -> LocalTokenizer | None:
    """``[inference] tokenizer``, loaded as ``[inference] trust_remote_code`` says;
    None when the config names none."""
    if config.tokenizer_path is None:
        return None
    return load_tokenizer(
        config.tokenizer_path, trust_remote_code=config.inference.trust_remote_code
    )
