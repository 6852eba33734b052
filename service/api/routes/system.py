"""Models, health, readiness, metrics."""

from __future__ import annotations

import time
from typing import Any

import prometheus_client
from litestar import Controller, Response, get

from service.api.auth import Principal
from service.api.context import Context
from service.store import pool

_STARTED = int(time.time())


class SystemController(Controller):
    tags = ("system",)

    @get("/v1/models", summary="The served model")
    async def models(self, ctx: Context, principal: Principal) -> dict[str, Any]:
        """Behind an API key like every /v1 route (a key limited to other models sees
        none)."""
        served = [
            {
                "id": ctx.model.name,
                "object": "model",
                "created": _STARTED,
                "owned_by": "lastevent",
                "max_model_len": ctx.model.max_model_len,
            }
        ]
        return {"object": "list", "data": served if principal.may_use(ctx.model.name) else []}

    @get("/healthz", summary="The process is up")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @get("/readyz", summary="Redis and Postgres answer")
    async def readyz(self, ctx: Context) -> Response[dict[str, Any]]:
        checks: dict[str, str] = {}
        checks["redis"] = await pool.check(ctx.redis)
        if ctx.ledger is not None:
            checks["postgres"] = await ctx.ledger.check()
        ready = all(v == "ok" for v in checks.values())
        return Response(
            {"status": "ready" if ready else "unavailable", "checks": checks},
            status_code=200 if ready else 503,
        )

    @get("/metrics", summary="Prometheus metrics", media_type="text/plain; version=0.0.4")
    async def metrics(self) -> bytes:
        return prometheus_client.generate_latest()
