"""Prometheus metrics of the API process (exposed at /metrics)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

REQUESTS = Counter(
    "lastevent_requests_total", "Requests accepted into the queue", ["kind", "stream"]
)
REJECTED = Counter("lastevent_rejected_total", "Requests answered with an error status", ["status"])
READERS = Gauge("lastevent_readers", "Readers following a log in this API process")
REQUEUED = Counter(
    "lastevent_requeued_total",
    "Jobs queued again by the sweeper (reason: lost = a started request's worker was lost)",
    ["reason"],
)
RESUMES = Counter("lastevent_resumes_total", "Event-stream reads that started after a cursor")
