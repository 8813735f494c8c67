"""``tokenbudget run`` as a user starts it, on configs that cannot run: one line
naming the key, exit 2, and nothing touched: no connection reached the Kafka
bootstrap or the inference server it names (each a listening socket that records
any), no broker home was made."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenbudget.app.children import cli_command


@contextlib.contextmanager
def listening() -> Iterator[socket.socket]:
    with socket.create_server(("127.0.0.1", 0), backlog=16) as sock:
        sock.setblocking(False)
        yield sock


def connected(sock: socket.socket) -> bool:
    """Whether anything connected to ``sock`` (the kernel accepts into the backlog)."""
    try:
        sock.accept()[0].close()
    except BlockingIOError:
        return False
    return True


CASES = {
    "no datasets": ([], "datasets", "no [[datasets]] table: add one with name, path and budget"),
    "missing file": (
        [{"name": "b2", "path": "data/b2.jsonl", "budget": "10M"}],
        "datasets[0].path",
        "data/b2.jsonl does not exist (a relative path is read from the config file's folder)",
    ),
    "alpaca rows": (
        [{"name": "alpaca", "path": "alpaca.jsonl", "budget": "10M"}],
        "datasets[0].prompt_template",
        'their fields: instruction, input, output: set prompt_template = "{instruction}\\n\\n'
        '{input?}" (docs/datasets.md: Column mapping)',
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_a_job_that_cannot_run_stops_before_anything_is_touched(tmp_path: Path, case: str) -> None:
    datasets, key, message = CASES[case]
    with listening() as kafka, listening() as server:
        lines = [
            "[kafka]",
            f'bootstrap = "127.0.0.1:{kafka.getsockname()[1]}"',
            "[inference]",
            f'url = "http://127.0.0.1:{server.getsockname()[1]}"',
        ]
        for dataset in datasets:
            lines += ["[[datasets]]", *(f"{k} = {json.dumps(v)}" for k, v in dataset.items())]
        config = tmp_path / "job.toml"
        config.write_text("\n".join(lines) + "\n")
        row = {"instruction": "Add the numbers", "input": "1 2 3", "output": "6"}
        (tmp_path / "alpaca.jsonl").write_text(json.dumps(row) + "\n")
        home = tmp_path / "broker-home"
        env = {**os.environ, "TOKENBUDGET_HOME": str(home)}
        env.pop("TOKENBUDGET_LOG", None)
        result = subprocess.run(
            cli_command("run", "--config", str(config)),
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert result.returncode == 2, result.stderr
        assert result.stdout == ""
        assert result.stderr.count("\n") == 1, result.stderr
        assert result.stderr.startswith(f"tokenbudget: error: {config}: config key '{key}': ")
        assert message in result.stderr
        assert not connected(kafka), "the Kafka bootstrap was contacted"
        assert not connected(server), "the inference server was contacted"
        assert not home.exists()
