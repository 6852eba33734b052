"""Prometheus counters of a worker process (the /metrics endpoint is the API's for now;
these counts exist in-process and are logged at shutdown)."""

from __future__ import annotations

from prometheus_client import Counter

ABORTS = Counter("lastevent_aborts_total", "Engine aborts decided by the worker", ["reason"])
WASTED_TOKENS = Counter(
    "lastevent_wasted_tokens_total", "Tokens generated that no reader received"
)
