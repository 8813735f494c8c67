"""Every Prometheus metric tokenbudget exports, declared once, here.

Names carry the ``tokenbudget_`` prefix; each declaration says its type and meaning.
Each long-running process serves its own registry on ``/metrics`` (:func:`serve`,
127.0.0.1 by default): ``tokenbudget run`` on ``[metrics] port`` and its ledger
worker on the next port, ``tokenbudget ledger --metrics-port P`` on ``P``.

Who sets what:

* the **ledger worker** (the single owner of budget state) sets every per-dataset
  ledger metric through :class:`tokenbudget.streams.ledger_gauges.LedgerGauges`: kept
  tokens/samples and answers cut by the budget (counters),
  budget, used, remaining, reserved, overshoot, halted and open (gauges). No other
  process touches them, so several processes never report conflicting values;
* the **run process** sets the dispatcher's metrics (in-flight, latency, TTFT,
  inference errors, skipped prompts, and per server of the fleet, labelled ``server``
  with its URL: requests, tokens generated, errors, in flight, window, state, TTFT),
  the sink's (Parquet rows and bytes), events produced/consumed, dead letters,
  consumer lag (:class:`LagSampler`) and the overshoot allowance; so does each
  ``tokenbudget dispatch`` process, for its own requests;
* events consumed and dead letters are also counted by the ledger, labelled
  ``consumer="ledger"``.

Topic labels are the topic's role (``prompts``, ``completions``, ``budgets``,
``outcomes``, ``deadletter``), not its namespaced name: see :func:`topic_role`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import platform
import threading
from collections.abc import Iterator

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tokenbudget import version
from tokenbudget.core.kafka import GroupLag

log = logging.getLogger(__name__)

# --- per dataset, owned by the ledger worker (tokenbudget.streams.ledger_gauges) -------------

#: counter: completion tokens kept (counted once per prompt by the ledger)
COMPLETION_TOKENS = Counter(
    "tokenbudget_completion_tokens_total", "Completion tokens kept, per dataset", ["dataset"]
)
#: counter: prompt tokens of the kept completions
PROMPT_TOKENS = Counter(
    "tokenbudget_prompt_tokens_total", "Prompt tokens of kept completions", ["dataset"]
)
#: counter: completions kept
SAMPLES = Counter("tokenbudget_samples_total", "Completions kept, per dataset", ["dataset"])
#: gauge: the dataset's budget, in its unit (completion tokens, total tokens or samples)
BUDGET = Gauge("tokenbudget_budget_tokens", "Budget per dataset, in its unit", ["dataset"])
#: gauge: how much of the budget is used (kept), in the budget's unit
BUDGET_USED = Gauge(
    "tokenbudget_budget_used_tokens", "Budget used (kept), per dataset, in its unit", ["dataset"]
)
#: gauge: budget minus used, never below 0
BUDGET_REMAINING = Gauge(
    "tokenbudget_budget_remaining_tokens", "Budget left per dataset", ["dataset"]
)
#: gauge: tokens reserved for requests in flight (0 until the ledger reserves)
RESERVED = Gauge(
    "tokenbudget_reserved_tokens", "Tokens reserved for in-flight requests", ["dataset"]
)
#: gauge: used minus budget, never below 0
OVERSHOOT = Gauge(
    "tokenbudget_overshoot_tokens", "Tokens kept beyond the budget, per dataset", ["dataset"]
)
#: counter: answers kept that the budget's line cut (their ``stop_reason`` is
#: ``budget``): under ``[budget] cut = "last"`` at most one per dataset and
#: dispatcher each time the budget runs out, besides those of a lowered budget
CUT_ANSWERS = Counter(
    "tokenbudget_cut_answers_total",
    "Answers kept that the budget's line cut, per dataset",
    ["dataset"],
)
#: counter: prompts that failed for good (their outcome is ``failed``)
FAILED_PROMPTS = Counter(
    "tokenbudget_failed_prompts_total", "Prompts that failed for good, per dataset", ["dataset"]
)
#: gauge: leases the ledger holds open for dispatchers
OPEN_LEASES = Gauge("tokenbudget_open_leases", "Leases open, per dataset", ["dataset"])
#: gauge: 1 when the dataset is halted (its budget was reached), else 0
HALTED = Gauge("tokenbudget_dataset_halted", "1 when the dataset is halted", ["dataset"])
#: gauge: 1 while the dataset is open (neither halted nor exhausted), else 0
OPEN = Gauge(
    "tokenbudget_dataset_open",
    "1 while the dataset is open: not halted, not exhausted",
    ["dataset"],
)

# --- per dataset, set by the run process -----------------------------------------

#: counter: dataset rows that are not prompts (bad JSON, no prompt, over
#: ``[producer] max_prompt_bytes``...), each dead-lettered, then skipped or stopping
#: the run (``on_bad_row``); counted by the prompt producer
BAD_ROWS = Counter(
    "tokenbudget_bad_rows_total",
    "Dataset rows that are not prompts, dead-lettered (skipped or stopping the run)",
    ["dataset"],
)
#: counter: prompts not sent because their dataset was halted (dispatcher)
SKIPPED_PROMPTS = Counter(
    "tokenbudget_skipped_prompts_total",
    "Prompts not sent because their dataset was halted",
    ["dataset"],
)
#: gauge: the overshoot the design allows, in the budget's unit: 0 with reservations
#: (``admission = "reserve"``); with ``halt``, what all dispatchers can still have in
#: flight when the halt comes (dispatchers x concurrency x max_new_tokens)
OVERSHOOT_ALLOWANCE = Gauge(
    "tokenbudget_overshoot_allowance_tokens",
    "Overshoot the admission policy allows, per dataset, in the budget's unit",
    ["dataset"],
)
#: counter: completions kept, by why generation stopped: ``stop`` (the model ended),
#: ``length`` (the request's own max_new_tokens), ``budget`` (cut at the budget's line:
#: max_new_tokens was lowered to what the budget had left), ``abort``
COMPLETIONS = Counter(
    "tokenbudget_completions_total",
    "Completions published, by dataset and finish reason (budget: cut at the budget)",
    ["dataset", "finish_reason"],
)
#: counter: completion tokens of the published answers, by ``part``: ``reasoning``
#: (a thinking model's thinking, as the server reported it in
#: ``completion_tokens_details.reasoning_tokens``), ``answer`` (the rest), ``unsplit``
#: (answers whose server reported no split); the three add up to the tokens kept
COMPLETION_TOKEN_PARTS = Counter(
    "tokenbudget_completion_token_parts_total",
    "Completion tokens published, by dataset and part (reasoning, answer, unsplit)",
    ["dataset", "part"],
)
#: counter: answers published unfinished: cut (length or budget) while the model was
#: still thinking, so they hold no answer; they count against the budget all the same
UNFINISHED_ANSWERS = Counter(
    "tokenbudget_unfinished_answers_total",
    "Answers cut before they began (still thinking), per dataset",
    ["dataset"],
)
#: counter: tokens the server generated that are not kept: ``aborted`` (requests
#: aborted when a budget was reached or lowered), ``cut`` (an answer longer than its
#: request, cut at the dispatcher), ``refused`` (an answer on an expired lease the
#: budget had no room for), ``failed`` (answers of requests that failed for good)
WASTED_TOKENS = Counter(
    "tokenbudget_wasted_tokens_total",
    "Tokens generated but not kept (the GPU time lost), by dataset and reason",
    ["dataset", "reason"],
)
#: histogram: seconds from the ledger's budget_exceeded to the dispatcher applying it
HALT_LATENCY = Histogram(
    "tokenbudget_halt_latency_seconds",
    "Seconds from the ledger's halt to a dispatcher applying it",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
#: histogram: seconds a prompt waited at the dispatcher for budget (a lease) to send it
BUDGET_WAIT = Histogram(
    "tokenbudget_budget_wait_seconds",
    "Seconds a prompt waited for budget before it was sent",
    ["dataset"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
#: counter: inference attempts retried, by dataset and reason (busy, unavailable,
#: connection, server_error, ...)
RETRIES = Counter(
    "tokenbudget_inference_retries_total",
    "Inference attempts retried, by dataset and reason",
    ["dataset", "reason"],
)

# --- inference (dispatcher) -------------------------------------------------------

#: gauge: inference requests in flight
IN_FLIGHT = Gauge("tokenbudget_inflight_requests", "Inference requests in flight")
#: histogram: seconds from sending a request to its complete answer
REQUEST_LATENCY = Histogram(
    "tokenbudget_request_latency_seconds",
    "Inference request latency, per dataset",
    ["dataset"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
#: histogram: seconds from sending a request to its first token (streamed answers only)
TIME_TO_FIRST_TOKEN = Histogram(
    "tokenbudget_time_to_first_token_seconds",
    "Inference time to first token (when the backend reports it)",
    buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
#: counter: failed inference attempts, by error class (InferenceServerError, ...)
INFERENCE_ERRORS = Counter(
    "tokenbudget_inference_errors_total", "Failed inference attempts by kind", ["kind"]
)

#: counter: answers cut at the dispatcher because the server broke its request's
#: limit ("over_request": more tokens than max_new_tokens; "ids_mismatch": a count
#: that disagrees with the token ids returned)
SERVER_COUNT_CORRECTIONS = Counter(
    "tokenbudget_server_count_corrections_total",
    "Answers corrected at the dispatcher because the server broke the request's limit",
    ["kind"],
)
#: counter: answers on a lease that may have expired, claimed anew ("kept") or not
#: ("refused": the budget had no room left for them)
CLAIMS = Counter(
    "tokenbudget_claims_total",
    "Answers on an expired lease claimed anew from the ledger, by result",
    ["result"],
)
#: counter: times a server of the fleet was paused because it was away
SERVER_PAUSES = Counter(
    "tokenbudget_server_pauses_total", "Times a server was paused because it was away"
)

# --- per inference server of the fleet (dispatcher), labelled with its URL ---------

#: counter: requests the dispatcher sent to the server (each attempt)
SERVER_REQUESTS = Counter(
    "tokenbudget_server_requests_total", "Inference requests sent, per server", ["server"]
)
#: counter: completion tokens the server generated, kept or not (its answers as sent)
SERVER_TOKENS = Counter(
    "tokenbudget_server_generated_tokens_total",
    "Completion tokens the server generated, per server",
    ["server"],
)
#: counter: requests to the server that failed, by error class; ``moved``: given up
#: while the server was away and sent to another server
SERVER_ERRORS = Counter(
    "tokenbudget_server_errors_total",
    "Failed inference requests, per server and kind",
    ["server", "kind"],
)
#: gauge: requests at the server now
SERVER_IN_FLIGHT = Gauge(
    "tokenbudget_server_inflight_requests", "Inference requests in flight, per server", ["server"]
)
#: gauge: requests the server may have at once now: its window, cut when it answers
#: 429/503 or slows down, grown back to its concurrency (producers/inference/placement.py)
SERVER_LIMIT = Gauge(
    "tokenbudget_server_concurrency_limit",
    "Requests the server may have at once now (its adaptive window), per server",
    ["server"],
)
#: gauge: 1 for the state the server is in, 0 for the others: ``up``, ``paused``
#: (away, polled), ``dropped`` (away past outage_timeout_s), ``draining``, ``drained``
SERVER_STATE = Gauge(
    "tokenbudget_server_state",
    "1 for the server's state (up, paused, dropped, ...)",
    ["server", "state"],
)
#: histogram: seconds from sending a request to its first token, per server (streamed
#: answers only)
SERVER_TTFT = Histogram(
    "tokenbudget_server_time_to_first_token_seconds",
    "Time to first token, per server (streamed answers)",
    ["server"],
    buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)

#: gauge: always 1; its labels say which tokenbudget serves the metrics, and the
#: process's role (run, ledger, dispatch, sink): a job whose ledger is missing shows
BUILD_INFO = Gauge(
    "tokenbudget_build_info",
    "tokenbudget version and Python version (value 1)",
    ["version", "python", "role"],
)

# --- Kafka ------------------------------------------------------------------------

#: counter: events produced, per topic role
EVENTS_PRODUCED = Counter(
    "tokenbudget_events_produced_total", "Events produced, per topic role", ["topic"]
)
#: counter: events consumed, per topic role and consumer (dispatcher, sink, ledger)
EVENTS_CONSUMED = Counter(
    "tokenbudget_events_consumed_total",
    "Events consumed, per topic role and consumer",
    ["topic", "consumer"],
)
#: gauge: events a consumer group still has to read (end offset - committed offset)
CONSUMER_LAG = Gauge(
    "tokenbudget_consumer_lag_events",
    "Consumer group lag in events, per group and topic role",
    ["group", "topic"],
)
#: counter: events sent to the dead-letter topic, per source topic role
DEAD_LETTERED = Counter(
    "tokenbudget_dead_lettered_total", "Events sent to the dead-letter topic", ["topic"]
)

# --- Parquet sink -----------------------------------------------------------------

#: counter: rows written to Parquet files
PARQUET_ROWS = Counter("tokenbudget_parquet_rows_total", "Rows written to Parquet", ["dataset"])
#: counter: bytes of Parquet files written
PARQUET_BYTES = Counter("tokenbudget_parquet_bytes_total", "Parquet bytes written", ["dataset"])


class _Labelled(Collector):
    """Every series of ``registry`` with ``labels`` added: the job's namespace, so two
    jobs with the same dataset names never merge on one dashboard."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self._registry = registry
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labelled.add_sample(
                    sample.name,
                    {**sample.labels, **self._labels},
                    sample.value,
                    sample.timestamp,
                    sample.exemplar,
                )
            yield labelled


_served: set[tuple[str, int]] = set()
_serve_lock = threading.Lock()


def serving(host: str, port: int) -> bool:
    """Whether this process serves /metrics on ``host:port`` already."""
    with _serve_lock:
        return (host, port) in _served


def serve(host: str, port: int, namespace: str, role: str) -> bool:
    """Expose /metrics on ``host:port`` (once per process), every series labelled
    with ``namespace``; ``role`` names the process in ``tokenbudget_build_info``.
    Port 0 means disabled.

    A port already taken is a warning and no endpoint (False), not an error: the
    worker's job is the budget, and a crash there would restart it for ever. ``run``
    picks a free block for itself and its children before starting them, but another
    job can take one of them in the meantime."""
    if not port:
        return False
    with _serve_lock:
        if (host, port) in _served:
            return True
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Labelled(REGISTRY, {"namespace": namespace}))
        try:
            start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            log.warning(
                "the %s's metrics port %s:%d is taken (another job?): it serves no /metrics; "
                "set [metrics] port to a free block of ports",
                role,
                host,
                port,
            )
            return False
        _served.add((host, port))
        BUILD_INFO.labels(version=version(), python=platform.python_version(), role=role).set(1)
        return True


def topic_role(topic: str) -> str:
    """``ns.completions`` -> ``completions``; dashboards work across namespaces."""
    return topic.rsplit(".", 1)[-1]


def group_role(group: str) -> str:
    """``ns-dispatch`` -> ``dispatch`` (``ns-ledger``, ``ns-sink`` likewise)."""
    return group.rsplit("-", 1)[-1]


def consumed(topic: str, consumer: str, count: int = 1) -> None:
    if count:
        EVENTS_CONSUMED.labels(topic=topic_role(topic), consumer=consumer).inc(count)


class LagSampler:
    """Samples consumer-group lag into :data:`CONSUMER_LAG` (run process, every few s).

    ``checks`` maps a group id to the topics it reads. Runs in a thread: the Kafka
    admin calls block."""

    def __init__(self, bootstrap: str, checks: dict[str, list[str]], interval: float = 2.0):
        self.bootstrap = bootstrap
        self.checks = checks
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self, lag: object) -> None:
        for group, topics in self.checks.items():
            for topic in topics:
                value = lag.lag(group, [topic])  # type: ignore[attr-defined]
                CONSUMER_LAG.labels(group=group_role(group), topic=topic_role(topic)).set(value)

    def _loop(self) -> None:
        lag = None
        try:
            while not self._stop.is_set():
                try:
                    if lag is None:
                        lag = GroupLag(self.bootstrap)
                    self.sample(lag)
                except Exception as exc:  # metrics must never stop a job
                    log.debug("consumer lag sample failed: %s", exc)
                self._stop.wait(self.interval)
        finally:
            if lag is not None:
                with contextlib.suppress(Exception):
                    lag.close()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="lag-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
