"""Every error tokenbudget raises on purpose derives from one root.

    TokenBudgetError
    ├── ConfigError            a config key is missing, unknown or has a bad value
    ├── DatasetError           a dataset file or row cannot be read
    │   └── SplitError              a saved Hugging Face dataset has no such split,
    │                               or needs one chosen (tokenbudget.producers.prompts.readers)
    ├── TokenizerError         a tokenizer folder is missing or holds no tokenizer
    │   └── TokenizerCodeError      it ships its own tokenizer code, which runs only
    │                               when trusted ([inference] trust_remote_code)
    ├── MissingExtraError      a feature needs a package that is not installed
    │                          (tokenbudget.core.extras)
    ├── EventDecodeError       bytes on a topic are not a known event of a known version
    ├── BrokerError            the local Kafka broker cannot be fetched, started or reached
    ├── KafkaAuthError         a Kafka broker refused our credentials, or TLS failed
    ├── KafkaRefusedError      Kafka's ACLs refuse what a role does (its principal lacks a right)
    ├── KafkaLimitsError       a Kafka cluster refuses the message sizes tokenbudget needs
    ├── FaustVersionError      faust-streaming, mode or aiokafka is not the pinned version
    ├── InferenceError         the inference server failed a request
    │   ├── InferenceTransportError   connection refused/reset, timeout (server away)
    │   │   ├── InferenceTimeLimitError  the answer took longer than its request may
    │   │   │                            ([inference] min_tokens_per_s)
    │   │   └── ServerUnreachableError   the check before a run could not reach the
    │   │                                server (tokenbudget.producers.inference.generation)
    │   ├── InferenceUnavailableError HTTP 429, 408, 502, 503, 504 (server away)
    │   ├── InferenceServerError      another HTTP 5xx (retried)
    │   ├── InferenceRequestError     another HTTP 4xx: the request is wrong (not retried)
    │   │   └── WrongModelError          the server serves another model than
    │   │                                [inference] model
    │   │                                (tokenbudget.producers.inference.generation)
    │   └── InferenceProtocolError    the body is not the wire format we expect (retried)
    │       ├── InferenceCountError      neither usage nor token ids, and no tokenizer
    │       │                            to count with (not retried;
    │       │                            tokenbudget.producers.inference.generation)
    │       ├── InferenceBadCountError   a token count that is negative, not an integer
    │       │                            or absurd: refused, never charged (retried)
    │       └── InferenceReplyTooLargeError  a body or a streamed line over
    │                                        [inference] max_reply_bytes (retried)
    ├── ServerOutageError      every inference server stayed away longer than allowed
    ├── WorkerFailedError      a worker process of ``run`` kept exiting on its own
    ├── ExportError            kept rows cannot be exported as asked (and what to fix)
    └── JobChangedError        a rerun is not the job its namespace recorded (and the ways on)

Each is declared here unless a module is named (then it is declared there). Two
``ValueError`` subclasses never reach the user: ``tokenbudget.core.columns``'
``TemplateError`` and ``FieldError`` become a ConfigError or a DatasetError where
they are caught. ``tokenbudget.app.interrupts.Interrupted`` is no error: ``run``
stopped in order by a signal, which ends as its exit code.

"Server away" errors say nothing about the request: they are retried for as long as
some server of the fleet may answer (the server away gets nothing meanwhile) and
never fail a prompt. The other retried errors fail a prompt after ``[inference]
retries`` of them.

Errors from libraries are translated at one boundary per module with
``raise ... from exc`` so the user sees where and what to fix, and the cause stays
attached for debugging.
"""

from __future__ import annotations


class TokenBudgetError(Exception):
    """Root of every error tokenbudget raises deliberately."""


class ConfigError(TokenBudgetError):
    """A configuration key is missing, unknown, or has a bad value.

    ``key`` is the dotted path of the offending key (``datasets[2].budget``).
    """

    def __init__(self, key: str, message: str, *, source: str | None = None) -> None:
        self.key = key
        self.source = source
        where = f"{source}: " if source else ""
        super().__init__(f"{where}config key '{key}': {message}")


class DatasetError(TokenBudgetError):
    """A dataset file or one of its rows cannot be used."""

    def __init__(
        self,
        path: str,
        message: str,
        *,
        line: int | None = None,
        excerpt: str = "",
        size: int | None = None,
    ) -> None:
        self.path = path
        self.line = line
        self.message = message
        # What its dead letter shows of the row (bounded: tokenbudget.core.sizes.excerpt),
        # and the size in bytes of what it was cut from.
        self.excerpt = excerpt
        self.size = size
        where = f"{path}:{line}" if line is not None else path
        super().__init__(f"{where}: {message}")

    @property
    def where(self) -> str:
        """``path:line``, or the path of an error about the whole file."""
        return f"{self.path}:{self.line}" if self.line is not None else self.path


class TokenizerError(TokenBudgetError):
    """A tokenizer folder is missing or holds no tokenizer. ``origin`` is the config
    key or command flag that named the folder."""

    def __init__(self, origin: str, folder: object, reason: str) -> None:
        self.origin = origin
        self.folder = folder
        self.reason = reason
        super().__init__(f"{origin} {folder}: {reason}")


class TokenizerCodeError(TokenizerError):
    """The tokenizer folder ships its own Python code (an ``auto_map`` in its
    ``tokenizer_config.json``: Kimi-K2's tiktoken tokenizer), which is run only when
    trusted; ``reason`` names the files and what trusts them."""


class EventDecodeError(TokenBudgetError):
    """Bytes read from a topic are not a known event of a supported version."""


class BrokerError(TokenBudgetError):
    """The local Kafka broker cannot be fetched, started, stopped or reached."""


class KafkaAuthError(TokenBudgetError):
    """The Kafka broker refused our credentials, or TLS with it failed.

    ``keys`` are the config keys that decide it, the ones to check.
    """

    def __init__(self, message: str, *, keys: list[str]) -> None:
        self.keys = keys
        super().__init__(f"{message}; check config keys {', '.join(keys)}")


class KafkaRefusedError(TokenBudgetError):
    """Kafka's authorizer refused what a role does: its principal has no ACL for it
    (docs/kafka.md, Roles and ACLs). Asking again cannot help, so nothing waits on it."""


def refused_by_kafka(exc: BaseException) -> bool:
    """Whether ``exc`` is Kafka's authorizer saying no (a topic, group, cluster or
    transactional id the principal has no ACL for), in kafka-python's or aiokafka's
    words: they name these errors alike."""
    return type(exc).__name__.endswith("AuthorizationFailedError")


class KafkaLimitsError(TokenBudgetError):
    """A Kafka cluster refuses the message size every topic of ours must accept
    (:mod:`tokenbudget.core.sizes`): a topic's ``max.message.bytes`` cannot be raised,
    or a broker limit is lower. The message names the setting and the fix."""


class FaustVersionError(TokenBudgetError):
    """An installed library the ledger adapts (faust-streaming, mode-streaming,
    aiokafka) is not the version its adaptations were written and tested against."""

    def __init__(self, package: str, installed: str, required: str) -> None:
        self.package = package
        self.installed = installed
        self.required = required
        super().__init__(
            f"the ledger needs {package}=={required} (its Faust adaptations are tested "
            f"against that version only), but {package} {installed} is installed; "
            f"fix: pip install '{package}=={required}'"
        )


class InferenceError(TokenBudgetError):
    """The inference server failed a request."""

    retryable: bool = False
    # The server is busy or unreachable: the request itself is not to blame.
    server_away: bool = False
    # The server is up but takes no more now (429, 503): it is sent fewer at once.
    busy: bool = False
    retry_after: float | None = None  # seconds the server asked us to wait


class InferenceTransportError(InferenceError):
    """The connection failed or timed out before a complete answer arrived."""

    retryable = True
    server_away = True


class InferenceTimeLimitError(InferenceTransportError):
    """The answer was not read whole within its request's time limit: its
    ``max_new_tokens`` at ``[inference] min_tokens_per_s``, plus the connect and read
    timeouts (a server that trickles its answer, or stalls short of the read timeout
    again and again). Retried as any timeout is."""


class InferenceUnavailableError(InferenceError):
    """The server is overloaded, restarting or behind a failing proxy (HTTP 429, 408,
    502, 503, 504); ``retry_after`` is its ``Retry-After``, when it sent one."""

    retryable = True
    server_away = True

    def __init__(
        self, message: str, *, retry_after: float | None = None, busy: bool = False
    ) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.busy = busy


class InferenceServerError(InferenceError):
    """The server answered with HTTP 5xx."""

    retryable = True


class InferenceRequestError(InferenceError):
    """The server rejected the request (HTTP 4xx); retrying will not help."""


class InferenceProtocolError(InferenceError):
    """The server's answer is not the wire format the configured API speaks."""

    retryable = True


class InferenceBadCountError(InferenceProtocolError):
    """A token count in the answer (``usage``, ``meta_info``) is negative, not an
    integer (a float, a bool, a string, null) or beyond any answer's: the answer is
    refused, never charged (a negative cost would give budget back), and the prompt
    tried again as for any malformed body."""


class InferenceReplyTooLargeError(InferenceProtocolError):
    """A reply read whole, or one line of a streamed reply, is over ``[inference]
    max_reply_bytes``: it is not read further, and the prompt is tried again as for
    any malformed body."""


class ServerOutageError(TokenBudgetError):
    """Every inference server of the fleet stayed away longer than ``[inference]
    outage_timeout_s``."""


class WorkerFailedError(TokenBudgetError):
    """A worker process of ``run`` (the ledger, a dispatcher) kept exiting on its own."""


class ExportError(TokenBudgetError):
    """``tokenbudget export`` cannot write the rows as asked; the message says what
    to change."""


class JobChangedError(TokenBudgetError):
    """A rerun of a namespace is not the job recorded there (another dataset file,
    model, sampling, output folder ...): it would resume work that is not its own.
    The message names what changed and the ways on."""


# Kafka errors that say a leader election or a consumer-group rebalance is under way
# (a fresh topic, a worker joining or leaving, a rerun taking its members back): the
# clients retry them on their own and nothing is lost, so they are expected, not news.
# Named, not imported: kafka-python and aiokafka each have their own classes, and the
# command line should not load either just to filter its log.
EXPECTED_KAFKA_ERRORS = frozenset(
    {
        "NotLeaderForPartitionError",
        "LeaderNotAvailableError",
        "FencedLeaderEpochError",
        "UnknownLeaderEpochError",
        "RebalanceInProgressError",
        "IllegalGenerationError",
        "UnknownMemberIdError",
        "NotCoordinatorForGroupError",
        "NotCoordinatorError",
        "GroupCoordinatorNotAvailableError",
        "CoordinatorNotAvailableError",
        "GroupLoadInProgressError",
        "CoordinatorLoadInProgressError",
    }
)


def expected_kafka_error(exc: BaseException) -> bool:
    """Whether ``exc`` is one of :data:`EXPECTED_KAFKA_ERRORS`."""
    return type(exc).__name__ in EXPECTED_KAFKA_ERRORS
