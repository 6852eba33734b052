"""Admission, across API replicas: per-key limits (requests in flight and per minute,
``admit.lua``), the freeing of an ended request's in-flight slot, and the requests made
under an ``Idempotency-Key`` (``unbind_idempotency.lua`` frees a key of a refused one)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.pool import STORE_ERRORS
from service.store.scripts.admit import Admit
from service.store.scripts.codes import Admitted
from service.store.scripts.unbind_idempotency import UnbindIdempotency

__all__ = ["Admitted", "IdempotencyKeys", "Limits", "Slot", "free_slots"]

log = logging.getLogger(__name__)


class Slot(NamedTuple):
    """A request's admission slot: its id in its API key's in-flight set."""

    inflight_key: str
    request_id: str

    @classmethod
    def of(cls, keys: Keys, request_id: str, tenant: str | None, key_id: str | None) -> Slot | None:
        """The slot of ``request_id``, sent by ``tenant`` with ``key_id`` (None: who sent it
        is not known any more -- its log's ``created`` is gone)."""
        if tenant is None:
            return None
        return cls(keys.inflight_of(tenant, key_id), request_id)


async def free_slots(redis: Redis, slots: Iterable[Slot | None]) -> None:
    """Free requests' admission slots in one pipelined round trip: the one way a slot is
    freed -- by the ending's write (``RedisLog.append_many``, ``RedisLog.cancel``), a park
    (a parked request holds none) and the recorder (again, for an ending whose writer
    died before it freed the slot: this is idempotent)."""
    pipe = redis.pipeline(transaction=False)
    for slot in slots:
        if slot is not None:
            pipe.zrem(slot.inflight_key, slot.request_id)
    try:
        await pipe.execute()
    except STORE_ERRORS as exc:  # the ends are written: the recorder frees them
        log.warning("cannot free admission slots: %s", exc)


class Limits:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.admit = Admit(redis, keys)  # count a request against its key's limits

    async def hold(self, who: str, request_id: str, *, slot_expiry_ms: int) -> None:
        """Count a request that goes on again (a reader came back to it parked) in flight,
        without a check: it was admitted once, and is never refused now."""
        await self.redis.zadd(self.keys.inflight(who), {request_id: slot_expiry_ms})


class IdempotencyKeys:
    """``Idempotency-Key`` -> the request it created, for ``ttl_s``."""

    def __init__(self, redis: Redis, keys: Keys, ttl_s: int) -> None:
        self.redis = redis
        self.keys = keys
        self.ttl_s = ttl_s
        self._release = UnbindIdempotency(redis, keys)

    async def claim(
        self, principal: str, key: str, request_id: str, digest: str
    ) -> tuple[str, str] | None:
        """Bind ``key`` to ``request_id`` (and the body's ``digest``); if it is bound
        already, the (request id, digest) it is bound to."""
        value = f"{request_id} {digest}"
        name = self.keys.idempotency(principal, key)
        if await self.redis.set(name, value, nx=True, ex=self.ttl_s):
            return None
        raw: Any = await self.redis.get(name)
        if raw is None:  # expired in between: try once more
            if await self.redis.set(name, value, nx=True, ex=self.ttl_s):
                return None
            raw = await self.redis.get(name)
        rid, _, bound_digest = replies.text(raw or b"").partition(" ")
        return rid, bound_digest

    async def release(self, principal: str, key: str, request_id: str) -> None:
        """Unbind ``key`` if it is still bound to ``request_id`` (its request was refused:
        a retry with the same key must be able to try again)."""
        await self._release(principal, key, request_id)
