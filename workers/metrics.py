"""Prometheus counters of a worker process. They are counted in-process only: a worker
has no ``/metrics`` endpoint yet (the API's ``/metrics`` serves the API process's)."""

from __future__ import annotations

from prometheus_client import Counter

ABORTS = Counter("lastevent_aborts_total", "Engine aborts decided by the worker", ["reason"])
WASTED_TOKENS = Counter("lastevent_wasted_tokens_total", "Tokens generated that no reader received")
