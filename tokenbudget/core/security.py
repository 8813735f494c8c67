"""How Kafka clients authenticate and encrypt: the one place that builds it.

``[kafka]`` names a security protocol (PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL), a
SASL mechanism and user, CA/certificate files, and *where* secrets are: the name of
an environment variable or a file. Secrets are read when a client is built, never
stored in the config, and travel as :class:`SecretStr`, which shows ``********`` in
``repr``, ``str`` and formatting (kafka-python logs its whole configuration at DEBUG);
once read, a secret is also masked in every log record (see :func:`_remember`).

Each role (:mod:`tokenbudget.core.roles`) may log in as a principal of its own
(``[[kafka.roles]]``): a client logs in as the role its code plays when it is built
(:func:`tokenbudget.core.roles.current_role`), else as ``[kafka]``'s own user.

Security belongs to a cluster address: :func:`register` records it for a bootstrap
address and every client builder (:func:`client_options`, :func:`faust_credentials`)
looks it up by that address, so the many places that only carry ``bootstrap: str``
need no further plumbing. Subprocesses started with only ``--bootstrap`` inherit the
registry through :func:`subprocess_env` (it holds variable names and paths, no
secret values).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import ssl
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import faust
import msgspec
from aiokafka.conn import create_conn

from tokenbudget.core.errors import ConfigError, KafkaAuthError
from tokenbudget.core.roles import Role, current_role

if TYPE_CHECKING:
    from tokenbudget.core.config import Config

Protocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
Mechanism = Literal["", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]

MASK = "********"
# Carries the registry to child processes: {bootstrap: KafkaSecurity as JSON}.
ENV_VAR = "TOKENBUDGET_KAFKA_SECURITY"


class SecretStr(str):
    """A str that never shows its value: repr, str, format and %-formatting give
    ``********``. Libraries still get the characters through ``encode`` and
    ``join``, which is all kafka-python and aiokafka do with a SASL password. Code
    that must put the value into a string calls :meth:`reveal`: an f-string would
    put the mask there."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(MASK)

    def __str__(self) -> str:
        return MASK

    def __format__(self, spec: str) -> str:
        return MASK

    def reveal(self) -> str:
        """The value as a plain str (for APIs that do not take a str subclass)."""
        return str.__str__(self)

    # Immutable: a copy is itself. (Without these, copy falls back to __reduce__.)
    def __copy__(self) -> SecretStr:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> SecretStr:
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        raise TypeError("a secret is not pickled")  # nor written to a cache or queue


_KNOWN: set[str] = set()  # every secret value read in this process, to redact from logs
_KNOWN_LOCK = threading.Lock()


def _remember(value: str) -> SecretStr:
    """Wrap ``value`` and redact it from every log record from now on.

    Masking the value's repr is not enough: with SASL PLAIN the password travels in
    the authentication request, whose bytes aiokafka (``aiokafka.conn``) and
    kafka-python (``kafka.protocol.parser``) log at DEBUG. So the log record factory
    replaces known secrets in each record's message. It costs nothing at the usual
    log levels (records below a logger's level are never made) and is installed only
    once a secret has been read.
    """
    with _KNOWN_LOCK:
        if not _KNOWN:
            previous = logging.getLogRecordFactory()

            def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
                record = previous(*args, **kwargs)
                _redact(record)
                return record

            logging.setLogRecordFactory(factory)
        _KNOWN.add(value)
        # Inside a bytes repr a non-ASCII password shows as escapes.
        _KNOWN.add(repr(value.encode())[2:-1])
    return SecretStr(value)


def _redact(record: logging.LogRecord) -> None:
    try:
        message = record.getMessage()
    except Exception:  # a broken format string is logging's to report, not ours
        return
    changed = False
    for secret in sorted(_KNOWN, key=len, reverse=True):  # longest first: no partial masks
        if secret in message:
            message, changed = message.replace(secret, MASK), True
    if changed:
        record.msg, record.args = message, None


class SecretSource(msgspec.Struct, frozen=True, kw_only=True):
    """Where one secret is read from: an environment variable or a file.

    ``key`` is the config key that named the source, quoted in errors."""

    key: str
    env: str = ""
    file: str = ""

    def read(self) -> SecretStr:
        if self.env:
            value = os.environ.get(self.env, "")
            if not value:
                raise ConfigError(
                    self.key, f"the environment variable {self.env} is not set or empty"
                )
            return _remember(value)
        try:
            text = Path(self.file).read_text()
        except OSError as exc:
            raise ConfigError(self.key, f"cannot read {self.file}: {exc.strerror}") from None
        # An editor's trailing newline is not part of the password.
        value = text.rstrip("\r\n")
        if not value:
            raise ConfigError(self.key, f"{self.file} is empty")
        return _remember(value)


class Login(msgspec.Struct, frozen=True, kw_only=True):
    """One role's SASL user and where its password is (``[[kafka.roles]]``)."""

    username: str
    password: SecretSource


class KafkaSecurity(msgspec.Struct, frozen=True, kw_only=True):
    """``[kafka]`` security settings with paths resolved; no secret values.
    ``logins``: the roles that log in as a user of their own."""

    protocol: Protocol = "PLAINTEXT"
    sasl_mechanism: Mechanism = ""
    sasl_username: str = ""
    sasl_password: SecretSource | None = None
    logins: dict[str, Login] = {}
    ssl_cafile: str = ""
    ssl_certfile: str = ""
    ssl_keyfile: str = ""
    ssl_key_password: SecretSource | None = None
    ssl_check_hostname: bool = True

    @property
    def uses_ssl(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        return self.protocol in ("SASL_PLAINTEXT", "SASL_SSL")

    @classmethod
    def from_config(cls, config: Config) -> KafkaSecurity:
        kafka = config.kafka

        def path(value: str) -> str:
            if not value:
                return ""
            p = Path(value).expanduser()
            return str(p if p.is_absolute() else (config.base_dir / p).resolve())

        def source(prefix: str) -> SecretSource | None:
            env, file = getattr(kafka, f"{prefix}_env"), getattr(kafka, f"{prefix}_file")
            if env:
                return SecretSource(key=f"kafka.{prefix}_env", env=env)
            if file:
                return SecretSource(key=f"kafka.{prefix}_file", file=path(file))
            return None

        logins: dict[str, Login] = {}
        for i, entry in enumerate(kafka.roles):
            key = f"kafka.roles[{i}]"
            password = (
                SecretSource(key=f"{key}.sasl_password_env", env=entry.sasl_password_env)
                if entry.sasl_password_env
                else SecretSource(
                    key=f"{key}.sasl_password_file", file=path(entry.sasl_password_file)
                )
            )
            logins[entry.role] = Login(username=entry.sasl_username, password=password)
        return cls(
            protocol=kafka.security_protocol,
            sasl_mechanism=kafka.sasl_mechanism,
            sasl_username=kafka.sasl_username,
            sasl_password=source("sasl_password"),
            logins=logins,
            ssl_cafile=path(kafka.ssl_cafile),
            ssl_certfile=path(kafka.ssl_certfile),
            ssl_keyfile=path(kafka.ssl_keyfile),
            ssl_key_password=source("ssl_key_password"),
            ssl_check_hostname=kafka.ssl_check_hostname,
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """The TLS context every client shares, or None without TLS."""
        if not self.uses_ssl:
            return None
        for key, file in (
            ("kafka.ssl_cafile", self.ssl_cafile),
            ("kafka.ssl_certfile", self.ssl_certfile),
            ("kafka.ssl_keyfile", self.ssl_keyfile),
        ):
            if file and not Path(file).is_file():
                raise ConfigError(key, f"{file} is not a file")
        try:
            # Verifies the broker's certificate: against ssl_cafile, else the system CAs.
            context = ssl.create_default_context(cafile=self.ssl_cafile or None)
        except ssl.SSLError as exc:
            raise ConfigError(
                "kafka.ssl_cafile", f"{self.ssl_cafile} holds no PEM CA certificate ({exc})"
            ) from None
        context.check_hostname = self.ssl_check_hostname
        if self.ssl_certfile:
            password = self.ssl_key_password.read().reveal() if self.ssl_key_password else None
            try:
                context.load_cert_chain(
                    self.ssl_certfile, self.ssl_keyfile or None, password=password
                )
            except ssl.SSLError as exc:
                # ssl says only "[SSL] PEM lib": name every key that plays a part.
                raise ConfigError(
                    "kafka.ssl_certfile",
                    f"cannot load the client certificate/key ({exc.reason or exc}): check "
                    "kafka.ssl_certfile, kafka.ssl_keyfile and the key's password "
                    "(kafka.ssl_key_password_env or _file)",
                ) from None
        return context

    def login(self, role: Role | None = None) -> Login | None:
        """Who ``role`` (by default the role being played) logs in as: its own
        login, else ``[kafka]``'s; None without SASL."""
        if not self.uses_sasl:
            return None
        own = self.logins.get(role or current_role() or "")
        if own is not None:
            return own
        assert self.sasl_password is not None  # config validation requires it
        return Login(username=self.sasl_username, password=self.sasl_password)

    def principal(self, role: Role) -> str:
        """``role``'s Kafka principal (``User:<name>``); "" without SASL."""
        login = self.login(role)
        return f"User:{login.username}" if login is not None else ""

    def client_options(self) -> dict[str, Any]:
        """kafka-python and aiokafka take the same security keyword arguments."""
        options: dict[str, Any] = {"security_protocol": self.protocol}
        context = self.ssl_context()
        if context is not None:
            options["ssl_context"] = context
        login = self.login()
        if login is not None:
            options["sasl_mechanism"] = self.sasl_mechanism
            options["sasl_plain_username"] = login.username
            options["sasl_plain_password"] = login.password.read()
        return options

    def faust_credentials(self) -> Any:
        """``broker_credentials`` for a Faust app (None: plaintext)."""
        context = self.ssl_context()
        login = self.login()
        if login is not None:
            # With a context Faust speaks SASL_SSL, without it SASL_PLAINTEXT.
            return faust.SASLCredentials(
                username=login.username,
                password=login.password.read(),
                ssl_context=context,
                mechanism=self.sasl_mechanism,
            )
        if context is not None:
            return faust.SSLCredentials(context)
        return None

    def auth_keys(self) -> list[str]:
        """The config keys that decide whether the broker accepts us."""
        keys = ["kafka.security_protocol"]
        login = self.login()
        if login is not None:
            own = login.password.key.startswith("kafka.roles[")
            user_key = login.password.key.rsplit(".", 1)[0] + ".sasl_username"
            keys += ["kafka.sasl_mechanism", user_key if own else "kafka.sasl_username"]
            keys.append(login.password.key)
        return keys

    def tls_keys(self) -> list[str]:
        keys = ["kafka.security_protocol", "kafka.ssl_cafile", "kafka.ssl_check_hostname"]
        if self.ssl_certfile:
            keys += ["kafka.ssl_certfile", "kafka.ssl_keyfile"]
        return keys


PLAINTEXT = KafkaSecurity()

_REGISTRY: dict[str, KafkaSecurity] = {}


def register(bootstrap: str, security: KafkaSecurity) -> None:
    """Clients of ``bootstrap`` use ``security`` from now on (in this process and,
    through :func:`subprocess_env`, in its children)."""
    _REGISTRY[bootstrap] = security


def security_for(bootstrap: str) -> KafkaSecurity:
    """The security registered for ``bootstrap``: here, else by a parent process
    (``$TOKENBUDGET_KAFKA_SECURITY``), else PLAINTEXT."""
    found = _REGISTRY.get(bootstrap)
    if found is not None:
        return found
    inherited = os.environ.get(ENV_VAR)
    if inherited:
        try:
            entries = msgspec.json.decode(inherited, type=dict[str, KafkaSecurity])
        except msgspec.ValidationError as exc:
            raise ConfigError(ENV_VAR, f"not what tokenbudget writes there: {exc}") from None
        if bootstrap in entries:
            return entries[bootstrap]
    return PLAINTEXT


def subprocess_env(bootstrap: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child that connects to ``bootstrap`` (given only the
    address): ``base`` (default: ours) plus how to secure that address."""
    env = dict(os.environ if base is None else base)
    security = security_for(bootstrap)
    if security != PLAINTEXT:
        env[ENV_VAR] = json.dumps({bootstrap: msgspec.to_builtins(security)})
    return env


def client_options(bootstrap: str) -> dict[str, Any]:
    return security_for(bootstrap).client_options()


def faust_credentials(bootstrap: str) -> Any:
    return security_for(bootstrap).faust_credentials()


def faust_brokers(bootstrap: str) -> list[str]:
    """``HOST:PORT[,HOST:PORT...]`` as Faust's ``broker`` setting wants it: one
    ``kafka://`` URL per address (kafka-python and aiokafka take the string as is)."""
    return [
        f"kafka://[{host}]:{port}" if ":" in host else f"kafka://{host}:{port}"
        for host, port in _addresses(bootstrap)
    ]


# ---------------------------------------------------------------- failures to connect

_AUTH_ERRORS = ("SaslAuthenticationFailed", "AuthenticationFailed")
_MECHANISM_ERRORS = ("UnsupportedSaslMechanism", "AuthenticationMethodNotSupported")


def check_credentials(bootstrap: str, *, timeout: float = 15.0) -> None:
    """Authenticate once to ``bootstrap`` with its registered security; raise
    :class:`KafkaAuthError` if the broker refuses us or TLS fails.

    Needed because neither client says so: kafka-python retries a refused login
    until its bootstrap timeout and then reports only a timeout, and aiokafka
    raises a bare "Unable to bootstrap". One connection through aiokafka's
    ``create_conn`` does the TLS and SASL handshakes and raises the broker's own
    error. A broker that cannot be reached is not judged here: the caller's next
    request reports it. Plaintext has nothing to check.
    """
    settings = security_for(bootstrap)
    if settings == PLAINTEXT:
        return
    options = settings.client_options()

    async def attempt(host: str, port: int) -> None:
        conn = await asyncio.wait_for(
            create_conn(
                host,
                port,
                client_id="tokenbudget-auth-check",
                request_timeout_ms=int(timeout * 1000),
                **options,
            ),
            timeout,
        )
        conn.close()

    for host, port in _addresses(bootstrap):
        try:
            # Its own thread and loop: callers may be sync code inside a running loop.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pool.submit(asyncio.run, attempt(host, port)).result()
            return
        except Exception as exc:
            refused = auth_failure(bootstrap, exc)
            if refused is not None:
                raise refused from exc
            if settings.uses_ssl and isinstance(exc, ConnectionResetError):
                # A listener that does not speak TLS drops our ClientHello.
                raise KafkaAuthError(
                    f"the Kafka listener at {host}:{port} closed the connection during the "
                    "TLS handshake: it may not be an SSL/SASL_SSL listener",
                    keys=["kafka.bootstrap", "kafka.security_protocol"],
                ) from exc
            # unreachable: try the next address


def _addresses(bootstrap: str) -> list[tuple[str, int]]:
    addresses = []
    for item in bootstrap.split(","):
        host, _, port = item.strip().rpartition(":")
        if port.isdigit():
            addresses.append((host.strip("[]") or "127.0.0.1", int(port)))
    return addresses


def _chain(exc: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def auth_failure(bootstrap: str, exc: BaseException) -> KafkaAuthError | None:
    """Our error for ``exc`` if it (or its cause) is the broker refusing our
    credentials or a TLS failure; None for any other failure.

    kafka-python and aiokafka raise different classes for the same refusal, so they
    are recognised by name, not imported here.
    """
    settings = security_for(bootstrap)
    for link in _chain(exc):
        name = type(link).__name__
        if isinstance(link, ssl.SSLCertVerificationError):
            return KafkaAuthError(
                f"the TLS certificate of the Kafka broker at {bootstrap} is not trusted "
                f"({link.verify_message})",
                keys=settings.tls_keys(),
            )
        if isinstance(link, ssl.SSLError):
            return KafkaAuthError(
                f"the TLS handshake with the Kafka broker at {bootstrap} failed ({link.reason})",
                keys=[*settings.tls_keys(), "kafka.bootstrap"],
            )
        if name.startswith(_MECHANISM_ERRORS):
            return KafkaAuthError(
                f"the Kafka broker at {bootstrap} does not offer SASL mechanism "
                f"{settings.sasl_mechanism or '(none)'}",
                keys=["kafka.sasl_mechanism", "kafka.security_protocol"],
            )
        if name.startswith(_AUTH_ERRORS):
            login = settings.login()
            user = f"user {login.username!r}" if login is not None else "this client"
            return KafkaAuthError(
                f"the Kafka broker at {bootstrap} refused {user}: wrong user name, "
                "password or SASL mechanism",
                keys=settings.auth_keys(),
            )
    return None
