"""A small job's config file for the commands' tests: one dataset, on a namespace
of its own; nothing is started."""

from __future__ import annotations

from pathlib import Path


def write_job(folder: Path, *, namespace: str = "roles", bootstrap: str = "127.0.0.1:1") -> Path:
    (folder / "a.jsonl").write_text('{"prompt": "hello"}\n')
    path = folder / "tokenbudget.toml"
    path.write_text(
        "\n".join(
            [
                "[kafka]",
                f'bootstrap = "{bootstrap}"',
                f'namespace = "{namespace}"',
                'compression = "lz4"',
                "[budget]",
                "snapshot_interval_s = 0.25",
                "[sink]",
                'path = "out"',
                "[[datasets]]",
                'name = "a"',
                'path = "a.jsonl"',
                "budget = 100",
            ]
        )
        + "\n"
    )
    return path
