"""The prompt template's rule: ``{field}`` required, ``{field?}`` optional, and a
paragraph (text between blank lines) holding an optional field that is missing, null
or blank is left out with its blank line (the Alpaca convention)."""

from __future__ import annotations

from typing import Any

import pytest

from tokenbudget.core.columns import Columns, FieldError, PromptTemplate, TemplateError, field_text

ALPACA = PromptTemplate.parse("{instruction}\n\n{input?}")
# Stanford Alpaca's own prompt, with and without an input, as one template
ALPACA_HEADERS = PromptTemplate.parse(
    "Below is an instruction that describes a task.\n\n"
    "### Instruction:\n{instruction}\n\n"
    "### Input:\n{input?}\n\n"
    "### Response:\n"
)


@pytest.mark.parametrize(
    "row",
    [
        {"instruction": "Sum these"},
        {"instruction": "Sum these", "input": None},
        {"instruction": "Sum these", "input": ""},
        {"instruction": "Sum these", "input": " \n\t"},
    ],
    ids=["missing", "null", "empty", "blank"],
)
def test_an_optional_field_without_a_value_leaves_its_paragraph_out(row: dict[str, Any]) -> None:
    assert ALPACA.render(row) == "Sum these"
    assert ALPACA_HEADERS.render(row) == (
        "Below is an instruction that describes a task.\n\n"
        "### Instruction:\nSum these\n\n"
        "### Response:\n"
    )


def test_an_optional_field_with_a_value_is_kept_as_written() -> None:
    row = {"instruction": "Sum these", "input": "1 2 3\n", "output": "6"}
    assert ALPACA.render(row) == "Sum these\n\n1 2 3\n"
    row["input"] = "1 2 3"
    assert ALPACA_HEADERS.render(row) == (
        "Below is an instruction that describes a task.\n\n"
        "### Instruction:\nSum these\n\n"
        "### Input:\n1 2 3\n\n"
        "### Response:\n"
    )


def test_text_between_placeholders_is_kept_exactly() -> None:
    template = PromptTemplate.parse("Q: {question}\n\n\nA {{literal}} {hint?}\n\n\n\nEnd")
    row = {"question": "why?", "hint": "think"}
    assert template.render(row) == "Q: why?\n\n\nA {literal} think\n\n\n\nEnd"
    # the paragraph "\nA {literal} {hint?}" goes, its blank line with it
    assert template.render({"question": "why?"}) == "Q: why?\n\n\n\nEnd"


@pytest.mark.parametrize(
    ("row", "problem"),
    [
        ({}, "field 'instruction' is missing (write {instruction?} if it may be)"),
        ({"instruction": None}, "field 'instruction' is null"),
        ({"instruction": "  "}, "field 'instruction' is empty"),
        ({"instruction": 7}, "field 'instruction' must be a string, got int"),
        ({"instruction": "x", "input": ["a"]}, "field 'input' must be a string, got list"),
    ],
)
def test_a_required_field_without_text_names_the_field(row: dict[str, Any], problem: str) -> None:
    with pytest.raises(FieldError) as info:
        ALPACA.render(row)
    assert str(info.value).startswith(problem)


def test_a_prompt_field_is_a_non_blank_string() -> None:
    assert field_text({"question": "why?"}, "question") == "why?"
    with pytest.raises(FieldError, match=r"^field 'question' is empty$"):
        field_text({"question": ""}, "question")
    with pytest.raises(FieldError, match=r"^field 'question' is missing$"):
        field_text({"query": "why?"}, "question")


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{}", "{}: a placeholder is {field} or {field?}"),
        ("{input!r}", "{input!r}: a placeholder is"),
        ("{input:>10}", "{input}: a placeholder is"),
        ("{ input }", "{ input }: a placeholder is"),
        ("{a?b}", "{a?b}: a placeholder is"),
        ("{instruction", "(write {{ or }} for a literal brace)"),
        ("answer}", "(write {{ or }} for a literal brace)"),
        ("just text {{no field}}", "no {field} in it"),
        ("{instruction}\n{input?}", "{input?} shares a paragraph with other fields"),
        ("{a?} {b?}", "{a?} shares a paragraph with other fields ({a?}, {b?})"),
    ],
)
def test_templates_that_cannot_work_say_why(template: str, message: str) -> None:
    with pytest.raises(TemplateError) as info:
        PromptTemplate.parse(template)
    assert message in str(info.value)


def test_the_mapping_key_is_the_one_set() -> None:
    assert Columns().mapping is None and Columns().key == ""
    assert Columns(prompt_field="question").mapping == ("prompt_field", "question")
    assert Columns(prompt_template=ALPACA).mapping == ("prompt_template", ALPACA.source)
    assert Columns(messages_field="dialog").key == "messages_field"
