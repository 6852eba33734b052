"""Reader presence, cancel, and the owner's abort decisions (Redis I/O, Lua scripts).

* Every connected reader holds a lease in the request's ``readers`` sorted set
  (scored by expiry). ``Presence`` -- one per API process -- adds it on connect,
  refreshes all of its leases in one pipelined round trip every
  ``lease_refresh_s``, and removes it on disconnect (recording when the last
  reader left). A crashed API process's leases lapse after ``lease_ttl_s``.
* ``cancel`` ends a queued request on the spot (no engine ever sees it) or
  flags a running one and tells its owner over the owner's control channel.
* ``Control.check`` is the owner's periodic question for its running requests:
  keep going, cancelled, or abandoned (no lease for longer than the grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from importlib import resources

from redis.asyncio import Redis
from redis.exceptions import NoScriptError, RedisError

from service.keys import Keys
from service.stream import events as ev

log = logging.getLogger(__name__)

KEEP_GOING, ABANDONED, CANCELLED = 0, 1, 2  # check.lua; a negative verdict: -ms left


def _script(name: str) -> str:
    return resources.files("service").joinpath("lua", name).read_text()


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclasses.dataclass(frozen=True, slots=True)
class CancelOutcome:
    outcome: str  # missing | cancelled | cancelling | <terminal state already reached>
    detail: str | None = None  # end id (cancelled while queued) or owner (cancelling)


class Control:
    """The scripts, bound to one Redis client."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.lease_script = redis.register_script(_script("lease.lua"))
        self.leave_script = redis.register_script(_script("leave.lua"))
        self.check_script = redis.register_script(_script("check.lua"))
        self._cancel = redis.register_script(_script("cancel.lua"))

    def _keys(self, rid: str) -> list[str]:
        return [self.keys.meta(rid), self.keys.readers(rid)]

    async def cancel(
        self, rid: str, queued_end: ev.End, ttl_s: int, queued_summary: ev.Summary
    ) -> CancelOutcome:
        keys = [self.keys.meta(rid), self.keys.log(rid), self.keys.outbox, self.keys.scratch(rid)]
        args = [ev.encode(queued_end), ttl_s, ev.encode_summary(queued_summary)]
        raw = await self._cancel(keys=keys, args=args)
        parts = [p.decode() if isinstance(p, bytes) else str(p) for p in raw]
        outcome = CancelOutcome(parts[0], parts[1] if len(parts) > 1 else None)
        if outcome.outcome == "cancelling" and outcome.detail:
            await self.redis.publish(self.keys.control(outcome.detail), f"cancel:{rid}")
        return outcome

    async def check(self, rids: Sequence[str]) -> dict[str, int]:
        """One pipelined round trip: the decision for each of the owner's requests."""
        if not rids:
            return {}
        now = now_ms()
        results = await _run_pipelined(
            self.redis, self.check_script, [(self._keys(r), [now]) for r in rids]
        )
        return {r: int(x) for r, x in zip(rids, results, strict=True)}

    async def leave(self, rid: str, token: str, delivered: int) -> int:
        """Drop a lease; returns how many live leases are left. When none is, the owner
        is nudged so that it times the grace period from now instead of polling for it."""
        left, owner = await self.leave_script(
            keys=self._keys(rid), args=[token, now_ms(), delivered]
        )
        owner = owner.decode() if isinstance(owner, bytes) else str(owner)
        if int(left) == 0 and owner:
            await self.redis.publish(self.keys.control(owner), f"check:{rid}")
        return int(left)


async def _run_pipelined(
    redis: Redis, script: object, calls: Sequence[tuple[list[str], list[object]]]
) -> list[object]:
    """EVALSHA each call in one pipeline; load the script once if Redis lost it."""
    sha = script.sha  # type: ignore[attr-defined]
    for _attempt in range(2):
        pipe = redis.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(sha, len(keys), *keys, *args)
        results = list(await pipe.execute(raise_on_error=False))
        if not any(isinstance(r, NoScriptError) for r in results):
            break
        await redis.script_load(script.script)  # type: ignore[attr-defined]
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results


@dataclasses.dataclass(slots=True, eq=False)
class Lease:
    """One reader's presence on one request."""

    presence: Presence
    request_id: str
    token: str
    delivered: int = 0  # completion tokens written to this reader's connection
    # A lease taken before its reader runs (the API takes it before enqueueing) is
    # refreshed only once the reader adopts it; a reader that never starts (the client
    # left before the response began) lets it lapse after one lease TTL.
    adopted: bool = False
    taken_ms: int = 0

    async def release(self) -> None:
        await self.presence.release(self)


class Presence:
    """The API process's leases: add on connect, refresh in bulk, remove on disconnect."""

    def __init__(
        self, control: Control, *, lease_ttl_s: float = 10.0, refresh_s: float = 3.0
    ) -> None:
        self.control = control
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.refresh_s = refresh_s
        self._leases: set[Lease] = set()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._leases)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="presence")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def track(self, request_id: str, *, adopted: bool = True) -> Lease:
        """A lease this process refreshes; the caller writes it to Redis (``acquire``, or
        ``RedisLog.create`` together with the log)."""
        lease = Lease(self, request_id, uuid.uuid4().hex, adopted=adopted, taken_ms=now_ms())
        self._leases.add(lease)
        return lease

    def forget(self, lease: Lease) -> None:
        self._leases.discard(lease)

    async def acquire(self, request_id: str, *, adopted: bool = True) -> Lease:
        lease = self.track(request_id, adopted=adopted)
        try:
            await self.control.lease_script(
                keys=self.control._keys(request_id), args=[lease.token, self.expiry_ms(), 0]
            )
        except BaseException:  # not written (or cancelled): never refresh it
            self.forget(lease)
            raise
        return lease

    async def release(self, lease: Lease) -> None:
        if lease not in self._leases:
            return
        self._leases.discard(lease)
        try:
            # shielded: a reader's task is often being cancelled (client gone) right now
            await asyncio.shield(
                self.control.leave(lease.request_id, lease.token, lease.delivered)
            )
        except RedisError as exc:  # the lease lapses by itself
            log.warning("could not release lease of %s: %s", lease.request_id, exc)

    def expiry_ms(self) -> int:
        return now_ms() + self.lease_ttl_ms

    async def refresh(self) -> None:
        stale = now_ms() - self.lease_ttl_ms
        for lease in [le for le in self._leases if not le.adopted and le.taken_ms < stale]:
            self._leases.discard(lease)  # never adopted: it has lapsed in Redis
        leases = [le for le in self._leases if le.adopted]
        if not leases:
            return
        expiry = self.expiry_ms()
        calls = [
            (self.control._keys(le.request_id), [le.token, expiry, le.delivered]) for le in leases
        ]
        await _run_pipelined(self.control.redis, self.control.lease_script, calls)

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            with contextlib.suppress(RedisError):
                await self.refresh()


__all__ = ["ABANDONED", "CANCELLED", "KEEP_GOING", "CancelOutcome", "Control", "Lease", "Presence"]
