"""Admission before the first byte: 429 for a key over its own limits, 503 when the
service is over capacity (no live worker, a queue that would wait too long, or this
API process at its stream cap). Both carry Retry-After. Limits live in Redis, so
they hold across API replicas.
"""

from __future__ import annotations

import math
import time
from typing import Any

from service.errors import ApiError, ServiceUnavailable
from service.settings import Settings
from service.store.admission import Admitted, Limits
from service.store.heartbeats import Heartbeats


class RateLimited(ApiError):
    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: int, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", str(max(1, retry_after_s)))


class Admission:
    def __init__(self, limits: Limits, heartbeats: Heartbeats, settings: Settings) -> None:
        self.limits = limits
        self.heartbeats = heartbeats
        self.settings = settings
        # per model: when its capacity was last looked at, and the verdict then
        self._verdicts: dict[str, tuple[float, ServiceUnavailable | None]] = {}

    def _slot_expiry_ms(self, now_ms: int) -> int:
        """An in-flight slot is freed at the end, or at the latest then."""
        return now_ms + int((self.settings.request_deadline_s + self.settings.hot_log_ttl_s) * 1000)

    async def admit(self, principal: str, request_id: str) -> None:
        s = self.settings
        if not s.max_concurrent_per_key and not s.rate_limit_rpm:
            return
        await self._count(principal, request_id, s.rate_limit_rpm)

    async def returning(self, principal: str, request_id: str) -> None:
        """A reader comes back to a parked request, which will go on: it is admitted as a
        new request is, against its key's limit of requests in flight (its slot was freed
        when it was parked), or refused with 429 -- it stays parked meanwhile. (Not a new
        request: the rate counted it once.)"""
        await self._count(principal, request_id, 0)

    async def _count(self, principal: str, request_id: str, per_minute: int) -> None:
        s = self.settings
        now = int(time.time() * 1000)
        verdict, retry_ms = await self.limits.admit(
            principal,
            request_id,
            now_ms=now,
            max_in_flight=s.max_concurrent_per_key,
            per_minute=per_minute,
            slot_expiry_ms=self._slot_expiry_ms(now),
        )
        if verdict == Admitted.TOO_MANY_IN_FLIGHT:
            raise RateLimited(
                f"this key already has {s.max_concurrent_per_key} requests in flight "
                f"(the limit is {s.max_concurrent_per_key})",
                retry_after_s=math.ceil(retry_ms / 1000),
                code="too_many_concurrent_requests",
            )
        if verdict == Admitted.OVER_RATE:
            raise RateLimited(
                f"this key is over its limit of {s.rate_limit_rpm} requests per minute",
                retry_after_s=math.ceil(retry_ms / 1000),
                code="rate_limit_exceeded",
            )

    async def resumed(self, principal: str, request_id: str) -> None:
        """A parked request a reader came back to runs again: in flight again (its slot
        was freed when it was parked), never refused."""
        if self.settings.max_concurrent_per_key:
            now = int(time.time() * 1000)
            await self.limits.hold(principal, request_id, slot_expiry_ms=self._slot_expiry_ms(now))

    async def check_capacity(self, open_streams: int, model: str) -> None:
        """This process's stream cap; then whether a live worker serves ``model`` and how
        long its queue would make the request wait."""
        s = self.settings
        if open_streams >= s.max_streams:
            raise ServiceUnavailable(
                f"this API process has {open_streams} open streams (its cap is {s.max_streams})",
                retry_after_s=1,
                code="server_busy",
            )
        now = time.monotonic()
        checked, verdict = self._verdicts.get(model, (0.0, None))
        if now - checked > 0.5:  # shared by the requests of half a second
            verdict = await self._queue_verdict(model)
            self._verdicts[model] = (now, verdict)
        if verdict is not None:
            raise verdict

    async def _queue_verdict(self, model: str) -> ServiceUnavailable | None:
        s = self.settings
        beats, depth = await self.heartbeats.live_with_depth(s.worker_stale_s, model)
        live = [b for b in beats if b.serves(model)]
        if not live:
            return ServiceUnavailable(
                f"no worker serving the model '{model[:64]}' is available",
                # (a worker announces itself every heartbeat: after a Redis that lost its
                # data, or a worker's start, one is known again that soon)
                retry_after_s=math.ceil(s.worker_heartbeat_s),
                code="no_worker",
            )
        slots = sum(b.slots for b in live)
        busy = sum(b.busy for b in live)
        waiting = max(0.0, depth - busy)
        mean_s = max(0.001, sum(b.mean_service_ms for b in live) / len(live) / 1000)
        expected_wait_s = max(0.0, waiting - (slots - busy)) / max(slots, 1) * mean_s
        if expected_wait_s > s.max_queue_wait_s:
            return ServiceUnavailable(
                f"the queue would make this request wait about {expected_wait_s:.0f} s "
                f"(the limit is {s.max_queue_wait_s:g} s): {int(waiting)} waiting for "
                f"{int(slots)} worker slots of the model '{model[:64]}'",
                retry_after_s=math.ceil(min(expected_wait_s, 60)),
                code="overloaded",
            )
        return None
