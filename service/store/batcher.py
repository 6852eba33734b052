"""The append batcher: how a worker writes its requests' logs.

Every append made while the previous round trip was in flight (or within the flush
interval) goes out in the next one, as one call of the append script per partition,
so all of one engine step's deltas -- for every request the worker runs -- cost one
round trip and one Redis command.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence

from service.store.local import LocalFeed
from service.store.log import LogError, Owner, RedisLog
from service.store.pool import UNREACHABLE, Backoff
from service.store.scripts.append import Append
from service.stream import events as ev
from service.stream.endings import Ending
from service.stream.ids import EventId


class AppendBatcher:
    """Group commit for a worker's appends: one script call per flush.

    While Redis cannot be reached (a restart, a failover), a flush is sent again with
    backoff until each append's ``give_up_at``; the appends carry their owner's position,
    so one whose reply was lost is not written twice.

    ``interval_s``: a flush is sent no sooner than this after the previous one was (an
    append after a quiet spell goes at once). Under load every flush then carries the
    steps of that long -- fewer round trips, script calls and tail wakes per token, at
    the cost of up to ``interval_s`` more latency per token (vLLM's ``--stream-interval``,
    in time; an engine whose outputs queue while its consumer waits, as vLLM's do, also
    merges a fast request's steps meanwhile)."""

    def __init__(
        self,
        log: RedisLog,
        *,
        max_backoff_s: float = 0.25,
        interval_s: float = 0.0,
        feed: LocalFeed | None = None,
    ) -> None:
        """``feed``: the node's readers (``local.py``), handed what each flush wrote."""
        self._log = log
        self.feed = feed
        self._interval_s = interval_s
        self._last_sent = -interval_s
        self._pending: list[tuple[Append, Owner, float, asyncio.Future[list[EventId]]]] = []
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._max_backoff_s = max_backoff_s
        self.round_trips = 0  # for tests and metrics: flushes sent
        self.appends = 0
        self.retries = 0  # flushes sent again after a connection failure

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="append-batcher")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def append(
        self, owner: Owner, events: Sequence[ev.Event], *, give_up_at: float = 0.0
    ) -> list[EventId]:
        """Append at ``owner``'s position; ``give_up_at`` (unix s): keep trying through a
        Redis outage until then (0: fail on the first connection error)."""
        item = Append(owner.request_id, owner.epoch, events, expect=owner.events)
        return await self._add(item, owner, give_up_at)

    async def end(
        self, owner: Owner, ending: Ending, *, ack: bytes = b"", give_up_at: float = 0.0
    ) -> list[EventId]:
        """The request's terminal append (``RedisLog.terminal``), acknowledging the queue
        entry ``ack`` in the same step."""
        item = self._log.terminal(
            owner.request_id, owner.epoch, ending, expect=owner.events, ack=ack
        )
        return await self._add(item, owner, give_up_at)

    async def _add(self, item: Append, owner: Owner, give_up_at: float) -> list[EventId]:
        future: asyncio.Future[list[EventId]] = asyncio.get_running_loop().create_future()
        self._pending.append((item, owner, give_up_at, future))
        self._wakeup.set()
        return await future

    async def _run(self) -> None:
        backoff = Backoff(0.05, self._max_backoff_s)
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            wait = self._last_sent + self._interval_s - time.monotonic()
            # let every task that is ready in this loop iteration (or, with an interval,
            # until it is over) add its step first
            await asyncio.sleep(max(0.0, wait))
            batch, self._pending = self._pending, []
            if not batch:
                continue
            self._last_sent = time.monotonic()
            retry = await self._flush(batch)
            if retry:
                self._pending[:0] = retry  # first in the next flush, in their order
                self._wakeup.set()
                self.retries += 1
                await backoff.wait()
            else:
                backoff.succeeded()

    async def _flush(
        self, batch: list[tuple[Append, Owner, float, asyncio.Future[list[EventId]]]]
    ) -> list[tuple[Append, Owner, float, asyncio.Future[list[EventId]]]]:
        """Send ``batch``; returns what must be sent again (Redis unreachable)."""
        batch = [entry for entry in batch if not entry[3].done()]  # callers that gave up
        items = _merged([(item, owner) for item, owner, *_ in batch])
        committer, keys = self._log.committer, self._log.keys
        marks = (
            {p: committer.mark(p) for p in {keys.partition(i.request_id) for i, _ in items}}
            if self.feed is not None and committer.needed
            else {}
        )
        try:
            merged = await self._log.append_many([item for item, _ in items])
        except UNREACHABLE as exc:
            now = time.time()
            retry = []
            for entry in batch:
                if entry[2] > now:
                    retry.append(entry)
                else:
                    entry[3].set_exception(exc)
            return retry
        except Exception as exc:  # noqa: BLE001 - every caller of this flush gets it raised
            for *_, future in batch:
                future.set_exception(exc)
            return []
        self.round_trips += 1
        self.appends += len(batch)
        results = _split([(item, owner) for item, owner, *_ in batch], items, merged)
        for (*_, future), result in zip(batch, results, strict=True):
            if isinstance(result, LogError):
                future.set_exception(result)
            else:
                future.set_result(result)
        for (_, owner), result in zip(items, merged, strict=True):
            if not isinstance(result, LogError):
                owner.events += len(result)
        if self.feed is not None:
            written = [
                (item.request_id, list(zip(result, item.events, strict=True)))
                for (item, _), result in zip(items, merged, strict=True)
                if not isinstance(result, LogError)
            ]
            if committer.needed:
                self.feed.publish_committed(committer, marks, written)
            else:
                self.feed.publish(written)
        return []


def _merged(batch: list[tuple[Append, Owner]]) -> list[tuple[Append, Owner]]:
    """One append per owner: a request's appends in one flush (its choices' steps) are
    one script item, at the owner's position when the flush is sent (another choice's
    append may have been in flight when this one was made), so that a flush sent again
    after a lost reply is recognised as written. A terminal append is the owner's last."""
    out: dict[int, tuple[Append, Owner]] = {}
    for item, owner in batch:
        prev = out.get(id(owner))
        if prev is None:  # the position now: earlier flushes have moved it
            item.expect = owner.events  # (the item is this batcher's own: set, not copied)
            out[id(owner)] = (item, owner)
            continue
        first = prev[0]
        out[id(owner)] = (
            dataclasses.replace(item, events=[*first.events, *item.events], expect=first.expect),
            owner,
        )
    return list(out.values())


def _split(
    batch: list[tuple[Append, Owner]],
    items: list[tuple[Append, Owner]],
    results: Sequence[list[EventId] | LogError],
) -> list[list[EventId] | LogError]:
    """Each append of ``batch``'s share of its owner's merged result, in batch order."""
    by_owner = {id(owner): result for (_, owner), result in zip(items, results, strict=True)}
    taken: dict[int, int] = {}
    out: list[list[EventId] | LogError] = []
    for item, owner in batch:
        result = by_owner[id(owner)]
        if isinstance(result, LogError):
            out.append(result)
            continue
        start = taken.get(id(owner), 0)
        taken[id(owner)] = start + len(item.events)
        out.append(result[start : start + len(item.events)])
    return out
