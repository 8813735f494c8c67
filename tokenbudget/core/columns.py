"""Where a dataset's rows hold the prompt: the column mapping of ``[[datasets]]``
(``prompt_field``, ``prompt_template``, ``messages_field``, ``id_field``) and the
rule of a prompt template, in one place.

A template is text with placeholders. ``{name}`` is the row's field ``name``, which
must be a non-blank string; ``{name?}`` is an optional field. The template's
*paragraphs* are the text between blank lines (``\\n\\n``): a paragraph holding an
optional field whose value is missing, null or blank is left out, with its blank
line. So ``"{instruction}\\n\\n{input?}"`` is the instruction alone when the input is
empty, else the instruction, a blank line and the input (the Alpaca convention). An
optional field's paragraph holds no other field, so leaving it out never drops a
field that has a value. ``{{`` and ``}}`` are literal braces.

Parsing raises :class:`TemplateError` (config names the key); rendering a row
raises :class:`FieldError` (the reader names file and line).
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

PARAGRAPH_BREAK = "\n\n"

# The [[datasets]] keys that say where the prompt is (at most one is set): those of a
# plain prompt and those of chat turns. A format of the other kind cannot go with
# them (tokenbudget.core.formats: FormatTraits.conflicts).
TEXT_KEYS = ("prompt_field", "prompt_template")
TURNS_KEYS = ("messages_field",)
MAPPING_KEYS = TEXT_KEYS + TURNS_KEYS


class TemplateError(ValueError):
    """A prompt template that cannot be parsed, with what to write instead."""


class FieldError(ValueError):
    """A row's field cannot fill the template: ``field`` is missing, blank or not text."""

    def __init__(self, field: str, problem: str) -> None:
        self.field = field
        super().__init__(f"field {field!r} {problem}")


@dataclass(frozen=True)
class Placeholder:
    name: str
    optional: bool


Paragraph = tuple[str | Placeholder, ...]


def is_blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _parse_paragraph(text: str) -> Paragraph:
    pieces: list[str | Placeholder] = []
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:  # a lone { or }
        raise TemplateError(f"{exc} (write {{{{ or }}}} for a literal brace)") from exc
    for literal, name, spec, conversion in parsed:
        if literal:
            pieces.append(literal)
        if name is None:
            continue
        placeholder = "{" + name + (f"!{conversion}" if conversion else "") + "}"
        if conversion or spec:
            raise TemplateError(f"{placeholder}: a placeholder is {{field}} or {{field?}}")
        optional = name.endswith("?")
        field = name.removesuffix("?")
        if not field or field != field.strip() or "?" in field:
            raise TemplateError(f"{placeholder}: a placeholder is {{field}} or {{field?}}")
        pieces.append(Placeholder(field, optional))
    return tuple(pieces)


@dataclass(frozen=True)
class PromptTemplate:
    source: str
    paragraphs: tuple[Paragraph, ...]

    @classmethod
    def parse(cls, source: str) -> PromptTemplate:
        paragraphs = tuple(_parse_paragraph(p) for p in source.split(PARAGRAPH_BREAK))
        for paragraph in paragraphs:
            fields = [p for p in paragraph if isinstance(p, Placeholder)]
            optional = [p.name for p in fields if p.optional]
            if optional and len(fields) > 1:
                others = ", ".join(f"{{{p.name}{'?' if p.optional else ''}}}" for p in fields)
                raise TemplateError(
                    f"{{{optional[0]}?}} shares a paragraph with other fields ({others}), "
                    "which would be left out with it: put a blank line (\\n\\n) between them"
                )
        template = cls(source, paragraphs)
        if not template.fields:
            raise TemplateError("no {field} in it: name the row's fields, e.g. {question}")
        return template

    @property
    def fields(self) -> tuple[Placeholder, ...]:
        return tuple(p for par in self.paragraphs for p in par if isinstance(p, Placeholder))

    def render(self, row: Mapping[str, Any]) -> str:
        """The prompt for ``row`` ("" when every paragraph was left out)."""
        kept = []
        for paragraph in self.paragraphs:
            optional = [p for p in paragraph if isinstance(p, Placeholder) and p.optional]
            if optional and is_blank(row.get(optional[0].name)):
                continue
            kept.append(
                "".join(
                    p if isinstance(p, str) else _text(row, p.name, in_template=True)
                    for p in paragraph
                )
            )
        return PARAGRAPH_BREAK.join(kept)


def _text(row: Mapping[str, Any], name: str, in_template: bool) -> str:
    value = row.get(name)
    hint = f" (write {{{name}?}} if it may be)" if in_template else ""
    if value is None:
        raise FieldError(name, ("is null" if name in row else "is missing") + hint)
    if not isinstance(value, str):
        raise FieldError(name, f"must be a string, got {type(value).__name__}")
    if not value.strip():
        raise FieldError(name, "is empty" + hint)
    return value


def field_text(row: Mapping[str, Any], name: str) -> str:
    """``row[name]`` as a prompt: a non-blank string, else :class:`FieldError`."""
    return _text(row, name, in_template=False)


DEFAULT_ID_FIELD = "id"


@dataclass(frozen=True)
class Columns:
    """Where a dataset's rows hold the prompt. The defaults are the rows as they
    always were: ``prompt``, ``messages`` or ``conversations``, and ``id``."""

    prompt_field: str = ""
    prompt_template: PromptTemplate | None = None
    messages_field: str = ""
    id_field: str = DEFAULT_ID_FIELD

    @property
    def mapping(self) -> tuple[str, str] | None:
        """The ``[[datasets]]`` key that says where the prompt is, and its value."""
        if self.prompt_field:
            return "prompt_field", self.prompt_field
        if self.prompt_template is not None:
            return "prompt_template", self.prompt_template.source
        return ("messages_field", self.messages_field) if self.messages_field else None

    @property
    def key(self) -> str:
        return self.mapping[0] if self.mapping else ""

    def settings(self) -> dict[str, str]:
        """The ``[[datasets]]`` keys set away from their defaults, as written."""
        settings = dict([self.mapping]) if self.mapping else {}
        if self.id_field != DEFAULT_ID_FIELD:
            settings["id_field"] = self.id_field
        return settings


DEFAULT_COLUMNS = Columns()
