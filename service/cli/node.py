"""``lastevent node``: the HTTP server and a worker in one process, where one process per
GPU host is the deployment (vLLM's engine core stays in a process of its own, as
``vllm serve`` runs it). It is the API and the worker of the split deployment, composed
here -- the only package that imports both -- around one ``LocalFeed``
(``store/local.py``): a reader connected to the node gets the requests its worker runs
from memory once their appends are committed, instead of reading them back from Redis.
Everything else goes through Redis as in the split deployment: readers on other
replicas, resumes, replays, takeovers, parks, the sweeper, other workers and nodes.

SIGTERM / SIGINT: the HTTP server drains (streams are told to reconnect, within
``LASTEVENT_DRAIN_S``) and the worker drains as a worker does (its running requests are
handed to other workers, or wait in the queue for this node's next start)."""

from __future__ import annotations

import asyncio
import logging

from service import aio
from service.api.server import server
from service.settings import Settings
from service.store.local import LocalFeed
from workers.__main__ import serve as serve_worker
from workers.runner import Runner


def node(settings: Settings) -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # (a line per upstream call)
    aio.run(_serve(settings), settings.event_loop)


class _Worker:
    """The node's worker: stopped by the server's signal handler, even before it runs."""

    def __init__(self) -> None:
        self.runner: Runner | None = None
        self.stopping = False

    def hold(self, runner: Runner) -> None:
        self.runner = runner
        if self.stopping:
            runner.stop()

    def stop(self) -> None:
        self.stopping = True
        if self.runner is not None:
            self.runner.stop()


async def _serve(settings: Settings) -> None:
    feed = LocalFeed()
    worker = _Worker()
    http = server(settings, feed, on_exit=worker.stop)
    working = asyncio.create_task(serve_worker(settings, feed, worker.hold), name="worker")
    # a worker that stops by itself (its engine failed to load, or died) stops the node
    working.add_done_callback(lambda _t: setattr(http, "should_exit", True))
    try:
        await http.serve()
    finally:
        worker.stop()
        await asyncio.wait({working})
    if not working.cancelled() and working.exception() is not None:
        raise SystemExit(f"the node's worker failed: {working.exception()!r}")
