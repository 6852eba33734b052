"""The recorder: projects terminal events into Postgres, exactly once.

The outbox is a Redis stream that gets one entry *atomically with* each terminal
event (in the same Lua script). Recorders form the consumer group ``recorders``:
each entry's row and archived log are committed in one transaction (``ON
CONFLICT DO NOTHING`` on the request id), and only then acked. So:

* Postgres down: entries stay pending; the recorder retries them, oldest first,
  until it is back. Streaming never waits on Postgres.
* A recorder killed between commit and ack: the entry is delivered again (to it
  after a restart, or to another recorder via XAUTOCLAIM) and the insert is a no-op.
* The same entry delivered twice: one row.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from service.db.ledger import Ledger
from service.keys import END_ID_FIELD, EVENT_FIELD, RECORDER_GROUP, SUMMARY_FIELD, Keys
from service.stream import archive
from service.stream.events import decode_summary
from service.stream.ids import EventId

log = logging.getLogger(__name__)


class Recorder:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        ledger: Ledger,
        consumer: str,
        *,
        batch: int = 64,
        block_ms: int = 1000,
        claim_idle_ms: int = 30_000,
        retention_s: int = 7 * 86400,
        crash_after_insert: bool = False,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.ledger = ledger
        self.consumer = consumer
        self.batch = batch
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.retention_s = retention_s
        self.crash_after_insert = crash_after_insert  # fault injection for tests
        self.recorded = 0
        self._backlog = True  # read our own pending entries first
        self._last_claim = 0.0
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.keys.outbox, RECORDER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def run(self) -> None:
        await self.ensure_group()
        backoff = 0.2
        while not self._stopping.is_set():
            try:
                entries = await self._next_entries()
                for entry_id, fields in entries:
                    await self._record(entry_id, fields)
                backoff = 0.2
            except RedisError as exc:
                log.warning("recorder: redis error (retrying in %.1fs): %s", backoff, exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception as exc:  # Postgres down: keep the entries pending, retry
                log.warning("recorder: ledger write failed (retrying in %.1fs): %s", backoff, exc)
                self._backlog = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    async def _next_entries(self) -> list[tuple[bytes, dict[bytes, bytes]]]:
        if time.monotonic() - self._last_claim > max(1.0, self.claim_idle_ms / 2000):
            self._last_claim = time.monotonic()
            await self._claim_abandoned()
            await self._trim()
        start = "0" if self._backlog else ">"
        block = None if self._backlog else self.block_ms
        reply = await self.redis.xreadgroup(
            RECORDER_GROUP, self.consumer, {self.keys.outbox: start}, count=self.batch, block=block
        )
        entries = [e for _key, items in reply or [] for e in items]
        if self._backlog and not entries:
            self._backlog = False
        return entries

    async def _claim_abandoned(self) -> None:
        """Take over entries another recorder read but never acked (it died)."""
        _next, claimed, *_ = await self.redis.xautoclaim(
            self.keys.outbox,
            RECORDER_GROUP,
            self.consumer,
            min_idle_time=self.claim_idle_ms,
            start_id="0-0",
            count=self.batch,
        )
        if claimed:
            self._backlog = True

    async def _trim(self) -> None:
        oldest_ms = int((time.time() - self.retention_s) * 1000)
        await self.redis.xtrim(self.keys.outbox, minid=f"{oldest_ms}-0", approximate=True)

    async def _record(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        if not fields:  # trimmed while pending: nothing left to record
            await self._ack(entry_id)
            return
        summary = decode_summary(fields[SUMMARY_FIELD])
        end_id = fields[END_ID_FIELD].decode()
        raw = await self.redis.xrange(self.keys.log(summary.request_id))
        packed = None
        if raw:
            entries = [(EventId.from_redis(i), f[EVENT_FIELD]) for i, f in raw]
            blob, raw_size = archive.pack(entries)
            packed = (blob, len(entries), raw_size)
        else:
            log.warning("recorder: log of %s expired before it was archived", summary.request_id)
        await self.ledger.record(summary, end_id, packed)
        if self.crash_after_insert:
            os._exit(17)  # committed, not acked: the entry must be delivered again
        await self._ack(entry_id)
        self.recorded += 1

    async def _ack(self, entry_id: bytes) -> None:
        await self.redis.xack(self.keys.outbox, RECORDER_GROUP, entry_id)
