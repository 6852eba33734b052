"""Committed reads: nothing is shown that Redis could still take back.

A write is *committed* at a durability level once the servers keep it through the fault
that level is for: ``memory`` -- a write Redis answered (a crash or a failover may take
the last of them back); ``disk`` -- in the primary's fsynced AOF, so a host crash keeps
it: given by ``appendfsync always``, under which Redis answers nobody before the fsync of
what the answer shows (one fsync per event-loop turn, for all its clients); ``replica``
-- received by a replica too (``WAIT 1``), so a failover to an in-sync replica keeps it.

``disk`` with ``appendfsync everysec`` is refused: ``WAITAOF`` would have to wait up to a
second for the next fsync, and on the servers with redis/redis#13793 (Valkey 9.1.2, the
embedded one, among them) it confirms writes that were never fsynced -- measured with an
fsync-noting preload (``tests/native/fsync_log.c``): eight ``WAITAOF 1 0`` confirmed in
50 ms each while no fsync ran, and a simulated host crash lost events readers were sent.

For ``replica``, what a reader is sent (a stream, a resume, an aggregate answer, a
replay, the recorder's billing rows and archive) is confirmed after it was read: the
process writes a tiny *barrier* on the node that holds the partition and waits, on the
same connection, until a replica acknowledged it (``WAIT`` waits for the caller's own
last write). Redis applies one command at a time, so every entry the read returned came
before the barrier in the node's replication stream: once the barrier is acknowledged,
they are. One barrier in flight confirms every read that finished before it was sent
(group commit: one round trip per batch of reads, never per token); the log needs no
commit point of its own that a failover could lose in turn. A barrier that cannot be
confirmed in time raises ``Uncommitted`` (a store error: readers wait and try again, the
API answers 503).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import PipelineCommand, RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError, SlotNotCoveredError

from service.settings import Durability as Durability  # (its home: settings)
from service.settings import Settings
from service.store import replies
from service.store.keys import Keys
from service.store.pool import STORE_ERRORS, refresh_map, relearn

log = logging.getLogger(__name__)


BARRIER_MARGIN_S = 5.0  # a barrier not answered this long past its WAIT is given up


class Uncommitted(RedisConnectionError):
    """What was read could not be confirmed committed in time (no replica acknowledged
    it, or the slot moved meanwhile): treated like an unreachable store."""


class Misconfigured(Exception):
    """The servers cannot give the durability level asked for (no AOF, no replica)."""


class NoReplica(Misconfigured):
    """A primary has no connected replica (at ``replica``): for good, or while a failover
    or a replica's restart is under way."""


def of(settings: Settings, redis: Redis, keys: Keys) -> Committer:
    """The committer of a process with these settings."""
    return Committer(redis, keys, settings.durability, timeout_ms=settings.commit_timeout_ms)


async def started(committer: Committer, what: str, wait_s: float) -> None:
    """Check the level at a process's start: refuse to start (a clear message) if the
    servers cannot give it; if they cannot be reached yet, say so and go on (``/readyz``
    checks again, barriers fail until they answer). A primary without a replica may be
    a failover under way (a promoted replica whose own replica has not attached yet, a
    replica restarting): asked again every second for ``wait_s`` before refusing."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            how = await committer.check()
            break
        except NoReplica as exc:
            if time.monotonic() >= deadline:
                log.error("%s: refusing to start: %s", what, exc)
                raise SystemExit(f"{what}: {exc}") from None
            log.warning("%s: %s; asking again (a failover under way?)", what, exc)
            await asyncio.sleep(1.0)
        except Misconfigured as exc:
            log.error("%s: refusing to start: %s", what, exc)
            raise SystemExit(f"{what}: {exc}") from None
        except STORE_ERRORS as exc:
            log.warning(
                "%s: durability %s not checked, Redis does not answer: %s",
                what,
                committer.level,
                exc,
            )
            return
    log.info("%s: durability %s", what, how)


class Committer:
    """Confirms, per partition, that what this process has read is committed."""

    def __init__(
        self, redis: Redis, keys: Keys, level: Durability, *, timeout_ms: int = 1000
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.level = level
        self.timeout_ms = timeout_ms
        # disk (appendfsync always, checked): every answer Redis sends already follows the
        # fsync of what it shows, so no barrier is needed
        self.fsync_always = False
        self._checked = False
        self._waiting: dict[int, list[asyncio.Future[None]]] = {}  # for the next barrier
        self._busy: set[int] = set()  # partitions with a barrier on its way
        self._tasks: set[asyncio.Task[None]] = set()
        self._relearning: asyncio.Task[None] | None = None
        self.barriers = 0  # barriers sent (tests, benchmarks)

    @property
    def needed(self) -> bool:
        return self.level is not Durability.MEMORY and not self.fsync_always

    def mark(self, partition: int, via: Redis | None = None) -> str:
        """Which node serves ``partition`` now, as the client that reads (``via``; default
        this one's) sees it: take it before a read, hand it to ``confirm``. On a cluster, a
        read made on a primary that failed over before the barrier went to the new one must
        not be confirmed by the new one's barrier."""
        client: object = self.redis if via is None else via
        if not self.needed or not isinstance(client, RedisCluster):
            return ""
        try:
            node = client.get_node_from_key(self.keys.commit(partition))
        except SlotNotCoveredError:  # (not learnt yet, or in a failover: nothing confirms)
            return "?"
        return str(node.name) if node is not None else "?"

    async def confirm(self, partition: int, mark: str = "", via: Redis | None = None) -> None:
        """Return once everything this process read from ``partition``'s node before the
        call (and since ``mark``) is committed; raise ``Uncommitted`` (or the store's
        error) if it cannot be. ``via``: the client that read, when it is not this one --
        each cluster client has its own slot map, and after a failover the reader's may
        still name a node the barrier's no longer does (a frozen primary woken, still
        answering as one until it learns it was replaced: what it held then is taken back
        when it rejoins, and a client was sent it once, confirmed by the new primary's
        barrier)."""
        if not self._checked and self.level is not Durability.MEMORY:
            await self.check()  # (how the level is given: a process that did not ask yet)
        if not self.needed:
            return
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        # a barrier already on its way does not cover this read: the next one does
        self._waiting.setdefault(partition, []).append(future)
        if partition not in self._busy:
            self._busy.add(partition)
            task = loop.create_task(self._barriers(partition), name="commit-barrier")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        await future
        if mark != self.mark(partition) or (via is not None and mark != self.mark(partition, via)):
            raise Uncommitted(f"partition {partition} moved to another node while it was read")

    def marks(self, partitions: range) -> dict[int, str]:
        return {p: self.mark(p) for p in partitions}

    async def confirm_all(self, marks: dict[int, str]) -> None:
        """``confirm`` each partition of ``marks`` (taken before the read)."""
        await asyncio.gather(*(self.confirm(p, mark) for p, mark in marks.items()))

    async def _barriers(self, partition: int) -> None:
        """Barriers for ``partition`` while reads wait for one, each for all that came
        before it was sent."""
        try:
            while waiting := self._waiting.pop(partition, []):
                try:
                    await self._send(partition)
                except Exception as exc:  # noqa: BLE001 - each waiter gets it raised
                    for future in waiting:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for future in waiting:
                    if not future.done():
                        future.set_result(None)
        finally:
            self._busy.discard(partition)

    async def _send(self, partition: int) -> None:
        self.barriers += 1
        key = self.keys.commit(partition)
        try:
            # (the sockets' own timeouts end it sooner; this bounds whatever they miss)
            async with asyncio.timeout(self.timeout_ms / 1000 + BARRIER_MARGIN_S):
                reply = await _on_one_connection(
                    self.redis, key, [("INCR", key), ("WAIT", 1, self.timeout_ms)]
                )
        except STORE_ERRORS:  # (an OSError: the bound's TimeoutError too)
            self._relearn(key)
            raise
        if replies.integer(reply[1]) < 1:
            raise Uncommitted(f"no replica acknowledged within {self.timeout_ms} ms")

    def _relearn(self, key: str) -> None:
        """A barrier goes to the node the slot map names, outside the client's routing, so
        its failure teaches the client nothing: a dead or frozen primary would be asked
        again for ever while its replica serves the slot. One routed command (in the
        background, one at a time: the readers are told at once) learns the map again."""
        if self._relearning is None or self._relearning.done():
            bound_s = self.timeout_ms / 1000 + 2.0
            self._relearning = asyncio.get_running_loop().create_task(
                relearn(self.redis, key, bound_s), name="commit-relearn"
            )

    async def check(self) -> str:
        """Whether every primary can give this level: raises ``Misconfigured`` (what is
        missing) if not; returns how it is given (the startup log, ``/readyz``)."""
        how = await self._check()
        self._checked = True
        return how

    async def _check(self) -> str:
        if self.level is Durability.MEMORY:
            return "memory: a crash or a failover may take back what readers were sent"
        infos = await _primaries_info(self.redis)
        if self.level is Durability.DISK:
            missing = [name for name, info in infos if info.get("aof_enabled") != "1"]
            if missing:
                raise Misconfigured(
                    "LASTEVENT_DURABILITY=disk needs the AOF (appendonly yes, appendfsync "
                    f"always) on every primary; it is off on {', '.join(missing)}"
                )
            modes = {name: await _appendfsync(self.redis, name) for name, _ in infos}
            if any(mode != "always" for mode in modes.values()):
                raise Misconfigured(
                    "LASTEVENT_DURABILITY=disk needs appendfsync always on every primary "
                    f"(found {modes}): with everysec a reader could be shown only what "
                    "WAITAOF confirms, which waits up to a second for the next fsync -- "
                    "or, on servers with redis/redis#13793 (Valkey 9.1 among them), "
                    "confirms before it. Use replica, or memory."
                )
            self.fsync_always = True
            return "disk: appendfsync always (every answer follows the fsync of what it shows)"
        lonely = _lonely(infos)
        if lonely and await refresh_map(self.redis):
            # (a slot map learnt before a failover still names the old primary, a replica
            # now: no command of this process failed on it to make the client learn again)
            lonely = _lonely(await _primaries_info(self.redis))
        if lonely:
            raise NoReplica(
                "LASTEVENT_DURABILITY=replica needs a connected replica of every primary; "
                f"none on {', '.join(lonely)}"
            )
        return "replica: readers are sent what WAIT confirmed a replica received"


async def _on_one_connection(redis: Redis, key: str, commands: list[tuple[Any, ...]]) -> list[Any]:
    """``commands`` in order on one connection to the node that holds ``key`` (``WAIT`` and
    ``WAITAOF`` wait for the write of their own connection); a redirect is an error here,
    never a retry elsewhere, which would confirm nothing."""
    client: object = redis
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(key)
        if node is None:
            raise Uncommitted(f"no node serves {key} now")
        batch = [PipelineCommand(i, *args) for i, args in enumerate(commands)]
        await node.execute_pipeline(batch)
        for cmd in batch:
            if isinstance(cmd.result, Exception):
                raise Uncommitted(f"barrier on {node.name}: {cmd.result}") from cmd.result
        return [cmd.result for cmd in batch]
    pipe = redis.pipeline(transaction=False)
    for args in commands:
        pipe.execute_command(*args)
    out: list[Any] = await pipe.execute()
    return out


def _lonely(infos: list[tuple[str, dict[str, str]]]) -> list[str]:
    """The primaries of ``infos`` without a connected replica."""
    return [name for name, info in infos if int(info.get("connected_slaves", "0")) < 1]


async def _primaries_info(redis: Redis) -> list[tuple[str, dict[str, str]]]:
    client: object = redis
    if isinstance(client, RedisCluster):
        out = []
        for node in client.get_primaries():
            info = await client.info(target_nodes=node)
            out.append((node.name, _flat(info)))
        return out
    return [("redis", _flat(await redis.info()))]


def _flat(info: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in dict(info).items()}


async def _appendfsync(redis: Redis, node_name: str) -> str:
    """The node's ``appendfsync`` ("" where CONFIG is not allowed: a managed service)."""
    client: object = redis
    try:
        if isinstance(client, RedisCluster):
            node = client.get_node(node_name=node_name)
            found: Any = await client.config_get("appendfsync", target_nodes=node)
        else:
            found = await redis.config_get("appendfsync")
    except ResponseError:
        return ""
    except STORE_ERRORS as exc:
        log.warning("cannot read appendfsync of %s: %s", node_name, exc)
        return ""
    return replies.text(dict(found).get("appendfsync", "")) if found else ""
