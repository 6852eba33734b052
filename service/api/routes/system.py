"""Models, health, readiness, metrics; and the probes vLLM's server answers (``/health``,
``/version``), so that tools written against vLLM find this server serving."""

from __future__ import annotations

import importlib.metadata
import time
from typing import Any

import prometheus_client
from litestar import Controller, MediaType, Response, get
from litestar.openapi.datastructures import ResponseSpec

from service.api.auth import Principal
from service.api.catalog import unknown_model
from service.api.context import Context
from service.api.schemas import ErrorResponse, error_responses
from service.store import commit, pool
from service.store.registry import Declared

_STARTED = int(time.time())
VERSION = importlib.metadata.version("lastevent")


def model_object(ctx: Context, name: str, declared: Declared) -> dict[str, Any]:
    """vLLM's model object: an adapter names its base model as ``parent``."""
    info = ctx.catalog.info(name)
    return {
        "id": name,
        "object": "model",
        "created": declared.created or _STARTED,
        "owned_by": declared.owned_by,
        "root": declared.parent or name,
        "parent": declared.parent,
        "max_model_len": ctx.context_length(info),
    }


class SystemController(Controller):
    tags = ("system",)

    @get(
        "/v1/models",
        summary="The models and adapters a live worker serves",
        responses=error_responses(401),
    )
    async def models(self, ctx: Context, principal: Principal) -> dict[str, Any]:
        """Behind an API key like every /v1 route (a key limited to some models sees only
        those)."""
        served = [
            model_object(ctx, name, declared)
            for name, declared in ctx.catalog.listed()
            if principal.may_use(name)
        ]
        return {"object": "list", "data": served}

    @get(
        "/v1/models/{model_id:path}",
        summary="One model (OpenAI's retrieve)",
        responses={
            **error_responses(401),
            404: ResponseSpec(
                data_container=ErrorResponse,
                description="No such model served now, or the key may not use it "
                "(code model_not_found)",
            ),
        },
    )
    async def model(self, ctx: Context, principal: Principal, model_id: str) -> dict[str, Any]:
        """A model the key may not use answers as one that does not exist. The id may hold
        slashes (vLLM serves ``org/name`` ids)."""
        model_id = model_id.removeprefix("/")  # a path parameter starts with its slash
        for name, declared in ctx.catalog.listed():
            if name == model_id and principal.may_use(name):
                return model_object(ctx, name, declared)
        raise unknown_model(model_id)

    @get("/healthz", summary="The process is up")
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @get(
        "/readyz",
        summary="Redis and Postgres answer, at the durability level in force",
        responses={503: ResponseSpec(dict[str, Any], description="Not ready: the checks")},
    )
    async def readyz(self, ctx: Context) -> Response[dict[str, Any]]:
        checks: dict[str, str] = {}
        checks["redis"] = await pool.check(ctx.redis)
        durability = {"level": str(ctx.log.committer.level), "how": ""}
        if checks["redis"] == "ok":
            try:
                durability["how"] = await ctx.log.committer.check()
                checks["durability"] = "ok"
            except commit.Misconfigured as exc:  # a replica went away since the start
                checks["durability"] = f"error: {exc}"
            except pool.STORE_ERRORS as exc:
                checks["durability"] = f"error: {exc}"
        if ctx.ledger is not None:
            checks["postgres"] = await ctx.ledger.check()
        ready = all(v == "ok" for v in checks.values())
        return Response(
            {
                "status": "ready" if ready else "unavailable",
                "checks": checks,
                "durability": durability,
            },
            status_code=200 if ready else 503,
        )

    @get(
        "/health",
        summary="Serving: Redis answers (vLLM's probe: an empty body)",
        media_type=MediaType.TEXT,
        responses={503: ResponseSpec(data_container=None, description="Redis does not answer")},
    )
    async def health(self, ctx: Context) -> Response[bytes]:
        """vLLM's ``/health``: 200 with an empty body while requests can be accepted, i.e.
        while Redis answers (the ledger is not needed to serve; ``/readyz`` says more)."""
        ok = await pool.check(ctx.redis) == "ok"
        return Response(b"", status_code=200 if ok else 503, media_type=MediaType.TEXT)

    @get("/version", summary="lastevent's version (vLLM's probe)")
    async def version(self) -> dict[str, str]:
        return {"version": VERSION}

    @get("/metrics", summary="Prometheus metrics", media_type="text/plain; version=0.0.4")
    async def metrics(self) -> bytes:
        return prometheus_client.generate_latest()
