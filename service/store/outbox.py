"""The outbox: one entry per terminal event, written in the same script as the event
(``append.lua``, ``cancel.lua``), read by the consumer group ``recorders``.

An entry holds the ended request's ``Summary`` and its terminal event id. Recorders
read it, commit the billing row and the archive, then ack; ``billing reconcile``
reads a time range of it.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from service.store import groups, replies
from service.store.commit import Committer, Durability
from service.store.keys import END_ID_FIELD, RECORDER_GROUP, SUMMARY_FIELD, Keys
from service.stream.events import Summary, decode_summary, encode_summary
from service.stream.ids import EventId

# (outbox entry id, (summary, terminal event id) -- or None for an entry trimmed while pending)
Entry = tuple[bytes, tuple[Summary, str] | None]


def _entry(entry_id: bytes, fields: dict[bytes, bytes] | None) -> Entry:
    if not fields:
        return entry_id, None
    return entry_id, (decode_summary(fields[SUMMARY_FIELD]), replies.text(fields[END_ID_FIELD]))


class Outbox:
    """The partitions' outboxes (an entry goes to its request's partition)."""

    def __init__(self, redis: Redis, keys: Keys, committer: Committer | None = None) -> None:
        self.redis = redis
        self.keys = keys
        # a recorder bills only committed ends (``commit.py``): an end a crash could take
        # back is read again once it is committed, or never billed
        self.committer = committer or Committer(redis, keys, Durability.MEMORY)

    async def ensure_group(self) -> None:
        for p in self.keys.all_partitions:
            await groups.ensure(self.redis, self.keys.outbox(p), RECORDER_GROUP)

    async def read(
        self, partition: int, consumer: str, count: int, *, pending: bool, block_ms: int
    ) -> list[Entry]:
        """``pending``: this consumer's own unacked entries of a partition, oldest first
        (no wait); otherwise new entries, waiting up to ``block_ms`` for one. Raises
        ``Uncommitted`` if they cannot be confirmed committed (they stay pending)."""
        mark = self.committer.mark(partition)
        found = await groups.read(
            self.redis,
            [self.keys.outbox(partition)],
            RECORDER_GROUP,
            consumer,
            pending=pending,
            count=count,
            block_ms=block_ms,
        )
        entries = [entry for _stream, got in found for entry in got]
        if entries:
            await self.committer.confirm(partition, mark)
        return [_entry(eid, fields) for eid, fields in entries]

    async def claim_idle(self, partition: int, consumer: str, min_idle_ms: int, count: int) -> int:
        """Take over entries another recorder read but never acked (it died)."""
        reply: Any = await self.redis.xautoclaim(
            self.keys.outbox(partition),
            RECORDER_GROUP,
            consumer,
            min_idle_time=min_idle_ms,
            start_id="0-0",
            count=count,
        )
        return len(reply[1])

    async def trim(self, partition: int, oldest_ms: int) -> None:
        await self.redis.xtrim(
            self.keys.outbox(partition), minid=f"{oldest_ms}-0", approximate=True
        )

    async def ack(self, partition: int, entry_id: bytes) -> None:
        await self.redis.xack(self.keys.outbox(partition), RECORDER_GROUP, entry_id)

    async def add(self, summary: Summary, end_id: str) -> None:
        """An entry for a request whose log Redis lost (its terminal event cannot be
        written): the ledger still gets its row."""
        await self.redis.xadd(
            self.keys.outbox_of(summary.request_id),
            {SUMMARY_FIELD: encode_summary(summary), END_ID_FIELD: end_id},
        )

    async def ended_between(self, since_ms: int, until_ms: int) -> list[tuple[Summary, str]]:
        """Summaries whose terminal event id falls in [since_ms, until_ms), all partitions."""
        # an entry is written in the same script as its terminal event: same ms or later
        pipe = self.redis.pipeline(transaction=False)
        start = max(since_ms, 0)  # (a stream id has no sign: before 1970 is the start)
        for p in self.keys.all_partitions:
            pipe.xrange(self.keys.outbox(p), min=f"{start}-0", max="+")
        marks = self.committer.marks(self.keys.all_partitions)
        found: Any = await pipe.execute()
        await self.committer.confirm_all(marks)
        out = []
        for raw in found:
            for entry_id, fields in raw:
                _id, entry = _entry(entry_id, fields)
                if entry is not None and since_ms <= int(entry[1].split("-")[0]) < until_ms:
                    out.append(entry)
        return sorted(out, key=lambda e: EventId.parse(e[1]))
