"""``tokenbudget acls``: the bindings of the config's namespace for each role's
principal, printed or applied; without SASL, one line and exit 2. The cluster is
faked here (tests/integration/test_acls.py applies them on a real broker)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from tokenbudget import cli
from tokenbudget.app.commands import acls as command
from tokenbudget.core.kafka_acls import AclBinding

SASL = """[kafka]
bootstrap = "k1:9092,k2:9092"
namespace = "regen"
security_protocol = "SASL_SSL"
sasl_mechanism = "SCRAM-SHA-512"
sasl_username = "tb"
sasl_password_env = "TB_PW"
[[kafka.roles]]
role = "dispatcher"
sasl_username = "gpu"
sasl_password_env = "GPU_PW"
[[kafka.roles]]
role = "ledger"
sasl_username = "ledger"
sasl_password_file = "ledger.pw"
"""
JOB = """[inference]
url = "http://127.0.0.1:1"
check_server = false
[[datasets]]
name = "a"
path = "a.jsonl"
budget = "1M"
"""


def write(folder: Path, kafka: str = SASL) -> Path:
    (folder / "a.jsonl").write_text('{"prompt": "hi"}\n')
    path = folder / "job.toml"
    path.write_text(kafka + JOB)
    return path


def test_it_prints_the_lines_for_each_roles_principal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["acls", "--config", str(write(tmp_path))]) == 0
    out = capsys.readouterr().out.splitlines()
    comments = [line for line in out if line.startswith("#")]
    # the roles without a login of their own share [kafka]'s principal
    assert comments == [
        "# User:gpu: dispatcher",
        "# User:ledger: ledger",
        "# User:tb: operator, producer, sink",
    ]
    commands = [shlex.split(line) for line in out if not line.startswith("#")]
    assert all(
        c[:3] == ["kafka-acls.sh", "--bootstrap-server", "k1:9092,k2:9092"] for c in commands
    )
    writes = {(c[5], c[9]) for c in commands if c[7] == "Write" and c[8] == "--topic"}
    assert ("User:gpu", "regen.completions") in writes
    assert ("User:tb", "regen.control") in writes
    assert not {t for p, t in writes if p == "User:gpu"} & {"regen.control", "regen.budgets"}


def test_json_lists_the_same_bindings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["acls", "--config", str(write(tmp_path))]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert cli.main(["acls", "--config", str(write(tmp_path)), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert len(shown) == len(lines)
    assert {e["principal"] for e in shown} == {"User:gpu", "User:ledger", "User:tb"}


def test_apply_creates_them_as_the_kafka_user_and_says_how_many_were_new(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[Any] = []

    def resolve_bootstrap(config: Any, *, create_topics: bool) -> str:
        asked.append(("resolve", create_topics))
        return "k1:9092"

    def apply_acls(bootstrap: str, bindings: list[AclBinding]) -> list[AclBinding]:
        asked.append(("apply", bootstrap, len(bindings)))
        return [b for b in bindings if b.principal == "User:gpu"]

    monkeypatch.setattr(command, "resolve_bootstrap", resolve_bootstrap)
    monkeypatch.setattr(command, "apply_acls", apply_acls)
    assert cli.main(["acls", "--config", str(write(tmp_path)), "--apply"]) == 0
    out = capsys.readouterr().out.strip()
    # no topics made: ACLs may come before the first run
    assert asked[0] == ("resolve", False) and asked[1][:2] == ("apply", "k1:9092")
    total = asked[1][2]
    assert out == (
        f"added 12 ACLs on k1:9092 for namespace 'regen' ({total - 12} of its {total} "
        "were there already)"
    )
    assert cli.main(["acls", "--config", str(write(tmp_path)), "--apply", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert {e["principal"] for e in shown if e["added"]} == {"User:gpu"}


def test_without_sasl_it_says_acls_need_principals_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = '[kafka]\nbootstrap = "k1:9092"\n'
    assert cli.main(["acls", "--config", str(write(tmp_path, plain))]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "config key 'kafka.security_protocol': ACLs name SASL principals" in err
    assert "set SASL_PLAINTEXT or SASL_SSL" in err
