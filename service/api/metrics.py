"""Prometheus metrics of the API process (exposed at /metrics)."""

from __future__ import annotations

import asyncio

from prometheus_client import Counter, Gauge, Histogram

from service.store.local import LocalFeed
from service.store.tail import LogTailer

REQUESTS = Counter(
    "lastevent_requests_total", "Requests accepted into the queue", ["kind", "stream", "model"]
)
REJECTED = Counter(
    "lastevent_rejected_total",
    "Requests answered with an error status (reason: the error's code, else its kind)",
    ["status", "reason"],
)
READERS = Gauge("lastevent_readers", "Readers following a log in this API process")
WORKER_CONNECTIONS_LOST = Counter(
    "lastevent_worker_connections_lost_total",
    "Workers whose named connection this API process saw gone (their jobs taken over)",
)
WORKERS_CONNECTED = Gauge(
    "lastevent_workers_connected",
    "Workers whose named connection this API process's last poll saw (it can tell their death)",
)
REQUEUED = Counter(
    "lastevent_requeued_total",
    "Jobs queued again by the sweeper (reason: lost = a started request's worker was lost)",
    ["reason"],
)
RESUMES = Counter("lastevent_resumes_total", "Event-stream reads that started after a cursor")
RETURNS = Counter(
    "lastevent_returns_total",
    "Readers that came back to a parked request (it goes on: queued again for a worker)",
)
RENDERING = Gauge(
    "lastevent_prompts_rendering",
    "Prompts being templated or tokenized off the event loop, or waiting for a thread to",
)
TAIL_READS = Gauge(
    "lastevent_tail_reads",
    "XREAD calls of this process's tail shards so far (a node's own readers need none)",
)
FROM_MEMORY = Gauge(
    "lastevent_node_events_from_memory",
    "Events a node handed its readers from its worker's appends, not read back from Redis",
)
EVENT_LOOP_LAG = Histogram(
    "lastevent_event_loop_lag_seconds",
    "How late the event loop woke a sleep (every stream of the process waits as long)",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0),
)


def watch_tail(tailer: LogTailer, feed: LocalFeed | None) -> None:
    """The tail's counters, read at each scrape."""
    TAIL_READS.set_function(lambda: tailer.reads)
    if feed is not None:
        FROM_MEMORY.set_function(lambda: feed.delivered)


async def watch_loop_lag(interval_s: float = 0.25) -> None:
    """Sleep ``interval_s`` again and again and observe the overshoot: what a blocked or
    saturated loop costs every reader, which no request's own timing shows."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(interval_s)
        EVENT_LOOP_LAG.observe(max(0.0, loop.time() - start - interval_s))
