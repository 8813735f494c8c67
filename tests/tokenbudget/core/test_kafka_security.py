"""tokenbudget.core.security: secrets that never show, client options from the config,
the registry children inherit, refusals translated; HTTP endpoints on loopback."""

from __future__ import annotations

import copy
import logging
import pickle
import ssl
from pathlib import Path
from typing import Any

import pytest

from tokenbudget import cli
from tokenbudget.core import kafka, security
from tokenbudget.core.config import Config, build
from tokenbudget.core.errors import ConfigError, KafkaAuthError
from tokenbudget.core.security import KafkaSecurity, SecretSource, SecretStr
from tokenbudget.dev.simulator.config import SimulatorConfig

SASL_SSL = {
    "bootstrap": "kafka.example:9093",
    "security_protocol": "SASL_SSL",
    "sasl_mechanism": "SCRAM-SHA-512",
    "sasl_username": "alice",
    "sasl_password_env": "TB_UNIT_KAFKA_PASSWORD",
}


@pytest.fixture(autouse=True)
def isolated_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(security, "_REGISTRY", {})
    monkeypatch.delenv(security.ENV_VAR, raising=False)


def config(base: Path, **kafka_keys: Any) -> Config:
    return build({"kafka": {**SASL_SSL, **kafka_keys}}, base_dir=base, environ={})


# ---- secrets -------------------------------------------------------------------------


def test_secret_str_never_shows_its_value() -> None:
    secret = SecretStr("hunter2-long")
    logged = "%s %r" % (secret, secret)  # noqa: UP031 - how logging formats
    for shown in (repr(secret), str(secret), f"{secret}", logged, repr({"k": secret})):
        assert "hunter2" not in shown
        assert "********" in shown
    # What kafka-python and aiokafka do with a password still sees the characters.
    assert "\0".join(["u", secret]) == "u\0hunter2-long"
    assert secret.encode() == b"hunter2-long"
    assert secret.reveal() == "hunter2-long" and type(secret.reveal()) is str
    assert copy.deepcopy({"password": secret})["password"] is secret  # libraries copy configs
    with pytest.raises(TypeError):
        pickle.dumps(secret)


def test_secret_from_env_or_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TB_UNIT_PW", "from-env-123")
    assert SecretSource(key="kafka.sasl_password_env", env="TB_UNIT_PW").read() == "from-env-123"
    (tmp_path / "pw").write_text("from-file-456\n")  # an editor's newline is not part of it
    source = SecretSource(key="kafka.sasl_password_file", file=str(tmp_path / "pw"))
    assert source.read() == "from-file-456"

    monkeypatch.delenv("TB_UNIT_PW")
    with pytest.raises(ConfigError) as info:
        SecretSource(key="kafka.sasl_password_env", env="TB_UNIT_PW").read()
    assert info.value.key == "kafka.sasl_password_env" and "TB_UNIT_PW" in str(info.value)
    with pytest.raises(ConfigError) as info:
        SecretSource(key="kafka.sasl_password_file", file=str(tmp_path / "absent")).read()
    assert info.value.key == "kafka.sasl_password_file"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        SecretSource(key="kafka.sasl_password_file", file=str(tmp_path / "empty")).read()


def test_a_secret_read_is_redacted_from_every_log_record(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # With SASL PLAIN the password is inside the authentication request, whose bytes
    # aiokafka and kafka-python log at DEBUG.
    monkeypatch.setenv("TB_UNIT_PW", "plain-pw-Zq9")
    secret = SecretSource(key="kafka.sasl_password_env", env="TB_UNIT_PW").read()
    caplog.set_level(logging.DEBUG)
    logging.getLogger("aiokafka.conn").debug(
        "Request: SaslAuthenticateRequest(sasl_auth_bytes=%r)", b"alice\0alice\0plain-pw-Zq9"
    )
    logging.getLogger("elsewhere").info("password is %s", secret.reveal())
    assert "plain-pw-Zq9" not in caplog.text
    assert caplog.text.count("********") == 2


# ---- from the config -----------------------------------------------------------------


def test_security_from_config_resolves_paths_and_names_sources(tmp_path: Path) -> None:
    sec = KafkaSecurity.from_config(
        config(
            tmp_path,
            sasl_password_env="",
            sasl_password_file="secrets/kafka.pw",
            ssl_cafile="ca.pem",
            ssl_check_hostname=False,
        )
    )
    assert sec.protocol == "SASL_SSL" and sec.uses_ssl and sec.uses_sasl
    assert sec.ssl_cafile == str(tmp_path / "ca.pem")
    assert sec.sasl_password == SecretSource(
        key="kafka.sasl_password_file", file=str(tmp_path / "secrets" / "kafka.pw")
    )
    assert sec.ssl_check_hostname is False
    assert KafkaSecurity.from_config(build({}, environ={})) == security.PLAINTEXT


def test_client_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert security.PLAINTEXT.client_options() == {"security_protocol": "PLAINTEXT"}
    monkeypatch.setenv("TB_UNIT_KAFKA_PASSWORD", "s3cret-value")
    options = KafkaSecurity.from_config(config(tmp_path)).client_options()
    assert options["security_protocol"] == "SASL_SSL"
    assert options["sasl_mechanism"] == "SCRAM-SHA-512"
    assert options["sasl_plain_username"] == "alice"
    assert options["sasl_plain_password"] == "s3cret-value"
    assert isinstance(options["sasl_plain_password"], SecretStr)
    assert "s3cret-value" not in repr(options)  # kafka-python logs its configs at DEBUG
    context = options["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_ssl_files_are_checked_naming_the_key(tmp_path: Path) -> None:
    sec = KafkaSecurity.from_config(config(tmp_path, ssl_cafile="absent.pem"))
    with pytest.raises(ConfigError) as info:
        sec.ssl_context()
    assert info.value.key == "kafka.ssl_cafile"
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    with pytest.raises(ConfigError) as info:
        KafkaSecurity.from_config(config(tmp_path, ssl_cafile="junk.pem")).ssl_context()
    assert info.value.key == "kafka.ssl_cafile"
    with pytest.raises(ConfigError) as info:
        KafkaSecurity.from_config(config(tmp_path, ssl_certfile="junk.pem")).ssl_context()
    assert info.value.key == "kafka.ssl_certfile" and "kafka.ssl_keyfile" in str(info.value)
    unchecked = KafkaSecurity.from_config(config(tmp_path, ssl_check_hostname=False))
    context = unchecked.ssl_context()
    assert context is not None and not context.check_hostname
    assert context.verify_mode == ssl.CERT_REQUIRED  # the chain is still verified


def test_faust_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import faust

    monkeypatch.setenv("TB_UNIT_KAFKA_PASSWORD", "faust-pw-1")
    assert security.PLAINTEXT.faust_credentials() is None
    sasl_ssl = KafkaSecurity.from_config(config(tmp_path)).faust_credentials()
    assert isinstance(sasl_ssl, faust.SASLCredentials)
    assert sasl_ssl.protocol.value == "SASL_SSL"
    assert sasl_ssl.mechanism.value == "SCRAM-SHA-512"
    assert sasl_ssl.username == "alice" and sasl_ssl.password == "faust-pw-1"
    assert "faust-pw-1" not in repr(sasl_ssl)
    plain = KafkaSecurity.from_config(
        config(tmp_path, security_protocol="SASL_PLAINTEXT", sasl_mechanism="PLAIN")
    ).faust_credentials()
    assert plain.protocol.value == "SASL_PLAINTEXT" and plain.ssl_context is None
    tls_only = KafkaSecurity(protocol="SSL").faust_credentials()
    assert isinstance(tls_only, faust.SSLCredentials)


# ---- the registry --------------------------------------------------------------------


def test_every_client_builder_uses_the_registered_security(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TB_UNIT_KAFKA_PASSWORD", "registry-pw")
    bootstrap = "registered.example:9093"
    security.register(bootstrap, KafkaSecurity.from_config(config(tmp_path)))
    for options in (
        kafka.client_options(bootstrap),
        kafka.consumer_options(bootstrap),
        kafka.aiokafka_producer_options(bootstrap, "zstd"),
        kafka.kafka_python_producer_options(bootstrap, "zstd"),
    ):
        assert options["bootstrap_servers"] == bootstrap
        assert options["security_protocol"] == "SASL_SSL"
        assert options["sasl_plain_password"] == "registry-pw"
    other = kafka.client_options("unregistered.example:9092")
    assert other["security_protocol"] == "PLAINTEXT" and "sasl_plain_password" not in other


def test_a_child_process_inherits_the_security_without_the_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TB_UNIT_KAFKA_PASSWORD", "inherited-pw")
    bootstrap = "parent.example:9093"
    sec = KafkaSecurity.from_config(config(tmp_path, ssl_cafile="ca.pem"))
    security.register(bootstrap, sec)
    env = security.subprocess_env(bootstrap)
    assert "inherited-pw" not in env[security.ENV_VAR]
    assert "TB_UNIT_KAFKA_PASSWORD" in env[security.ENV_VAR]
    assert security.ENV_VAR not in security.subprocess_env("plain.example:9092", base={})

    # The child: nothing registered, only the environment.
    monkeypatch.setattr(security, "_REGISTRY", {})
    monkeypatch.setenv(security.ENV_VAR, env[security.ENV_VAR])
    assert security.security_for(bootstrap) == sec
    assert security.security_for("other.example:9092") == security.PLAINTEXT
    monkeypatch.setenv(security.ENV_VAR, '{"x:1": {"protocol": "CARRIER_PIGEON"}}')
    with pytest.raises(ConfigError) as info:
        security.security_for("x:1")
    assert info.value.key == security.ENV_VAR


# ---- refusals ------------------------------------------------------------------------


class SaslAuthenticationFailedError(Exception):
    """Named like kafka-python's (aiokafka's is SaslAuthenticationFailed)."""


def test_refusals_become_our_error_naming_the_keys(tmp_path: Path) -> None:
    bootstrap = "refusing.example:9093"
    security.register(
        bootstrap,
        KafkaSecurity.from_config(config(tmp_path, sasl_password_env="", sasl_password_file="pw")),
    )
    try:
        raise RuntimeError("while connecting") from SaslAuthenticationFailedError("bad creds")
    except RuntimeError as exc:
        refused = security.auth_failure(bootstrap, exc)
    assert isinstance(refused, KafkaAuthError)
    assert "refused user 'alice'" in str(refused)
    assert refused.keys == [
        "kafka.security_protocol",
        "kafka.sasl_mechanism",
        "kafka.sasl_username",
        "kafka.sasl_password_file",
    ]
    untrusted = ssl.SSLCertVerificationError(1, "certificate verify failed")
    untrusted.verify_message = "self-signed certificate"
    tls = security.auth_failure(bootstrap, untrusted)
    assert isinstance(tls, KafkaAuthError) and "kafka.ssl_cafile" in tls.keys
    assert security.auth_failure(bootstrap, ConnectionRefusedError()) is None


# ---- HTTP endpoints --------------------------------------------------------------------


def test_http_endpoints_bind_to_loopback_unless_configured() -> None:
    assert build({}, environ={}).metrics.host == "127.0.0.1"
    assert SimulatorConfig().host == "127.0.0.1"
    parser = cli.build_parser()
    assert parser.parse_args(["simulate"]).host == "127.0.0.1"
    assert parser.parse_args(["ledger"]).metrics_host == "127.0.0.1"
    assert build({"metrics": {"host": "0.0.0.0"}}, environ={}).metrics.host == "0.0.0.0"
