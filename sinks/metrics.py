"""Every Prometheus metric tokenbudget exports, declared once, here.

Names carry the ``tokenbudget_`` prefix. Ledger gauges are set only by the ledger
worker (their single owner), so several processes never report conflicting values.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

COMPLETION_TOKENS = Counter(
    "tokenbudget_completion_tokens_total", "Completion tokens kept, per dataset", ["dataset"]
)
PROMPT_TOKENS = Counter(
    "tokenbudget_prompt_tokens_total", "Prompt tokens of kept completions", ["dataset"]
)
SAMPLES = Counter("tokenbudget_samples_total", "Completions kept, per dataset", ["dataset"])
SKIPPED_PROMPTS = Counter(
    "tokenbudget_skipped_prompts_total",
    "Prompts not sent because their dataset was halted",
    ["dataset"],
)
BUDGET = Gauge("tokenbudget_budget_tokens", "Budget per dataset, in its unit", ["dataset"])
BUDGET_REMAINING = Gauge(
    "tokenbudget_budget_remaining_tokens", "Budget left per dataset", ["dataset"]
)
OVERSHOOT = Gauge(
    "tokenbudget_overshoot_tokens", "Tokens kept beyond the budget, per dataset", ["dataset"]
)
HALTED = Gauge("tokenbudget_dataset_halted", "1 when the dataset is halted", ["dataset"])
IN_FLIGHT = Gauge("tokenbudget_inflight_requests", "Inference requests in flight")
REQUEST_LATENCY = Histogram(
    "tokenbudget_request_latency_seconds",
    "Inference request latency",
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
INFERENCE_ERRORS = Counter(
    "tokenbudget_inference_errors_total", "Failed inference attempts by kind", ["kind"]
)
EVENTS_PRODUCED = Counter(
    "tokenbudget_events_produced_total", "Events produced, per topic role", ["topic"]
)
DEAD_LETTERED = Counter(
    "tokenbudget_dead_lettered_total", "Events sent to the dead-letter topic", ["topic"]
)
PARQUET_ROWS = Counter("tokenbudget_parquet_rows_total", "Rows written to Parquet", ["dataset"])
PARQUET_BYTES = Counter("tokenbudget_parquet_bytes_total", "Parquet bytes written", ["dataset"])


def serve(host: str, port: int) -> None:
    """Expose /metrics; port 0 means disabled."""
    if port:
        start_http_server(port, addr=host)


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
        if state.completion_tokens > completion:
            COMPLETION_TOKENS.labels(dataset=name).inc(state.completion_tokens - completion)
        if state.prompt_tokens > prompt:
            PROMPT_TOKENS.labels(dataset=name).inc(state.prompt_tokens - prompt)
        if state.samples > samples:
            SAMPLES.labels(dataset=name).inc(state.samples - samples)
        self._last[name] = (state.completion_tokens, state.prompt_tokens, state.samples)
        HALTED.labels(dataset=name).set(1 if state.halted else 0)
        if state.budget is not None:
            spent = ledger.used(state)
            BUDGET.labels(dataset=name).set(state.budget)
            BUDGET_REMAINING.labels(dataset=name).set(max(0, state.budget - spent))
            OVERSHOOT.labels(dataset=name).set(max(0, spent - state.budget))
