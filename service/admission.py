"""Admission before the first byte: 429 for a key over its own limits, 503 when the
service is over capacity (no live worker, a queue that would wait too long, or this
API process at its stream cap). Both carry Retry-After. Limits live in Redis, so
they hold across API replicas.
"""

from __future__ import annotations

import math
import time
from importlib import resources
from typing import Any

from redis.asyncio import Redis

from service.errors import ApiError, ServiceUnavailable
from service.keys import Keys
from service.queue import Heartbeat
from service.settings import Settings


class RateLimited(ApiError):
    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: int, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", str(max(1, retry_after_s)))


def who(tenant: str, key_id: str | None) -> str:
    """What limits are counted against: the key, or the tenant when there is no key."""
    return f"k:{key_id}" if key_id else f"t:{tenant}"


class Admission:
    def __init__(self, redis: Redis, keys: Keys, settings: Settings) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self._admit = redis.register_script(
            resources.files("service").joinpath("lua", "admit.lua").read_text()
        )
        self._capacity_checked = 0.0
        self._capacity_error: ServiceUnavailable | None = None

    async def admit(self, principal: str, request_id: str) -> None:
        s = self.settings
        if not s.max_concurrent_per_key and not s.rate_limit_rpm:
            return
        now = int(time.time() * 1000)
        keys = [self.keys.inflight(principal), self.keys.rate(principal, now // 60_000)]
        expiry = now + int((s.request_deadline_s + s.hot_log_ttl_s) * 1000)
        args = [now, s.max_concurrent_per_key, s.rate_limit_rpm, request_id, expiry]
        verdict, *rest = await self._admit(keys=keys, args=args)
        if int(verdict) == 1:
            raise RateLimited(
                f"this key already has {s.max_concurrent_per_key} requests in flight "
                f"(the limit is {s.max_concurrent_per_key})",
                retry_after_s=1,
                code="too_many_concurrent_requests",
            )
        if int(verdict) == 2:
            raise RateLimited(
                f"this key is over its limit of {s.rate_limit_rpm} requests per minute",
                retry_after_s=math.ceil(int(rest[0]) / 1000),
                code="rate_limit_exceeded",
            )

    async def release(self, principal: str, request_id: str) -> None:
        if self.settings.max_concurrent_per_key:
            await self.redis.zrem(self.keys.inflight(principal), request_id)

    async def check_capacity(self, open_streams: int) -> None:
        s = self.settings
        if open_streams >= s.max_streams:
            raise ServiceUnavailable(
                f"this API process has {open_streams} open streams (its cap is {s.max_streams})",
                retry_after_s=1,
                code="server_busy",
            )
        now = time.monotonic()
        if now - self._capacity_checked > 0.5:  # shared by the requests of half a second
            self._capacity_checked = now
            self._capacity_error = await self._queue_verdict()
        if self._capacity_error is not None:
            raise self._capacity_error

    async def _queue_verdict(self) -> ServiceUnavailable | None:
        s = self.settings
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.workers)
        pipe.xlen(self.keys.queue)
        beats, depth = await pipe.execute()
        now_ms = time.time() * 1000
        live = []
        for raw in beats.values():
            beat = Heartbeat.decode(raw)
            if beat.fresh(now_ms, s.worker_stale_s):
                live.append((beat.slots, beat.busy, beat.mean_service_ms))
        if not live:
            return ServiceUnavailable(
                "no worker is available to run the request",
                retry_after_s=math.ceil(s.worker_stale_s),
                code="no_worker",
            )
        slots = sum(x[0] for x in live)
        busy = sum(x[1] for x in live)
        waiting = max(0.0, depth - busy)
        mean_s = max(0.001, sum(x[2] for x in live) / len(live) / 1000) or 1.0
        expected_wait_s = max(0.0, waiting - (slots - busy)) / max(slots, 1) * mean_s
        if expected_wait_s > s.max_queue_wait_s:
            return ServiceUnavailable(
                f"the queue would make this request wait about {expected_wait_s:.0f} s "
                f"(the limit is {s.max_queue_wait_s:g} s): {int(waiting)} waiting for "
                f"{int(slots)} worker slots",
                retry_after_s=math.ceil(min(expected_wait_s, 60)),
                code="overloaded",
            )
        return None
