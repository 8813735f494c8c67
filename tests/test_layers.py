"""The contracts of pyproject.toml ([tool.importlinter]) hold: imports point down
the layers only (command line, developer tools, application, local broker
launcher, producers | sinks, streams, core), no package has an import cycle
among its modules, producers/ keeps its three rooms (dispatch over prompts | inference)
and the dispatcher never imports the prompt producer. Run here so CI checks them with
the tests."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint_imports), "--no-cache"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken." in result.stdout
