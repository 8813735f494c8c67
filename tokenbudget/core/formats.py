"""What each row format (``[[datasets]] format``) reads, declared once per format.

Every rule that depends on the format reads its row of :data:`FORMAT_TRAITS`, never
its name: the config's accepted values and key doc, the column-mapping keys it
cannot go with, the ``turns`` it allows, whether it has splits, which reader opens
its path. How a format's rows become prompts is its parse function
(``tokenbudget.producers.prompts.rows.PARSERS``, which covers this table);
adding a format is a row here and that function (docs/architecture.md, Adding a
row format).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from tokenbudget.core.columns import TEXT_KEYS, TURNS_KEYS

# How a conversation becomes prompts (tokenbudget.producers.prompts.datasets): its first turn, every
# assistant turn on the dataset's history, or every turn on the model's own answers.
Turns = Literal["first", "all", "regenerate"]
# The turns a plain prompt has: it is its own first turn.
TEXT_TURNS: tuple[Turns, ...] = ("first",)


@dataclass(frozen=True)
class FormatTraits:
    """One row format as the rest of the job sees it."""

    # Its part of `[[datasets]] format`'s key doc, after the name ("" for none).
    doc: str
    # Its rows are chat turns (True) or a plain prompt (False); None: either, told
    # row by row.
    chat: bool | None
    # Its path is a folder saved by Hugging Face datasets' save_to_disk (True), a
    # file (False); None: a folder when the path is one.
    folder: bool | None

    @property
    def turns(self) -> tuple[Turns, ...]:
        """The `turns` values it allows: every one, unless its rows are plain prompts."""
        return TEXT_TURNS if self.chat is False else get_args(Turns)

    @property
    def conflicts(self) -> tuple[str, ...]:
        """The column-mapping keys it cannot go with: a plain prompt's keys for chat
        rows, chat turns' keys for plain prompts."""
        if self.chat is None:
            return ()
        return TEXT_KEYS if self.chat else TURNS_KEYS

    @property
    def splits(self) -> bool:
        """Whether its path may be a saved `DatasetDict`, whose `split` is chosen."""
        return self.folder is not False


FORMAT_TRAITS: Mapping[str, FormatTraits] = {
    "auto": FormatTraits(doc="per row; a folder is `hf`", chat=None, folder=None),
    "prompt": FormatTraits(doc="", chat=False, folder=False),
    "openai": FormatTraits(doc="`messages`", chat=True, folder=False),
    "sharegpt": FormatTraits(doc="`conversations` of `{from, value}`", chat=True, folder=False),
    "hf": FormatTraits(doc="a folder written by `save_to_disk`", chat=None, folder=True),
}

# `[[datasets]] format` when the dataset names none: every row read as it is.
DEFAULT_FORMAT = "auto"

# The accepted values of `[[datasets]] format`, in the table's order (the config's
# refusal lists them so). For the type checker any string: the table is the check.
if TYPE_CHECKING:
    DatasetFormat = str
else:
    DatasetFormat = Literal[tuple(FORMAT_TRAITS)]


def _default_last(names: list[str]) -> list[str]:
    """The formats as messages list them: the default, which reads any row, last."""
    return sorted(names, key=lambda name: name == DEFAULT_FORMAT)


def format_doc() -> str:
    """`[[datasets]] format`'s key doc: every format with what it reads."""
    items = [
        f"`{name}`" + (f" ({FORMAT_TRAITS[name].doc})" if FORMAT_TRAITS[name].doc else "")
        for name in _default_last(list(FORMAT_TRAITS))
    ]
    return ", ".join(items[:-1]) + ", or " + items[-1]


def formats_with(turns: Turns) -> str:
    """The formats whose rows can give ``turns``, as a message lists them."""
    names = _default_last([name for name, t in FORMAT_TRAITS.items() if turns in t.turns])
    return ", ".join(names[:-1]) + " or " + names[-1]
