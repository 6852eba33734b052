"""Prometheus counters of a worker process. They are counted in-process only: a worker
has no ``/metrics`` endpoint yet (the API's ``/metrics`` serves the API process's)."""

from __future__ import annotations

from prometheus_client import Counter

ABORTS = Counter("lastevent_aborts_total", "Engine aborts decided by the worker", ["reason"])
WASTED_TOKENS = Counter("lastevent_wasted_tokens_total", "Tokens generated that no reader received")
CONTINUED = Counter(
    "lastevent_continued_total",
    "Requests this worker continued after another worker (a takeover or a handover)",
)
REPREFILL_TOKENS = Counter(
    "lastevent_reprefill_tokens_total",
    "Tokens prefilled again to continue requests (prompt + the completion in the log)",
)
