"""Whole jobs as a user runs them, for the fault tests and the chaos harness
(developer tools; the product does not import this): the simulator as a process of
its own (its request log is the oracle's ground truth), ``tokenbudget run`` as a
process of its own (so it can be killed), and the processes it starts found by the
parent pid they were given."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tokenbudget.app.children import cli_command
from tokenbudget.core import lifetime
from tokenbudget.core.apis import API_TRAITS, DEFAULT_API
from tokenbudget.core.lifetime import PARENT_ENV
from tokenbudget.dev import tiny_tokenizer
from tokenbudget.dev.demo import wait_for_simulator
from tokenbudget.dev.ports import free_port
from tokenbudget.producers.prompts.dataset_checks import first_chat_row
from tokenbudget.sinks.reading import read_to_end
from tokenbudget.streams import events as ev
from tokenbudget.streams.budget_board import BudgetBoard, BudgetWatcher
from tokenbudget.streams.topics import Topics


@dataclass
class Simulator:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def outage(self, seconds: float) -> None:
        httpx.post(f"{self.url}/sim/outage", json={"seconds": seconds}, timeout=5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(10)


def start_simulator(
    workdir: Path, *args: str, port: int | None = None, name: str = "server"
) -> Simulator:
    """A simulator process, its request log ``<name>-requests.jsonl`` in ``workdir``
    (one per server of a fleet; started again on the same port, it appends to it)."""
    port = port or free_port()
    log = workdir / f"{name}-requests.jsonl"
    command = cli_command(
        "simulate", "--port", str(port), "--profile", "demo", "--log-file", str(log), *args
    )
    out_file = "simulator.out" if name == "server" else f"{name}.out"
    with (workdir / out_file).open("ab") as out:
        process = lifetime.spawn(command, stdout=out, stderr=subprocess.STDOUT)
    wait_for_simulator(process, port)
    return Simulator(process, port, log)


def rows(path: Path, marker: str, count: int, chat: bool = False) -> Path:
    with path.open("w") as handle:
        for i in range(count):
            text = f"{marker} {path.stem} task {i}"
            row: dict[str, Any] = {"id": f"{path.stem}-{i}"}
            if chat:
                row["messages"] = [{"role": "user", "content": text}]
            else:
                row["prompt"] = text
            handle.write(json.dumps(row) + "\n")
    return path


def conversations(path: Path, count: int, turns: int) -> Path:
    """``count`` recorded conversations of ``turns`` user turns each, every one
    answered, ids ``c0``, ``c1``...: for jobs that regenerate them (short answers:
    the simulator reads the ``#short`` marker)."""
    with path.open("w") as handle:
        for i in range(count):
            messages = []
            for k in range(turns):
                question = f"#short conversation {i}, question {k}"
                messages.append({"role": "user", "content": question})
                messages.append({"role": "assistant", "content": f"recorded answer {k} of {i}"})
            handle.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")
    return path


def write_job(
    workdir: Path,
    bootstrap: str,
    namespace: str,
    url: str | list[str],
    datasets: dict[str, tuple[Path, int]],
    *,
    dataset_keys: dict[str, dict[str, Any]] | None = None,
    **sections: dict[str, Any],
) -> Path:
    """A job config; ``sections`` override keys, e.g. ``budget={"lease_ttl_s": 3}``;
    ``dataset_keys`` adds keys to the named datasets, e.g. ``{"A": {"turns": "all"}}``;
    ``url``: the server, or a list of them (a ``[[inference.servers]]`` table each)."""
    fleet = [url] if isinstance(url, str) else url
    settings: dict[str, dict[str, Any]] = {
        "kafka": {"bootstrap": bootstrap, "namespace": namespace},
        "inference": {
            "api": DEFAULT_API,
            "concurrency": 8,
            "max_new_tokens": 4096,
            "backoff_s": 0.1,
            "backoff_max_s": 1.0,
            "read_timeout_s": 60.0,
            "health_interval_s": 0.5,
            "prompt_hold_s": 20.0,
        },
        "budget": {"lease_ttl_s": 4.0},
        "sink": {"path": "out", "flush_interval_s": 1.0},
    }
    for section, keys in sections.items():
        settings.setdefault(section, {}).update(keys)
    chats = template_chats(workdir, datasets, settings["inference"])
    lines = []
    for section, keys in settings.items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
        if section == "inference" and len(fleet) == 1 and "servers" not in keys:
            lines.append(f"url = {json.dumps(fleet[0])}")
        elif section == "inference" and "servers" not in keys:
            lines += [f"[[inference.servers]]\nurl = {json.dumps(u)}" for u in fleet]
    for name, (path, budget) in datasets.items():
        lines += ["[[datasets]]", f'name = "{name}"', f'path = "{path}"', f"budget = {budget}"]
        lines += ["template = true"] if name in chats else []
        lines += [f"{k} = {json.dumps(v)}" for k, v in (dataset_keys or {}).get(name, {}).items()]
    config = workdir / "job.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


def template_chats(
    workdir: Path, datasets: dict[str, tuple[Path, int]], inference: dict[str, Any]
) -> set[str]:
    """The chat datasets to send templated: a raw-text API refuses them untemplated.
    They get a tiny tokenizer trained on their prompts (distinct prompts, distinct
    ids), set in ``inference`` as [inference] tokenizer."""
    if API_TRAITS[inference.get("api", DEFAULT_API)].chat:
        return set()
    chats = {name for name, (path, _) in datasets.items() if first_chat_row(path)}
    if chats and not inference.get("tokenizer"):
        corpus = tiny_tokenizer.dataset_corpus(datasets[name][0] for name in sorted(chats))
        folder = workdir / "tokenizer"
        tiny_tokenizer.build_tokenizer(folder, [*tiny_tokenizer.CORPUS, *corpus])
        inference["tokenizer"] = str(folder)
    return chats


def start_run(config: Path, *args: str, log: Path | None = None) -> subprocess.Popen[bytes]:
    """``tokenbudget run --json`` in a session of its own, as a user's shell starts it
    (and ending with the caller, should the caller die first)."""
    with (log or config.parent / "run.out").open("ab") as out:
        return lifetime.spawn(
            cli_command("run", "--config", str(config), "--json", *args),
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "TOKENBUDGET_LOG": "INFO"},
        )


def end_run(process: subprocess.Popen[bytes] | None) -> None:
    """Kill a run a failed test left behind (its children end with it)."""
    if process is not None and process.poll() is None:
        process.kill()
        process.wait()


def children_of(pid: int) -> dict[int, str]:
    """Processes started for ``pid`` (found by the parent pid in their environment,
    which stays true after the parent is gone): pid -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if f"{PARENT_ENV}={pid}".encode() in environ:
            found[int(entry.name)] = cmdline
    return found


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def kill_tree_root(process: subprocess.Popen[bytes]) -> dict[int, str]:
    """SIGKILL the process alone (not its children), as the OOM killer does; return
    the children it had, for the caller to check that none outlives it."""
    children = children_of(process.pid)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    return children


def survivors(children: dict[int, str], grace: float = 40) -> dict[int, str]:
    """Those of ``children`` still running after ``grace`` seconds."""
    deadline = time.monotonic() + grace
    alive = dict(children)
    while alive and time.monotonic() < deadline:
        alive = {pid: cmd for pid, cmd in alive.items() if _running(pid)}
        time.sleep(0.2)
    return alive


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU of a live process (every thread), None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][0]
    except OSError:
        return False
    return state != "Z"


def snapshots(bootstrap: str, namespace: str) -> dict[str, ev.LedgerSnapshot]:
    board = BudgetBoard()
    read_to_end(bootstrap, Topics(namespace).budgets, board.apply)
    return {n: v.snapshot for n, v in board.views.items() if v.snapshot is not None}


def run_output(process: subprocess.Popen[bytes], log: Path) -> dict[str, Any]:
    """The JSON ``run --json`` printed (the last JSON object in its output)."""
    text = log.read_text()
    start = text.rfind('\n{\n  "datasets"')
    assert start >= 0, text[-3000:]
    return json.loads(text[start : text.index("\n}", start) + 2])


class Watch:
    """The budgets topic followed in a thread of its own, as any reader follows it."""

    def __init__(self, bootstrap: str, namespace: str) -> None:
        self.board = BudgetBoard()
        self._loop = asyncio.new_event_loop()
        self._watcher = BudgetWatcher(bootstrap, Topics(namespace), self.board)
        started = threading.Event()

        def main() -> None:
            asyncio.set_event_loop(self._loop)

            async def follow() -> None:
                await self._watcher.start()
                started.set()
                try:
                    await self._watcher.run()
                finally:
                    await self._watcher.stop()

            self._task = self._loop.create_task(follow())
            with contextlib.suppress(BaseException):
                self._loop.run_until_complete(self._task)

        self._thread = threading.Thread(target=main, daemon=True)
        self._thread.start()
        started.wait(60)

    def statuses(self) -> dict[str, str]:
        return {n: v.snapshot.status for n, v in list(self.board.views.items()) if v.snapshot}

    def samples(self) -> int:
        return sum(v.snapshot.samples for v in list(self.board.views.values()) if v.snapshot)

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(30)
