"""The exports fed to each drafter trainer's own data loader: SpecForge, speculators
and Model-Optimizer read what ``tokenbudget export`` writes, with their own code.

    .venv/bin/python bench/trainers.py [--workdir bench-out/trainers] [--prompts 6]

What it does, in one run:

1. Makes (once) and reuses a venv of its own, ``~/.cache/tokenbudget/trainers-venv``
   (``TOKENBUDGET_TRAINERS_VENV``), with the trainers and torch at the versions
   pinned in :data:`PINS`, and prints them. SpecForge's wheel pins sglang and an exact
   torch: it goes in ``--no-deps``, beside what its data code imports (torch,
   transformers, datasets, tqdm, pydantic). torch comes from PyPI with its CUDA
   libraries; everything here runs on the CPU.
2. Builds a tiny tokenizer offline (``tokenbudget.dev.tiny_tokenizer``) whose chat
   template renders what trainers train on (``reasoning_content``, tool calls, the
   ``{% generation %}`` tags Model-Optimizer's answer-only loss needs), and that
   knows every word the simulator answers with (``w0`` ... ``w31999``, one token
   each), so an answer re-tokenized from its text can be compared with the server's.
3. Runs two jobs on the local broker against one simulator started with that
   tokenizer, a thinking model that calls tools: ``chat`` (``api = "openai-chat"``:
   single-turn answers, ``n = 2``, thinking off; a thinking model's answers, ``n =
   2``; conversations regenerated turn by turn; conversations that call a tool) and
   ``generate`` (SGLang's ``/generate``, the thinking inline, ``n = 2``: chats with
   the template applied here, ``template = true``, and the seed job's path, prompts
   sent as text, whose ids the server does not return).
4. Exports each job in each trainer's format (with and without ``--with-ids`` where
   the format has both) and, as the baseline measured in the same run, in today's
   ``conversations`` (and ``messages``, the shape Model-Optimizer reads) formats.
5. Runs each trainer's own dataset-building code on the files, in the trainers'
   venv (``bench/trainer_loaders/driver.py``): SpecForge's prompt preparation
   (``prepare_prompt_tasks``: its pre-tokenized path, or ``build_eagle3_dataset``),
   speculators' ``load_and_preprocess_dataset``, Model-Optimizer's online collator
   (``ShardedDataset`` + ``LanguageDataCollator``) and its hidden-state datasets'
   tokenization (``StreamingDataset``, which wants a ``conversation_id``).

Graded from outside the export and the trainers: the Parquet rows' token ids, each
checked against the simulator's own request log (a crc32 of the ids it generated,
and of the prompt ids it was sent or answered with), are the server's answers; a
prompt sent as text is checked by the log's crc32 of that text (the prompt's ids
decoded) and the tokens the server counted in it. Per trainer and file
it prints records written, records read, records dropped, and how many samples'
loss is exactly a server answer: for a format with ids, ``input_ids`` equal to the
prompt's ids then the answer's and the loss mask over the answer alone; for a text
format (the trainer tokenizes), each span under the loss, as words, equal to a
server answer (thinking and ``</think>`` included; tool calls are re-rendered by the
template and not compared). Then how many of the job's kept answers the file gives
the trainer so. It exits 1 unless every file of the new formats is read whole by its
trainers, none dropped, every sample's loss is a server answer and every kept answer
is in the file, with no answer's thinking left inline in its text (``</think>`` in
``content``: SpecForge's validators refuse it, and a template that splits the
thinking off the content would see none). Two answers of a prompt (``n = 2``) are
the same ids here (the simulator's answer is a function of the prompt), so either
may stand for the other.

Out of CI and of ``make bench``: it installs torch and three trainers (a few GB,
once). Run it from the checkout's root with the project's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Any

from tokenbudget.app.runner import cli_command, run
from tokenbudget.app.tables import format_table
from tokenbudget.core import config as config_module
from tokenbudget.dev import jobs, tiny_tokenizer
from tokenbudget.dev.oracle import ids_crc
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.settings import BrokerSettings
from tokenbudget.sinks.parquet import read_rows

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "bench" / "trainer_loaders" / "driver.py"
VENV = Path(
    os.environ.get(
        "TOKENBUDGET_TRAINERS_VENV", Path.home() / ".cache" / "tokenbudget" / "trainers-venv"
    )
)
# The trainers' venv. torch and transformers at what SpecForge 0.2.0 pins (speculators
# and Model-Optimizer accept them), datasets at speculators' ceiling.
PINS = {
    "torch": "2.11.0",
    "transformers": "5.8.1",
    "datasets": "5.1.0",
    "specforge": "0.2.0",
    "speculators": "0.9.0",
    "nvidia-modelopt": "0.47.0",
}
# What SpecForge's data code imports beyond torch, transformers and datasets
# (specforge/data/*.py); Model-Optimizer's dataset plugin imports requests.
UNPINNED = ["tqdm", "pydantic", "requests"]
NO_DEPS = {"specforge"}

# The simulator's vocabulary (SimulatorConfig.vocab_size): its answers are these ids,
# each rendered as the word "w<id>".
SIM_VOCAB = 32000
THINK_END = "</think>"
TOOL_MARKERS = ["<tool_call>", "</tool_call>"]
# The target model's template as trainers read it: each turn's reasoning and tool calls
# rendered, texts stripped (as Qwen3's template strips them), the assistant's turns
# inside {% generation %} (Model-Optimizer's answer-only loss; the tag must open on a
# token, not a space, for transformers to find it), and for a prompt what
# tiny_tokenizer.THINKING_TEMPLATE renders.
TRAINER_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|> tools:{% for tool in tools %} {{ tool['function']['name'] }}"
    "{% endfor %} </s> {% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|> {% generation %}"
    "{% if message['reasoning_content'] is defined and message['reasoning_content'] is not none %}"
    "<think> {{ message['reasoning_content'] | trim }} </think> {% endif %}"
    "{% if (message['content'] or '') | trim %}{{ message['content'] | trim }} {% endif %}"
    "{% for call in message['tool_calls'] or [] %}"
    "<tool_call> {{ call['function']['name'] }} </tool_call> {% endfor %}"
    "</s>{% endgeneration %} "
    "{% else %}<|{{ message['role'] }}|> {{ message['content'] or '' }} </s> {% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> <think>"
    "{% if enable_thinking is false or thinking is false %} </think>{% endif %}"
    "{% endif %}"
)
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "search the web",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}
BUDGET = 10_000_000  # more than the jobs take: every dataset runs to its end


@dataclass(frozen=True)
class Variant:
    """One export of a job: the format, its flags, the loaders that read it, and
    whether it is the baseline (today's formats) or a trainer's own."""

    name: str
    format: str
    args: tuple[str, ...]
    loaders: tuple[str, ...]
    _: KW_ONLY
    baseline: bool = False
    options: str = ""  # the driver's options for this file (see driver.py)

    @property
    def carries_ids(self) -> bool:
        return "--with-ids" in self.args or self.format == "speculators"


MODELOPT = ("modelopt-online", "modelopt-streaming")
LAST = "last_turn"  # SpecForge's data.train_only_last_turn (driver.py)
ALL = ("specforge", "speculators", *MODELOPT)
VARIANTS = (
    Variant("specforge", "specforge", (), ("specforge",)),
    # one record per answer on the history it was sent: data.train_only_last_turn
    Variant("specforge-per-turn", "specforge", ("--per-turn",), ("specforge",), options=LAST),
    Variant("specforge-ids", "specforge", ("--with-ids",), ("specforge",)),
    Variant("speculators", "speculators", (), ("speculators",)),
    Variant("modelopt", "modelopt", (), MODELOPT),
    # the baseline: today's formats, to the same loaders (those of ids to the loaders
    # that read ids; Model-Optimizer reads "messages", and "conversations" deprecated)
    Variant("conversations", "conversations", (), ALL, baseline=True),
    Variant("conversations-ids", "conversations", ("--with-ids",), ALL[:2], baseline=True),
    Variant("messages", "messages", (), MODELOPT, baseline=True),
)


# --------------------------------------------------------------------------------------
# The trainers' venv
# --------------------------------------------------------------------------------------


def venv_python() -> Path:
    return VENV / "bin" / "python"


def installed_versions() -> dict[str, str]:
    """The trainers' venv's versions of the pinned packages (missing ones left out)."""
    if not venv_python().exists():
        return {}
    code = (
        "import importlib.metadata as m, json, sys\n"
        "found = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try: found[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(found))"
    )
    out = subprocess.run(
        [str(venv_python()), "-c", code, *PINS, *UNPINNED],
        capture_output=True,
        text=True,
    )
    # a venv that cannot say (half made, its python gone) is made again
    versions: dict[str, str] = json.loads(out.stdout) if out.returncode == 0 else {}
    return versions


def ensure_venv() -> dict[str, str]:
    """The trainers' venv with :data:`PINS` installed (made once, reused)."""
    versions = installed_versions()
    if all(versions.get(name) == pin for name, pin in PINS.items()) and all(
        name in versions for name in UNPINNED
    ):
        return versions
    started = time.monotonic()
    print(f"installing the trainers into {VENV} (once; torch is a few GB)", flush=True)
    if not venv_python().exists():
        step([sys.executable, "-m", "venv", str(VENV)])
    pip = [str(venv_python()), "-m", "pip", "install", "--quiet"]
    constraints = VENV / "constraints.txt"
    constraints.write_text("".join(f"{name}=={pin}\n" for name, pin in PINS.items()))
    with_deps = [f"{n}=={p}" for n, p in PINS.items() if n not in NO_DEPS]
    step([*pip, "-c", str(constraints), *with_deps, *UNPINNED])
    step([*pip, "--no-deps", *[f"{n}=={p}" for n, p in PINS.items() if n in NO_DEPS]])
    print(f"installed in {time.monotonic() - started:.0f} s", flush=True)
    return installed_versions()


def step(command: list[str]) -> None:
    """One step of making the venv; a failure ends the bench with one line (pip has
    said why above it)."""
    if subprocess.run(command).returncode != 0:
        raise SystemExit(
            f"bench/trainers: {' '.join(command[:4])} ... failed: fix it, or remove {VENV} "
            "(TOKENBUDGET_TRAINERS_VENV) to start the venv anew"
        )


# --------------------------------------------------------------------------------------
# The jobs
# --------------------------------------------------------------------------------------


def chat_rows(path: Path, marker: str, count: int) -> Path:
    return jobs.rows(path, marker, count, chat=True)


def conversation_rows(path: Path, count: int, turns: int = 3) -> Path:
    with path.open("w") as out:
        for i in range(count):
            messages: list[dict[str, Any]] = []
            for k in range(turns):
                messages.append({"role": "user", "content": f"#short talk {i} question {k}"})
                messages.append({"role": "assistant", "content": f"recorded answer {k} of {i}"})
            out.write(json.dumps({"id": f"talk-{i}", "messages": messages}) + "\n")
    return path


def tool_rows(path: Path, count: int) -> Path:
    """Conversations that call the tool first, recorded with the call the simulator
    makes (the first tool offered, on the user's words), then answer its result."""
    with path.open("w") as out:
        for i in range(count):
            question = f"#short weather in town {i}"
            call = {"id": f"rec_{i}", "type": "function",
                    "function": {"name": "search", "arguments": {"query": question}}}  # fmt: skip
            messages = [
                {"role": "user", "content": question},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": f"rec_{i}", "content": f"sunny in town {i}"},
                {"role": "assistant", "content": "It is sunny."},
            ]
            out.write(json.dumps({"id": f"tools-{i}", "tools": [SEARCH], "messages": messages}))
            out.write("\n")
    return path


@dataclass
class Job:
    name: str
    datasets: dict[str, tuple[Path, int]]
    keys: dict[str, dict[str, Any]]
    inference: dict[str, Any]
    config: Path = Path()
    rows: list[dict[str, Any]] = field(default_factory=list)  # the kept answers
    served: dict[str, dict[str, Any]] = field(default_factory=dict)  # the log's, by rid


def make_jobs(data: Path, prompts: int, tokenizer: Path) -> list[Job]:
    chat = Job(
        "chat",
        {
            "single": (chat_rows(data / "single.jsonl", "#short", prompts), BUDGET),
            "reasoning": (chat_rows(data / "reasoning.jsonl", "#short", prompts), BUDGET),
            "multi": (conversation_rows(data / "multi.jsonl", max(1, prompts // 2)), BUDGET),
            "tools": (tool_rows(data / "tools.jsonl", max(1, prompts // 2)), BUDGET),
        },
        {
            "single": {"n": 2, "reasoning": "disable"},
            "reasoning": {"n": 2, "reasoning": "save"},
            "multi": {"turns": "regenerate", "reasoning": "save"},
            "tools": {"turns": "regenerate", "reasoning": "save"},
        },
        {"api": "openai-chat"},
    )
    generate = Job(
        "generate",
        {
            "generate": (chat_rows(data / "generate.jsonl", "#short", prompts), BUDGET),
            # the seed job's path: the prompt's text as it is, its ids not returned
            "seed": (jobs.rows(data / "seed.jsonl", "#short", prompts), BUDGET),
        },
        {"generate": {"n": 2, "reasoning": "save"}, "seed": {"n": 2, "reasoning": "save"}},
        {"api": "sglang", "tokenizer": str(tokenizer)},
    )
    return [chat, generate]


def build_tokenizer(folder: Path, datasets: Iterable[Path]) -> Path:
    """The tiny thinking tokenizer, trained on the datasets' words, with every word
    of the simulator's answers one token and :data:`TRAINER_TEMPLATE` its template."""
    corpus = [*tiny_tokenizer.CORPUS, "tools search", *tiny_tokenizer.dataset_corpus(datasets)]
    # "#short" one token, as the simulator counts a text prompt's words
    words = [f"w{i}" for i in range(SIM_VOCAB)] + TOOL_MARKERS + ["#short"]
    tiny_tokenizer.build_tokenizer(folder, corpus, whole_words=words, thinking=True)
    # save_pretrained writes the template beside the tokenizer; this one replaces it
    (folder / "chat_template.jinja").write_text(TRAINER_TEMPLATE)
    return folder


def run_job(job: Job, workdir: Path, url: str, bootstrap: str) -> None:
    folder = workdir / job.name
    folder.mkdir(parents=True)
    job.config = jobs.write_job(
        folder,
        bootstrap,
        f"bench-trainers-{job.name}-{int(time.time())}",
        url,
        job.datasets,
        dataset_keys=job.keys,
        inference=job.inference,
        sink={"path": str(folder / "out"), "flush_interval_s": 1.0},
        metrics={"port": 0},
    )
    started = time.monotonic()
    report = run(config_module.load(job.config), progress=False)
    states = ", ".join(
        f"{name} {r.samples} answers {r.status}" for name, r in sorted(report.datasets.items())
    )
    print(f"job {job.name}: {states} ({time.monotonic() - started:.0f} s)", flush=True)
    job.rows = read_rows(folder / "out").to_pylist()


def verify_rows(job: Job, server_log: Path) -> list[str]:
    """Each kept answer against the server's own log: its ids are the ones the
    server generated, and its prompt's those it was sent or answered with (a prompt
    sent as text has none: the file's are checked against the text, in
    :class:`Answers`). Keeps the log's record of each in ``job.served``; returns what
    differs (nothing, when the pipeline kept what the server said)."""
    log = {}
    for line in server_log.read_text().splitlines():
        record = json.loads(line)
        if not record.get("fault"):
            log[record["rid"]] = record
    problems = []
    for row in job.rows:
        served = log.get(row["request_id"])
        prompt = ids_crc(row["prompt_ids"] or [])
        if served is None:
            problems.append(f"{job.name}: answer {row['request_id']} not in the server's log")
            continue
        job.served[row["request_id"]] = served
        sent = served["prompt_crc"] or served.get("returned_prompt_crc", 0)
        if ids_crc(row["output_ids"] or []) != served["output_crc"]:
            problems.append(f"{job.name}: answer {row['request_id']} ids differ from the log's")
        elif row["prompt_ids"] is not None and sent and prompt != sent:
            problems.append(f"{job.name}: prompt of {row['request_id']} differs from the log's")
        elif row["prompt_ids"] is None and not served["text_crc"]:
            problems.append(f"{job.name}: answer {row['request_id']} has no prompt ids")
    return problems


# --------------------------------------------------------------------------------------
# Exports and loaders
# --------------------------------------------------------------------------------------


@dataclass
class Export:
    job: Job
    variant: Variant
    path: Path
    error: str | None = None
    written: int = 0
    keys: Counter[str] = field(default_factory=Counter)  # top-level keys, in how many records
    said: list[str] = field(default_factory=list)  # what the export warned of
    # the assistant turns of the text records: in all, with reasoning_content, and
    # with the thinking's end inline in content (SpecForge's validators refuse those)
    turns: Counter[str] = field(default_factory=Counter)


def export(job: Job, variant: Variant, folder: Path) -> Export:
    path = folder / job.name / f"{variant.name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    command = cli_command(
        "export", "--config", str(job.config), "--format", variant.format, "--to", str(path),
        *variant.args,
    )  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    result = Export(job, variant, path)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        result.error = lines[-1] if lines else f"exit {done.returncode}"
    else:
        result.said = [line for line in done.stderr.splitlines() if line.strip()]
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        result.written = len(records)
        result.keys.update(key for record in records for key in record)
        for record in records:
            for turn in record.get("conversations") or record.get("messages") or []:
                if turn.get("role") == "assistant":
                    result.turns["assistant"] += 1
                    result.turns["reasoning_content"] += turn.get("reasoning_content") is not None
                    result.turns["inline"] += THINK_END in (turn.get("content") or "")
    return result


def load(loader: str, exports: Sequence[Export], tokenizer: Path, folder: Path) -> dict[Path, Any]:
    """What ``loader`` made of each file, by path: ``{"samples", "error"}``."""
    files = [e for e in exports if e.error is None and loader in e.variant.loaders]
    if not files:
        return {}
    out = folder / f"{loader}.jsonl"
    specs = [f"{e.path}:{e.variant.options}" if e.variant.options else str(e.path) for e in files]
    with (folder / f"{loader}.log").open("w") as log:
        done = subprocess.run(
            [str(venv_python()), str(DRIVER), loader, "--tokenizer", str(tokenizer),
             "--out", str(out), *specs],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the {loader} driver failed (exit {done.returncode}): see {log.name}")
    results = [json.loads(line) for line in out.read_text().splitlines()]
    return {Path(r["file"]): r for r in results}


# --------------------------------------------------------------------------------------
# Judging what the trainers read
# --------------------------------------------------------------------------------------


class Vocabulary:
    """The tokenizer, as the judge reads tokens: each id's token, the id that ends
    the thinking, and the text of ids."""

    def __init__(self, folder: Path) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.tokens: list[str] = self._tokenizer.convert_ids_to_tokens(
            list(range(len(self._tokenizer)))
        )
        self.think_end: int = self._tokenizer.convert_tokens_to_ids(THINK_END)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=False))

    def word(self, token: int) -> str:
        """A server's answer token as the simulator renders it."""
        return THINK_END if token == self.think_end else f"w{token}"


@dataclass(frozen=True)
class Expected:
    """A kept answer's prompt as the server had it: its ids, or (a prompt sent as
    text) the crc32 of that text and the tokens the server counted in it."""

    prompt: tuple[int, ...] | None
    text_crc: int
    prompt_tokens: int


class Answers:
    """A job's kept answers, as a trainer's samples are compared with them: by the
    answer's ids, with the prompt's before them and the mask over the answer alone
    (formats with ids); by the answer's words as the simulator renders them (text
    formats; not the tool calls, which the template renders from the call, not from
    the ids)."""

    def __init__(self, job: Job, vocabulary: Vocabulary) -> None:
        self.vocabulary = vocabulary
        self.by_output: dict[tuple[int, ...], list[Expected]] = {}
        self.words: Counter[tuple[str, ...]] = Counter()
        for row in job.rows:
            served = job.served.get(row["request_id"], {})
            prompt = tuple(row["prompt_ids"]) if row["prompt_ids"] is not None else None
            expected = Expected(prompt, served.get("text_crc", 0), row["prompt_tokens"] or 0)
            output = tuple(row["output_ids"] or ())
            self.by_output.setdefault(output, []).append(expected)
            if not row["tool_calls"]:
                self.words[tuple(vocabulary.word(i) for i in output)] += 1

    def matches(self, expected: Expected, prompt: list[int]) -> bool:
        if expected.prompt is not None:
            return tuple(prompt) == expected.prompt
        text = self.vocabulary.decode(prompt).encode()
        return len(prompt) == expected.prompt_tokens and zlib.crc32(text) == expected.text_crc


@dataclass
class Verdict:
    loader: str
    export: Export
    read: int = 0
    error: str | None = None
    equal: int = 0  # samples whose loss is exactly a server answer
    # text samples whose loss is only tool calls, which the template renders from the
    # call (the simulator's ids for a call are not its text): not compared
    calls: int = 0
    covered: int = 0  # kept answers the file gives the trainer so
    expected: int = 0  # kept answers that could be compared

    @property
    def dropped(self) -> int:
        return max(0, self.export.written - self.read)

    @property
    def ok(self) -> bool:
        if self.error is not None or self.export.error is not None or self.dropped:
            return False
        if self.export.turns["inline"]:  # the thinking left in the answer's text
            return False
        return self.equal + self.calls == self.read and self.covered == self.expected


def spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The runs of tokens under the loss."""
    runs: list[list[int]] = []
    previous = 0
    for token, bit in zip(ids, mask, strict=True):
        if bit and not previous:
            runs.append([])
        if bit:
            runs[-1].append(token)
        previous = bit
    return runs


def judge(loader: str, exported: Export, result: Any, answers: Answers) -> Verdict:
    verdict = Verdict(loader, exported, error=result["error"] if result else None)
    samples = result["samples"] if result else []
    verdict.read = len(samples)
    if exported.variant.carries_ids:
        judge_ids(verdict, samples, answers)
    else:
        judge_text(verdict, samples, answers)
    return verdict


def judge_ids(verdict: Verdict, samples: list[Any], answers: Answers) -> None:
    """A sample is a server answer when its mask is 0 over a prompt then 1 over an
    answer, the answer's ids are the server's and the prompt's the ones it had."""
    remaining = {output: list(prompts) for output, prompts in answers.by_output.items()}
    verdict.expected = sum(len(prompts) for prompts in remaining.values())
    for ids, mask in samples:
        start = mask.index(1) if 1 in mask else len(mask)
        if mask != [0] * start + [1] * (len(mask) - start):
            continue
        candidates = remaining.get(tuple(ids[start:]), [])
        prompt = ids[:start]
        found = next((e for e in candidates if answers.matches(e, prompt)), None)
        if found is not None:
            candidates.remove(found)
            verdict.equal += 1
    verdict.covered = verdict.expected - sum(len(prompts) for prompts in remaining.values())


def judge_text(verdict: Verdict, samples: list[Any], answers: Answers) -> None:
    """A sample is the server's answers when each span under its loss, as words,
    is one (what the template adds around them left out)."""
    remaining = Counter(answers.words)
    verdict.expected = sum(remaining.values())
    tokens = answers.vocabulary.tokens
    for ids, mask in samples:
        runs = [[tokens[t] for t in run] for run in spans(ids, mask)]
        compared = [
            tuple(w for w in run if w == THINK_END or (w[:1] == "w" and w[1:].isdigit()))
            for run in runs
            if TOOL_MARKERS[0] not in run
        ]
        matched = 0
        for words in compared:
            if remaining[words] > 0:
                remaining[words] -= 1
                matched += 1
        if not compared:
            verdict.calls += 1
        elif matched == len(compared):
            verdict.equal += 1
    verdict.covered = verdict.expected - sum(remaining.values())


# --------------------------------------------------------------------------------------
# The report
# --------------------------------------------------------------------------------------


def print_report(verdicts: list[Verdict], exports: list[Export]) -> None:
    headers = ["trainer", "file", "kind", "written", "read", "dropped",
               "loss = a server answer", "kept answers in it", "ok"]  # fmt: skip
    rows = []
    for v in verdicts:
        variant = v.export.variant
        how = "ids" if variant.carries_ids else "text"
        calls = f" (+{v.calls} calls)" if v.calls else ""
        rows.append([
            v.loader,
            f"{v.export.job.name}/{variant.name}.jsonl",
            "today" if variant.baseline else "new",
            v.export.written,
            "-" if v.error else v.read,
            "-" if v.error else v.dropped,
            "-" if v.error else f"{how} {v.equal}/{v.read - v.calls}" + calls,
            "-" if v.error else f"{v.covered}/{v.expected}",
            "-" if variant.baseline else ("yes" if v.ok else "NO"),
        ])  # fmt: skip
    print()
    print(format_table(headers, rows))
    print()
    for e in exports:
        if e.error is None:
            keys = ", ".join(k if n == e.written else f"{k} ({n})" for k, n in e.keys.items())
            print(f"{e.job.name}/{e.variant.name}.jsonl, keys: {keys}")
            if e.turns:
                print(
                    f"  assistant turns {e.turns['assistant']}: with reasoning_content "
                    f"{e.turns['reasoning_content']}, {THINK_END} inline in content "
                    f"{e.turns['inline']}"
                )
            for line in e.said:
                print(f"  export said: {line}")
    refused = [e for e in exports if e.error is not None]
    failed = [v for v in verdicts if v.error is not None]
    if refused or failed:
        print()
    for e in refused:
        kind = "today's" if e.variant.baseline else "new"
        print(f"export refused ({kind}) {e.job.name}/{e.variant.name}: {e.error}")
    for v in failed:
        print(f"{v.loader} refused {v.export.job.name}/{v.export.variant.name}.jsonl: {v.error}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", default="bench-out/trainers")
    parser.add_argument("--prompts", type=int, default=6, help="rows per single-turn dataset")
    parser.add_argument(
        "--only", default="", metavar="NAMES", help="only these exports (comma-separated)"
    )
    args = parser.parse_args()
    variants = [v for v in VARIANTS if not args.only or v.name in args.only.split(",")]
    workdir = Path(args.workdir).resolve()
    shutil.rmtree(workdir, ignore_errors=True)  # the simulator appends to its log
    (workdir / "data").mkdir(parents=True)
    versions = ensure_venv()
    print("trainers' venv:", ", ".join(f"{n} {versions.get(n, '?')}" for n in [*PINS, *UNPINNED]))
    tokenizer = workdir / "tokenizer"
    job_list = make_jobs(workdir / "data", args.prompts, tokenizer)
    build_tokenizer(tokenizer, [p for j in job_list for p, _ in j.datasets.values()])
    settings = BrokerSettings.from_env()
    broker.up(settings, [])
    server = jobs.start_simulator(
        workdir, "--tokenizer", str(tokenizer), "--reasoning-style", "reasoning_content",
        "--tool-calls", "--tokens-per-second", "4000",
    )  # fmt: skip
    try:
        for job in job_list:
            run_job(job, workdir, server.url, settings.bootstrap)
    finally:
        server.stop()
    problems = [p for job in job_list for p in verify_rows(job, server.log)]
    kept = sum(len(job.rows) for job in job_list)
    print(f"{kept} answers kept, {kept - len(problems)} equal to the server's log")
    exports = [export(job, v, workdir / "exports") for job in job_list for v in variants]
    loaded = {loader: load(loader, exports, tokenizer, workdir) for loader in ALL}
    vocabulary = Vocabulary(tokenizer)
    answers = {job.name: Answers(job, vocabulary) for job in job_list}
    verdicts = [
        judge(loader, e, loaded[loader].get(e.path), answers[e.job.name])
        for e in exports
        for loader in e.variant.loaders
        if e.error is None
    ]
    print_report(verdicts, exports)
    new = [v for v in verdicts if not v.export.variant.baseline]
    refused = [e for e in exports if e.error is not None and not e.variant.baseline]
    ok = not problems and not refused and bool(new) and all(v.ok for v in new)
    for problem in problems:
        print(problem)
    print()
    print("every new file read whole, none dropped, ids the server's" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
