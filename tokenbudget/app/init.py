"""``tokenbudget init``: a job's config, written from its datasets and its server.

The server is asked which API it speaks and what it serves
(:func:`tokenbudget.producers.inference.backends.probe_server`); each dataset's first rows are read
as
``run`` reads them, and the column mapping their fields need comes from the same
suggestions ``run``'s checks make
(:func:`tokenbudget.producers.prompts.dataset_checks.describe_dataset`).
Chat rows need a chat template: applied here with the server's tokenizer when the
server names one that is on this machine, else by the server (``api =
"openai-chat"``, which SGLang and vLLM both serve). The file is checked as ``run``
checks it (config, then the datasets) before it is written, and never over another.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenbudget.core import config as config_module
from tokenbudget.core.apis import API_TRAITS, Api, openai_api
from tokenbudget.core.errors import ConfigError, TokenBudgetError
from tokenbudget.producers.inference.backends import ServerInfo
from tokenbudget.producers.prompts.dataset_checks import (
    DatasetShape,
    check_datasets,
    describe_dataset,
)
from tokenbudget.producers.templates import load_tokenizer

# The budget written when none is given: a number ``run`` takes, marked to be set.
PLACEHOLDER_BUDGET = "1M"
CONCURRENCY = 64
MAX_NEW_TOKENS = 4096


@dataclass(frozen=True)
class Found:
    """A dataset file and what its first rows hold."""

    name: str
    path: Path
    shape: DatasetShape


def dataset_names(paths: Sequence[Path]) -> list[str]:
    """A config name per file: its stem in the letters ``[[datasets]] name`` takes,
    made unique with a number."""
    names: list[str] = []
    for path in paths:
        base = re.sub(r"[^A-Za-z0-9_.\-]+", "_", path.stem if path.suffix else path.name) or "data"
        name, count = base, 1
        while name in names:
            count += 1
            name = f"{base}_{count}"
        names.append(name)
    return names


def find_datasets(paths: Sequence[Path]) -> list[Found]:
    for path in paths:
        if not path.exists():
            raise TokenBudgetError(f"{path} does not exist: name a dataset file or folder")
    names = dataset_names(paths)
    return [
        Found(name, path, describe_dataset(path, f"datasets[{i}]", str(path)))
        for i, (name, path) in enumerate(zip(names, paths, strict=True))
    ]


@dataclass(frozen=True)
class Choice:
    """The API to send with, and the tokenizer that applies chat templates here."""

    api: Api
    tokenizer: Path | None
    why: str  # one comment line


def local_tokenizer(server: ServerInfo) -> Path | None:
    """The tokenizer the server names, when it is a folder on this machine that
    loads (templates applied here, and prompts counted by ``plan``)."""
    if not server.tokenizer:
        return None
    folder = Path(server.tokenizer).expanduser()
    if not folder.is_dir():
        return None
    try:
        load_tokenizer(folder)
    except ConfigError:
        return None
    return folder


def choose_api(server: ServerInfo, chat: bool, tokenizer: Path | None) -> Choice:
    """SGLang's /generate takes text or ids: chat rows need the template applied
    here (``tokenizer``), else its OpenAI chat API applies it. An OpenAI-compatible
    server gets chat rows through its chat API, plain prompts as they are."""
    chat_api = openai_api(chat=True)
    native = API_TRAITS.get(server.kind)  # the API whose model-info route answered
    if native is not None:
        if not chat or tokenizer is not None:
            why = f"SGLang's /generate (GET {native.model_info_route} answered)"
            return Choice(server.kind, tokenizer, why)
        named = f" ({server.tokenizer} is not on this machine)" if server.tokenizer else ""
        why = f"SGLang's OpenAI chat API: the server applies the chat template{named}"
        return Choice(chat_api, None, why)
    if chat:
        why = "OpenAI-compatible chat: the server applies the chat template"
        return Choice(chat_api, tokenizer, why)
    why = f"OpenAI-compatible completions: prompts sent as they are ({chat_api}: as a user turn)"
    return Choice(openai_api(chat=False), tokenizer, why)


def _toml(value: str) -> str:
    """A TOML basic string (JSON's escapes are TOML's)."""
    return json.dumps(value)


def _relative(path: Path, folder: Path) -> str:
    """``path`` as the config writes it: relative to the config's folder when inside
    it (the config then moves with its data), else absolute."""
    path = path.resolve()
    try:
        return str(path.relative_to(folder.resolve()))
    except ValueError:
        return str(path)


def _dataset_lines(found: Found, folder: Path, budget: str | None, template: bool) -> list[str]:
    shape = found.shape
    what = "chat turns" if shape.chat else "prompts"
    lines = [
        "",
        "[[datasets]]",
        f"name = {_toml(found.name)}",
        f"path = {_toml(_relative(found.path, folder))}  # {shape.read_as}: {what}"
        f" in {shape.prompts:,} of its first {shape.rows:,} rows",
        f"budget = {_toml(budget or PLACEHOLDER_BUDGET)}"
        + ("  # from --budget" if budget else "  # set me: the tokens of answers to keep"),
    ]
    if shape.mapping is not None:
        key, value = shape.mapping
        lines.append(f"{key} = {_toml(value)}  # its rows' fields: {shape.fields}")
    if template and shape.chat:
        lines.append("template = true  # chat: its template applied here ([inference] tokenizer)")
    return lines


def config_text(
    server: ServerInfo,
    found: Sequence[Found],
    folder: Path,
    *,
    budget: str | None = None,
) -> str:
    chat = any(f.shape.chat for f in found)
    choice = choose_api(server, chat, local_tokenizer(server))
    lines = [
        f"# A tokenbudget job, written by `tokenbudget init` from {len(found)} dataset(s) and",
        f"# the server at {server.url}. Set each budget (and max_new_tokens), then see what",
        "# the budgets buy before spending them, and run:",
        "#   tokenbudget plan --config <this file> --pilot 20",
        "#   tokenbudget run --config <this file>",
        "# Every key is in docs/reference/config.md (`tokenbudget --help`: the commands).",
        "",
        "# The job is this file: a rerun of it resumes the job, a copy of it under another",
        '# name is another job ([job] name = "..." names it otherwise).',
        "",
        "[kafka]",
        'bootstrap = "local"  # the project\'s own broker, started when needed; or "HOST:PORT"',
        "",
        "[inference]",
        f"url = {_toml(server.url)}",
        f"api = {_toml(choice.api)}  # {choice.why}",
    ]
    if server.model:
        lines.append(f"model = {_toml(server.model)}  # as the server names it; run checks it")
    lines += [
        f"concurrency = {CONCURRENCY}  # requests in flight at once",
        f"max_new_tokens = {MAX_NEW_TOKENS}  # the longest answer asked for: what the model allows",
    ]
    if choice.tokenizer is not None:
        lines.append(
            f"tokenizer = {_toml(str(choice.tokenizer))}  # the server's, on this machine:"
            " counts prompts, applies chat templates"
        )
    lines += [
        "",
        "[budget]",
        'unit = "completion_tokens"  # or "total_tokens", "samples"',
        "",
        "[sink]",
        'path = "out"  # Parquet, a folder per dataset (relative to this file)',
    ]
    for f in found:
        template = not API_TRAITS[choice.api].chat and choice.tokenizer is not None
        lines += _dataset_lines(f, folder, budget, template)
    return "\n".join(lines) + "\n"


def write_config(text: str, out: Path) -> None:
    """Check ``text`` as ``run`` would, then write it to ``out``, never over a file."""
    config = config_module.build(
        tomllib.loads(text),
        source=str(out),
        base_dir=out.resolve().parent,
        environ={},
    )
    check_datasets(config)
    try:
        with out.open("x") as handle:
            handle.write(text)
    except FileExistsError:
        raise exists(out) from None


def exists(out: Path) -> TokenBudgetError:
    return TokenBudgetError(
        f"{out} exists: init never writes over a file; name another with -o, or remove it"
    )
