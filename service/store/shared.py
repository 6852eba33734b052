"""Small shared state of the API processes: the stream-token secret and the requests made
under an ``Idempotency-Key``."""

from __future__ import annotations

import secrets
from typing import Any

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.scripts.unbind_idempotency import UnbindIdempotency


async def stream_token_secret(redis: Redis, keys: Keys) -> bytes:
    """The secret every API process signs stream tokens with: made by the first to ask."""
    await redis.set(keys.stream_token_secret, secrets.token_hex(32), nx=True)
    raw = await redis.get(keys.stream_token_secret)
    return replies.text(raw).encode()


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
