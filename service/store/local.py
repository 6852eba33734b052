"""The node's in-memory path (``lastevent node``: the HTTP server and a worker in one
process). A reader connected to the process whose worker writes its request's log gets
each event from memory the moment its append is committed -- at ``memory`` and ``disk``
the append's reply (``appendfsync always`` answers after the fsync), at ``replica`` the
commit barrier after it -- instead of waiting for a wake and reading it back from Redis.

The log in Redis stays the source of truth: a reader starts from a read of it (from its
cursor), and whenever the writer lets go of the request without ending it (a park, a
hand-over, a takeover that fenced it out, a failed barrier) its readers go back to
following the log in Redis from where they are, as every reader on another replica does
all along. So resume, replay, takeover and park work as in the split deployment.

``LocalFeed`` is the meeting point: the worker's ``serve`` says which requests it owns
(``own`` / ``release``), its ``AppendBatcher`` hands over what each flush wrote
(``publish``), and the API's ``LogTailer`` attaches its readers (``bind``)."""

from __future__ import annotations

import asyncio
import logging

from service.store.commit import Committer
from service.store.mailbox import Batch, Subscription, Tailer

log = logging.getLogger(__name__)


class LocalFeed:
    """The requests this process's worker writes, and the readers fed from its appends."""

    def __init__(self) -> None:
        self._owned: set[str] = set()
        self._subs: dict[str, set[Subscription]] = {}
        self._tailer: Tailer | None = None
        # flushes waiting for their barrier, in order: (marks, what each wrote, released)
        self._committing: asyncio.Queue[
            tuple[dict[int, str], list[tuple[str, Batch]], list[str]]
        ] = asyncio.Queue()
        self._committer: asyncio.Task[None] | None = None
        self.delivered = 0  # entries handed to readers from memory (tests, metrics)

    def bind(self, tailer: Tailer) -> None:
        self._tailer = tailer

    # -- the worker's side ---------------------------------------------------------------

    def owns(self, request_id: str) -> bool:
        return request_id in self._owned

    def own(self, request_id: str) -> None:
        """This process's worker writes ``request_id``'s log from now on: its readers here
        are fed from memory."""
        self._owned.add(request_id)
        if self._tailer is not None:
            self._tailer.to_local(request_id)

    def release(self, request_id: str) -> None:
        """The worker let go of ``request_id`` (ended, parked, handed over, fenced out):
        whoever still reads it here follows the log in Redis from where it is -- once
        what it wrote last is published (at ``replica``: after its barrier)."""
        self._owned.discard(request_id)
        if self._committer is not None and not self._committer.done():
            self._committing.put_nowait(({}, [], [request_id]))
        else:
            self.demote(request_id)

    def demote(self, request_id: str) -> None:
        """Readers of ``request_id`` here follow the log in Redis (its writer stays)."""
        subs = self._subs.pop(request_id, None)
        if subs and self._tailer is not None:
            self._tailer.to_redis(subs)

    def publish(self, written: list[tuple[str, Batch]]) -> None:
        """What one flush wrote, committed: each request's entries to its readers here."""
        for request_id, batch in written:
            subs = self._subs.get(request_id)
            if subs:
                for sub in list(subs):
                    sub.offer_local(batch)
                self.delivered += len(batch) * len(subs)

    def publish_committed(
        self, committer: Committer, marks: dict[int, str], written: list[tuple[str, Batch]]
    ) -> None:
        """``publish`` once a commit barrier after the flush has confirmed it (``marks``:
        the partitions written, as ``Committer.mark`` named their nodes before it); in the
        order flushes come. A barrier that fails hands those requests' readers to Redis."""
        if not any(rid in self._subs for rid, _ in written):
            return
        self._committing.put_nowait((marks, written, []))
        if self._committer is None or self._committer.done():
            self._committer = asyncio.get_running_loop().create_task(
                self._confirm(committer), name="local-feed-commit"
            )

    async def _confirm(self, committer: Committer) -> None:
        while not self._committing.empty():
            marks, written, released = self._committing.get_nowait()
            try:
                if marks:
                    await committer.confirm_all(marks)
            except Exception as exc:  # noqa: BLE001 - the readers go on from Redis
                log.warning("a flush's commit barrier failed (%s): its readers read Redis", exc)
                for rid, _ in written:
                    self.demote(rid)
            else:
                self.publish(written)
            for rid in released:
                if rid not in self._owned:  # (not claimed again meanwhile)
                    self.demote(rid)

    # -- the readers' side ---------------------------------------------------------------

    def attach(self, sub: Subscription) -> None:
        self._subs.setdefault(sub.request_id, set()).add(sub)

    def detach(self, sub: Subscription) -> None:
        subs = self._subs.get(sub.request_id)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self._subs[sub.request_id]

    def followed(self) -> dict[str, set[Subscription]]:
        """Request id -> its readers fed from here."""
        return self._subs
