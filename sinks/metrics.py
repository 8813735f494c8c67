"""Every Prometheus metric tokenbudget exports, declared once, here.

Names carry the ``tokenbudget_`` prefix; each declaration says its type and meaning.
Each long-running process serves its own registry on ``/metrics`` (:func:`serve`,
127.0.0.1 by default): ``tokenbudget run`` on ``[metrics] port`` and its ledger
worker on the next port, ``tokenbudget ledger --metrics-port P`` on ``P``.

Who sets what:

* the **ledger worker** (the single owner of budget state) sets every per-dataset
  ledger metric through :class:`LedgerGauges`: kept tokens/samples (counters),
  budget, used, remaining, reserved, overshoot, halted and open (gauges). No other
  process touches them, so several processes never report conflicting values;
* the **run process** sets the dispatcher's metrics (in-flight, latency, TTFT,
  inference errors, skipped prompts), the sink's (Parquet rows and bytes), events
  produced/consumed, dead letters, consumer lag (:class:`LagSampler`) and the
  overshoot allowance;
* events consumed and dead letters are also counted by the ledger, labelled
  ``consumer="ledger"``.

Topic labels are the topic's role (``prompts``, ``completions``, ``budgets``,
``outcomes``, ``deadletter``), not its namespaced name: see :func:`topic_role`.
"""

from __future__ import annotations

import contextlib
import logging
import threading

from prometheus_client import Counter, Gauge, Histogram, start_http_server

log = logging.getLogger(__name__)

# --- per dataset, owned by the ledger worker (LedgerGauges) -------------------------

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
#: gauge: 1 when the dataset is halted (its budget was reached), else 0
HALTED = Gauge("tokenbudget_dataset_halted", "1 when the dataset is halted", ["dataset"])
#: gauge: 1 while the dataset is open (neither halted nor exhausted), else 0
OPEN = Gauge(
    "tokenbudget_dataset_open",
    "1 while the dataset is open: not halted, not exhausted",
    ["dataset"],
)

# --- per dataset, set by the run process -----------------------------------------

#: counter: prompts not sent because their dataset was halted (dispatcher)
SKIPPED_PROMPTS = Counter(
    "tokenbudget_skipped_prompts_total",
    "Prompts not sent because their dataset was halted",
    ["dataset"],
)
#: gauge: the overshoot the design allows, in the budget's unit: what can still be in
#: flight when the halt comes (concurrency x max_new_tokens; concurrency for samples)
OVERSHOOT_ALLOWANCE = Gauge(
    "tokenbudget_overshoot_allowance_tokens",
    "Overshoot bound from in-flight requests (concurrency x max_new_tokens), per dataset",
    ["dataset"],
)

# --- inference (dispatcher) -------------------------------------------------------

#: gauge: inference requests in flight
IN_FLIGHT = Gauge("tokenbudget_inflight_requests", "Inference requests in flight")
#: histogram: seconds from sending a request to its complete answer
REQUEST_LATENCY = Histogram(
    "tokenbudget_request_latency_seconds",
    "Inference request latency",
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
#: counter: times dispatch paused because the inference server was away
SERVER_PAUSES = Counter(
    "tokenbudget_server_pauses_total", "Times dispatch paused because the server was away"
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

_served: set[tuple[str, int]] = set()
_serve_lock = threading.Lock()


def serve(host: str, port: int) -> None:
    """Expose /metrics on ``host:port`` (once per process); port 0 means disabled."""
    if not port:
        return
    with _serve_lock:
        if (host, port) in _served:
            return
        start_http_server(port, addr=host)
        _served.add((host, port))


def topic_role(topic: str) -> str:
    """``ns.completions`` -> ``completions``; dashboards work across namespaces."""
    return topic.rsplit(".", 1)[-1]


def group_role(group: str) -> str:
    """``ns-dispatch`` -> ``dispatch`` (``ns-ledger``, ``ns-sink`` likewise)."""
    return group.rsplit("-", 1)[-1]


def consumed(topic: str, consumer: str, count: int = 1) -> None:
    if count:
        EVENTS_CONSUMED.labels(topic=topic_role(topic), consumer=consumer).inc(count)


def overshoot_allowance(unit: str, concurrency: int, max_new_tokens: int) -> int:
    """What may still be in flight when a halt comes, in the budget's unit.

    For ``total_tokens`` the prompt tokens of those requests come on top (unknown
    before they are sent), so this is a lower bound there."""
    return concurrency if unit == "samples" else concurrency * max_new_tokens


class LedgerGauges:
    """Mirrors ledger states into the metrics above; used only by the ledger worker.

    Counters cannot be set, so kept totals advance by the difference from the last
    state seen (a restarted worker starts its counters at zero again, which
    Prometheus' ``rate`` and ``increase`` treat as a counter reset).
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, int, int]] = {}

    def observe(self, state: object) -> None:
        from streams import ledger

        assert isinstance(state, ledger.DatasetLedger)
        name = state.dataset
        completion, prompt, samples = self._last.get(name, (0, 0, 0))
        # Labelled children exist from the first state on (at 0), so "no progress"
        # is a series that does not grow rather than a missing one.
        for counter, now, before in (
            (COMPLETION_TOKENS, state.completion_tokens, completion),
            (PROMPT_TOKENS, state.prompt_tokens, prompt),
            (SAMPLES, state.samples, samples),
        ):
            child = counter.labels(dataset=name)
            if now > before:
                child.inc(now - before)
        self._last[name] = (state.completion_tokens, state.prompt_tokens, state.samples)
        HALTED.labels(dataset=name).set(1 if state.halted else 0)
        OPEN.labels(dataset=name).set(1 if ledger.status(state) == "open" else 0)
        RESERVED.labels(dataset=name).set(getattr(state, "reserved", 0) or 0)
        if state.budget is not None:
            spent = ledger.used(state)
            BUDGET.labels(dataset=name).set(state.budget)
            BUDGET_USED.labels(dataset=name).set(spent)
            BUDGET_REMAINING.labels(dataset=name).set(max(0, state.budget - spent))
            OVERSHOOT.labels(dataset=name).set(max(0, spent - state.budget))


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
        from tokenbudget.kafka import GroupLag

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
