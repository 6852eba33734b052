"""The recorder: projects terminal events into Postgres, exactly once.

The outbox (``service/store/outbox.py``) gets one entry *atomically with* each
terminal event. Recorders form the consumer group ``recorders``: each entry's row and
archived log are committed in one transaction (``ON CONFLICT DO NOTHING`` on the
request id), and only then acked. So:

* Postgres down: entries stay pending; the recorder retries them, oldest first,
  until it is back. Streaming never waits on Postgres.
* A recorder killed between commit and ack: the entry is delivered again (to it
  after a restart, or to another recorder via XAUTOCLAIM) and the insert is a no-op.
* The same entry delivered twice: one row.

Every worker runs one (``LASTEVENT_RECORDER_IN_WORKER``); ``lastevent recorder`` runs more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
import logging
import os
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from service.ledger.ledger import Ledger
from service.store.admission import Slot, free_slots
from service.store.log import RedisLog
from service.store.outbox import Entry, Outbox
from service.store.pool import STORE_ERRORS, Backoff
from service.stream import archive
from workers.metrics import LEDGER_FAILURES, RECORD_DURATION, RECORD_LAG, RECORDED

log = logging.getLogger(__name__)
T = TypeVar("T")


class Recorder:
    def __init__(
        self,
        outbox: Outbox,
        log_: RedisLog,
        ledger: Ledger,
        consumer: str,
        *,
        batch: int = 64,
        block_ms: int = 1000,
        claim_idle_ms: int,  # (these three: Settings' recorder_*, outbox_retention_s)
        retention_s: int,
        crash_after_insert: bool,
        record_timeout_s: float = 20.0,
    ) -> None:
        self.outbox = outbox
        self.log = log_
        self.ledger = ledger
        self.consumer = consumer
        self.batch = batch
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.retention_s = retention_s
        self.crash_after_insert = crash_after_insert  # fault injection for tests
        self.record_timeout_s = record_timeout_s  # one entry's row, archive and ack
        self._stopping = asyncio.Event()
        self._left_behind: set[asyncio.Task[Any]] = set()  # stalled work that ignored cancel

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        """One loop per partition's outbox."""
        await self.outbox.ensure_group()
        await asyncio.gather(*(self._run(p) for p in self.outbox.keys.all_partitions))

    async def _run(self, partition: int) -> None:
        state = _Reading()
        backoff = Backoff(0.2, 5.0)
        while not self._stopping.is_set():
            try:
                entries = await self._bounded(
                    self._next_entries(partition, state),
                    f"reading partition {partition}'s outbox",
                    self.block_ms / 1000 + self.record_timeout_s,
                )
                for entry in entries:
                    await self._bounded(
                        self._record(partition, entry),
                        f"recording {entry[0]!r}",
                        self.record_timeout_s,
                    )
                backoff.succeeded()
            except Stalled as exc:
                log.warning("recorder: stalled (retrying): %s", exc)
                state.backlog = True
            except STORE_ERRORS as exc:
                # (an OSError may be Postgres's too: asyncpg's lost connection is one)
                log.warning("recorder: store error (retrying in %.1fs): %s", backoff.next_s, exc)
                state.backlog = True  # what was read and not acked: read it again first
                await backoff.wait()
            except Exception:  # Postgres down: keep the entries pending, retry
                log.warning(
                    "recorder: ledger write failed (retrying in %.1fs)",
                    backoff.next_s,
                    exc_info=True,
                )
                LEDGER_FAILURES.inc()
                state.backlog = True
                await backoff.wait()

    async def _bounded(self, work: Coroutine[Any, Any, T], what: str, timeout_s: float) -> T:
        """``work``, within ``timeout_s``: else it is cancelled and ``Stalled`` raised, with
        where it waited. Work that does not even stop when cancelled (an await that swallows
        the cancellation) is left behind, so that the partition's loop goes on regardless.
        (Once, in CI, one partition's loop stopped for good during a Postgres outage through
        a proxy, no error logged: a bound on the record alone did not catch it.)"""
        task = asyncio.ensure_future(work)
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if task in done:
            return task.result()
        where = io.StringIO()
        task.print_stack(file=where)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=1.0)
        if task not in done:
            self._left_behind.add(task)
            task.add_done_callback(self._left_behind.discard)
            what += " (it did not stop when cancelled: left behind)"
        raise Stalled(f"{what} took over {timeout_s:g} s; it waited at:\n{where.getvalue()}")

    async def _next_entries(self, partition: int, state: _Reading) -> list[Entry]:
        if time.monotonic() - state.last_claim > max(1.0, self.claim_idle_ms / 2000):
            state.last_claim = time.monotonic()
            claimed = await self.outbox.claim_idle(
                partition, self.consumer, self.claim_idle_ms, self.batch
            )
            if claimed:
                state.backlog = True
            await self.outbox.trim(partition, int((time.time() - self.retention_s) * 1000))
        entries = await self.outbox.read(
            partition, self.consumer, self.batch, pending=state.backlog, block_ms=self.block_ms
        )
        if state.backlog and not entries:
            state.backlog = False
        return entries

    async def _record(self, partition: int, entry: Entry) -> None:
        entry_id, found = entry
        if found is None:  # trimmed while pending: nothing left to record
            await self.outbox.ack(partition, entry_id)
            return
        summary, end_id = found
        started = time.monotonic()
        packed = None
        if summary.store:  # (``store: false``: the billing row only)
            entries = await self.log.read_raw(summary.request_id)
            if entries:
                blob, raw_size = archive.pack(entries)
                packed = (blob, len(entries), raw_size)
            else:
                log.warning(
                    "recorder: log of %s expired before it was archived", summary.request_id
                )
        if await self.ledger.record(summary, end_id, packed):
            RECORDED.labels(result="new").inc()
            RECORD_LAG.observe(max(0.0, time.time() - int(entry_id.split(b"-")[0]) / 1000))
        else:
            RECORDED.labels(result="duplicate").inc()
        if self.crash_after_insert:
            os._exit(17)  # committed, not acked: the entry must be delivered again
        # the admission slot, in case the process that wrote the end died before freeing it
        keys, rid = self.outbox.keys, summary.request_id
        await free_slots(
            self.outbox.redis, [Slot.of(keys, rid, summary.tenant, summary.api_key_id)]
        )
        await self.outbox.ack(partition, entry_id)
        RECORD_DURATION.observe(time.monotonic() - started)


class Stalled(Exception):
    """Reading the outbox or recording one entry did not finish in time: a connection that
    hangs instead of failing. What was read is read again."""


@dataclasses.dataclass(slots=True)
class _Reading:
    """A partition loop's state: read its own pending entries first (``backlog``)."""

    backlog: bool = True
    last_claim: float = 0.0
