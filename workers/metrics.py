"""Prometheus metrics of a worker process and of a recorder, served on
``LASTEVENT_METRICS_PORT`` (``serve_metrics``; a worker's in-process recorder shares the
worker's endpoint, they are one process's registry).

Request timings start at the worker's claim (``dispatched_ms`` in the ledger), so that
with ``lastevent_queue_wait_seconds`` (the request's creation to its claim) they add up
to what the client waited. Times to first token, queue waits and prompt tokens are of
first runs only: a continued request's first token follows a re-prefill, and its wait
and prompt were counted when it first ran (``lastevent_continued_total`` and
``lastevent_reprefill_tokens_total`` count what continuing it cost).
"""

from __future__ import annotations

import logging
import time

import prometheus_client
from prometheus_client import Counter, Gauge, Histogram

log = logging.getLogger(__name__)

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_STEP = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_WAIT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_DURATION = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

ABORTS = Counter(
    "lastevent_aborts_total",
    "Engine aborts decided by the worker (reason: cancelled, abandoned, deadline, handover)",
    ["reason"],
)
WASTED_TOKENS = Counter("lastevent_wasted_tokens_total", "Tokens generated that no reader received")
CONTINUED = Counter(
    "lastevent_continued_total",
    "Requests this worker continued after another worker (a takeover or a handover)",
)
PARKS = Counter(
    "lastevent_parks_total",
    "Requests this worker took out of the engine, no reader being left (parked; a reader "
    "that comes back makes them go on)",
)
PARK_RESUME = Histogram(
    "lastevent_park_resume_seconds",
    "A reader's return to a parked request -> the first token of its continuation",
    buckets=_WAIT,
)
HANDED_OVER = Counter(
    "lastevent_handed_over_total",
    "Requests this worker handed over to another when it stopped",
)
REPREFILL_TOKENS = Counter(
    "lastevent_reprefill_tokens_total",
    "Tokens prefilled again to continue requests (prompt + the completion in the log)",
)
PROMPT_TOKENS = Counter(
    "lastevent_prompt_tokens_total",
    "Prompt tokens of the requests this worker started (model: the one asked for)",
    ["model"],
)
COMPLETION_TOKENS = Counter(
    "lastevent_completion_tokens_total",
    "Tokens the engine generated in this worker (those made after an abort decision too)",
    ["model"],
)
TIME_TO_FIRST_TOKEN = Histogram(
    "lastevent_time_to_first_token_seconds",
    "The worker's claim to the engine's first token of the request (any of its choices)",
    ["model"],
    buckets=_LATENCY,
)
INTER_TOKEN_LATENCY = Histogram(
    "lastevent_inter_token_latency_seconds",
    "Per engine output after a choice's first token: the time since its previous output "
    "divided by the output's tokens (engines emit one token per step: per token)",
    ["model"],
    buckets=_STEP,
)
QUEUE_WAIT = Histogram(
    "lastevent_queue_wait_seconds",
    "The request's Created event to the worker's claim",
    ["model"],
    buckets=_WAIT,
)
REQUEST_DURATION = Histogram(
    "lastevent_request_duration_seconds",
    "The worker's claim to the request's terminal event appended, by its end state",
    ["state", "model"],
    buckets=_DURATION,
)
ENGINE_STEP = Histogram(
    "lastevent_engine_step_seconds",
    "How long a choice waited for the engine's next output, after its first (the gap "
    "between outputs less the worker's appends in between)",
    buckets=_STEP,
)
APPEND_WAIT = Histogram(
    "lastevent_append_wait_seconds",
    "How long a choice's generation loop waited for its deltas' append (batched flush "
    "and its Redis round trip)",
    buckets=_STEP,
)
RUNNING = Gauge(
    "lastevent_running_requests", "Requests this worker holds (its busy slots)", ["model"]
)
SLOTS = Gauge(
    "lastevent_worker_slots", "Requests this worker takes at once (0: stopping)", ["model"]
)

RECORDED = Counter(
    "lastevent_recorded_total",
    "Outbox entries recorded into Postgres (result: new row, or duplicate: a redelivery)",
    ["result"],
)
RECORD_DURATION = Histogram(
    "lastevent_record_duration_seconds",
    "One outbox entry: log archived, row committed, entry acked",
    buckets=_STEP,
)
RECORD_LAG = Histogram(
    "lastevent_record_lag_seconds",
    "The terminal event (its outbox entry) to its new row committed",
    buckets=_WAIT,
)
LEDGER_FAILURES = Counter(
    "lastevent_ledger_failures_total",
    "Recorder failures other than Redis's (the ledger's): the entries stay pending, retried",
)


def serve_metrics(port: int, host: str) -> None:
    """The process's ``/metrics`` on ``host:port`` (prometheus_client's own server, on a
    daemon thread: it goes with the process). 0: none. A port already taken is logged,
    not fatal: a worker that cannot be scraped still serves its requests."""
    if not port:
        return
    try:
        prometheus_client.start_http_server(port, addr=host)
    except OSError as exc:
        log.error("metrics endpoint not served on %s:%d: %s", host, port, exc)
        return
    log.info("metrics on http://%s:%d/metrics", host, port)


class FirstToken:
    """A request's first token, at the first token of whichever of its choices makes one:
    ``at`` (unix s, for its billing row), and its time to first token, observed once.
    ``since``: the claim (unix s); None: not observed (a continued request)."""

    __slots__ = ("_ttft", "at", "since")

    def __init__(self, since: float | None, model: str) -> None:
        self.since = since
        self.at: float | None = None
        self._ttft = TIME_TO_FIRST_TOKEN.labels(model=model)

    def seen(self, at: float) -> None:
        if self.at is None:
            self.at = at
        if self.since is not None:
            self._ttft.observe(max(0.0, at - self.since))
            self.since = None


class Steps:
    """One choice's engine outputs as they arrive: tokens, inter-token latency, engine
    step time. The step is the gap between two outputs less the appends awaited in
    between, the rest of the loop's work being synchronous and small."""

    __slots__ = ("_appending", "_itl", "_last", "_tokens")

    def __init__(self, model: str) -> None:
        self._last: float | None = None  # the previous output's time, from the first token
        self._appending = 0.0
        self._tokens = COMPLETION_TOKENS.labels(model=model)
        self._itl = INTER_TOKEN_LATENCY.labels(model=model)

    def output(self, tokens: int) -> None:
        now = time.monotonic()
        self._tokens.inc(tokens)
        if self._last is not None:
            gap = now - self._last
            ENGINE_STEP.observe(max(0.0, gap - self._appending))
            if tokens:
                self._itl.observe(gap / tokens)
        if tokens or self._last is not None:
            self._last = now
        self._appending = 0.0

    def appended(self, since: float) -> None:
        """An append awaited from ``since`` (``time.monotonic()``) until now. (Not a
        context manager: one per token per request was a measurable share of the
        worker's CPU.)"""
        took = time.monotonic() - since
        self._appending += took
        APPEND_WAIT.observe(took)
