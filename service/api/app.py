"""create_app(settings) -> Litestar. The lifespan owns the Redis pools, the DB engine,
the multiplexed log tailer, presence and the sweeper; the tokenizer is loaded first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from http import HTTPStatus
from typing import Any

import msgspec
from litestar import Litestar, Request, Response
from litestar.config.cors import CORSConfig
from litestar.di import Provide
from litestar.exceptions import HTTPException, ValidationException
from redis.asyncio import Redis

from service import aio
from service.api import framing, tokens
from service.api.admission import Admission
from service.api.auth import Authenticator, Principal, TooManyFailures
from service.api.catalog import Catalog
from service.api.context import Context, Drain
from service.api.intake import JsonBodyRequest
from service.api.metrics import REJECTED, watch_loop_lag, watch_tail
from service.api.routes.admin import AdminController
from service.api.routes.completions import CompletionsController
from service.api.routes.console import ConsoleController
from service.api.routes.playground import PlaygroundController
from service.api.routes.requests import RequestsController
from service.api.routes.responses import ResponsesController
from service.api.routes.responses_ws import responses_socket
from service.api.routes.stored import StoredCompletionsController
from service.api.routes.system import SystemController
from service.api.routes.vllm_compat import VllmCompatController
from service.api.seats import Seats
from service.api.static_files import openapi_config
from service.api.sweeper import sweeper_of
from service.errors import ApiError, ServiceUnavailable, Unauthorized
from service.ledger.api_keys import ApiKeys
from service.ledger.audit import Audit
from service.ledger.ledger import Ledger, PostgresUnavailable, make_engine
from service.settings import Settings
from service.store import commit, pool, tail
from service.store.admission import IdempotencyKeys, Limits
from service.store.commit import Committer
from service.store.heartbeats import Heartbeats
from service.store.keys import Keys
from service.store.local import LocalFeed
from service.store.log import RedisLog, Retention
from service.store.pool import UNREACHABLE, warm
from service.store.readers import Presence, Readers
from service.store.registry import ModelRegistry
from service.store.tail import LogTailer
from service.tokenize import ModelInfo

log = logging.getLogger("lastevent.api")


def _error_response(exc: ApiError) -> Response[Any]:
    REJECTED.labels(status=str(exc.status_code), reason=exc.code or exc.error_type).inc()
    return Response(exc.body(), status_code=exc.status_code, headers=exc.headers)


def _api_error(_: Request[Any, Any, Any], exc: ApiError) -> Response[Any]:
    return _error_response(exc)


_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(.*)`")


def _http_error(_: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    """Litestar's own errors (validation, 404 routes, 413) in OpenAI's error shape."""
    status = exc.status_code
    message = exc.detail
    param = None
    if isinstance(exc, ValidationException) and isinstance(exc.extra, list) and exc.extra:
        first = exc.extra[0]
        if isinstance(first, dict):
            message = f"{exc.detail}: {first.get('message', '')}".rstrip(": ")
            param = str(first.get("key") or "") or None
            unknown = _UNKNOWN_FIELD.match(str(first.get("message", "")))
            if unknown is not None:  # OpenAI's words for it
                where = "" if param in (None, "data") else f"{param}."
                param = f"{where}{unknown.group(1)}"
                message = f"Unrecognized request argument supplied: {param}"
    REJECTED.labels(status=str(status), reason=_reason(exc)).inc()
    kind = "invalid_request_error" if 400 <= status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
    return Response(body, status_code=status, headers=dict(exc.headers or {}))


def _reason(exc: HTTPException) -> str:
    """Litestar's errors carry no code: the reason is the status's name (a bounded set)."""
    if isinstance(exc, ValidationException):
        return "validation_failed"
    try:
        return HTTPStatus(exc.status_code).name.lower()
    except ValueError:
        return "http_error"


def _unavailable(
    what: str, code: str, retry_after_s: int
) -> Callable[[Request[Any, Any, Any], Exception], Response[Any]]:
    """A 503 for a store that cannot be reached (restarting, failing over, down): the
    request was not accepted, and may be sent again."""

    def handle(_: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
        log.warning("%s unavailable: %s", what, exc)
        message = f"the {what} is unavailable for a moment; retry"
        return _error_response(ServiceUnavailable(message, retry_after_s=retry_after_s, code=code))

    return handle


_store_unavailable = _unavailable("event log", "store_unavailable", 1)  # Redis
_ledger_unavailable = _unavailable("ledger", "ledger_unavailable", 2)  # Postgres


def _internal_error(_: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    log.error("unhandled error", exc_info=exc)
    REJECTED.labels(status="500", reason="internal_error").inc()
    body = {
        "error": {
            "message": "internal server error",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    return Response(body, status_code=500)


async def _stream_token_principal(
    ctx: Context, request: Request[Any, Any, Any], token: str
) -> Principal:
    """``?token=``: only on the routes that read one request (``opt`` ``stream_token``),
    only for the request it was issued for."""
    if not request.route_handler.opt.get("stream_token"):
        raise Unauthorized(
            "a stream token reads only the request it was issued for "
            "(GET /v1/requests/{id} and /v1/requests/{id}/events); send an API key",
            code="stream_token_not_accepted",
        )
    client = _client(request)
    if wait := ctx.auth.throttle(client):
        raise TooManyFailures(wait)
    principal = (await ctx.stream_tokens()).verify(token, request.path_params["request_id"])
    if principal is None:
        ctx.auth.failed(client)
        raise Unauthorized(
            "the stream token is not valid for this request (or it expired)",
            code="invalid_stream_token",
        )
    if principal.key_id is not None and not await ctx.auth.live(principal.key_id):
        ctx.auth.failed(client)
        raise Unauthorized(
            "the API key this stream token was made from was revoked",
            code="invalid_stream_token",
        )
    return principal


def cors_config(settings: Settings) -> CORSConfig | None:
    """Cross-origin access for the origins in ``LASTEVENT_CORS_ORIGINS`` (none: no CORS
    headers at all). Credentials are API keys and stream tokens, never cookies."""
    origins = [o.strip() for o in settings.cors_origins.split(",") if o.strip()]
    if not origins:
        return None
    return CORSConfig(
        allow_origins=origins,
        allow_methods=["GET", "POST", "OPTIONS"],
        allow_headers=[
            "Authorization",
            "Content-Type",
            "Last-Event-ID",
            "Idempotency-Key",
            framing.HEADER,
        ],
        expose_headers=["X-Request-Id", "Retry-After", tokens.HEADER],
        allow_credentials=False,
        max_age=600,
    )


@contextlib.asynccontextmanager
async def serving(
    settings: Settings, models: dict[str, ModelInfo], drain: Drain, feed: LocalFeed | None = None
) -> AsyncIterator[Context]:
    """The process's clients, stores and background tasks, for as long as it serves
    (``feed``: a node's worker's appends, ``store/local.py``)."""
    if not settings.redis_url:
        raise RuntimeError("LASTEVENT_REDIS_URL is not set (use `lastevent up` for embedded)")
    redis = pool.of(settings, 256)
    # the tailer's shards block up to a second (tail.SWEEP_S) or tail_block_ms
    tail_redis = pool.of(settings, 64, longest_wait_s=tail.longest_block_s(settings.tail_block_ms))
    await warm(redis)
    await warm(tail_redis)
    keys = Keys(settings.key_prefix, settings.partitions)
    committer = commit.of(settings, redis, keys)
    await commit.started(committer, "api", settings.startup_replica_wait_s)
    ledger = Ledger(make_engine(settings.database_url)) if settings.database_url else None
    # key lookups on a pool of their own: made-up keys cannot take the ledger's connections
    url = settings.database_url
    key_store = ApiKeys(make_engine(url, pool_size=2)) if url else None
    stores = (redis, tail_redis, committer)
    ctx = _context(settings, models, drain, stores, ledger, key_store, feed)
    watch_tail(ctx.tailer, feed)
    drain.bind(asyncio.get_running_loop())
    assert drain.future is not None
    drain.future.add_done_callback(lambda _f: ctx.tailer.interrupt())
    await ctx.tailer.start()
    await ctx.presence.start()
    with contextlib.suppress(*UNREACHABLE, ConnectionError):  # (else: at its next refresh)
        await ctx.catalog.refresh()
    cataloguing = asyncio.create_task(ctx.catalog.run(), name="catalog")
    sweeper = sweeper_of(settings, redis, ctx)
    sweeping = asyncio.create_task(sweeper.run(), name="sweeper")
    lag = asyncio.create_task(watch_loop_lag(), name="event-loop-lag")
    try:
        yield ctx
    finally:
        tasks = (sweeping, lag, cataloguing)
        for task in tasks:
            task.cancel()
        if committer.barriers:
            log.info("commit barriers sent: %d (%s)", committer.barriers, committer.level)
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [
            ("background tasks", lambda: asyncio.gather(*tasks, return_exceptions=True)),
            ("readers' leases", ctx.presence.stop),
            ("tailer", ctx.tailer.stop),
        ]
        if ledger is not None:
            steps.append(("ledger", ledger.close))
        if key_store is not None:
            steps.append(("key store", key_store.engine.dispose))
        steps += [("redis", redis.aclose), ("tail redis", tail_redis.aclose)]
        await aio.teardown(steps, settings.drain_s)


def _tailer(
    settings: Settings, stores: tuple[Redis, Redis, Committer], feed: LocalFeed | None = None
) -> LogTailer:
    tail_redis, redis, committer = stores
    return LogTailer(
        tail_redis,
        committer.keys,
        block_ms=settings.tail_block_ms,
        count=settings.tail_count,
        shard_size=settings.tail_shard_size,
        keepalive_s=settings.keepalive_s,
        writer=redis,
        committer=committer,
        feed=feed,
    )


def _context(
    settings: Settings,
    models: dict[str, ModelInfo],
    drain: Drain,
    stores: tuple[Redis, Redis, Committer],
    ledger: Ledger | None,
    key_store: ApiKeys | None = None,
    feed: LocalFeed | None = None,
) -> Context:
    redis, tail_redis, committer = stores
    keys = committer.keys
    retention = Retention.of(settings)
    readers = Readers(redis, keys, retention)
    return Context(
        settings=settings,
        redis=redis,
        log=RedisLog(redis, keys, retention, committer),
        tailer=_tailer(settings, (tail_redis, redis, committer), feed),
        model=models[settings.model_name],
        catalog=Catalog(
            models,
            settings.model_name,
            ModelRegistry(redis, keys),
            Heartbeats(redis, keys),
            settings.worker_stale_s,
        ),
        ledger=ledger,
        presence=Presence(
            readers, lease_ttl_s=settings.lease_ttl_s, refresh_s=settings.lease_refresh_s
        ),
        auth=Authenticator(
            key_store,
            auth=settings.auth,
            cache_s=settings.auth_cache_s,
            failures_per_minute=settings.auth_failures_per_minute,
        ),
        admission=Admission(Limits(redis, keys), Heartbeats(redis, keys), settings),
        drain=drain,
        idempotency=IdempotencyKeys(redis, keys, settings.idempotency_ttl_s),
        audit=Audit(ledger.engine) if ledger else None,
        seats=Seats(settings.max_readers_per_request, settings.max_readers_per_key),
    )


def _handlers() -> dict[
    int | type[Exception], Callable[[Request[Any, Any, Any], Any], Response[Any]]
]:
    return {
        ApiError: _api_error,
        HTTPException: _http_error,
        **{e: _store_unavailable for e in UNREACHABLE if e is not OSError},
        # (a refused / reset connection: redis-py's cluster client re-learning its slot
        # map lets the socket's own error out)
        ConnectionError: _store_unavailable,
        PostgresUnavailable: _ledger_unavailable,
        Exception: _internal_error,
    }


def _client(request: Request[Any, Any, Any]) -> str | None:
    """The client's address (a trusted proxy's X-Forwarded-For: ``server.py``)."""
    return request.client.host if request.client else None


def _provide_ctx(request: Request[Any, Any, Any]) -> Context:
    ctx: Context = request.app.state.ctx
    return ctx


def create_app(
    settings: Settings, drain: Drain | None = None, feed: LocalFeed | None = None
) -> Litestar:
    models = {name: ModelInfo.load(path, name) for name, path in settings.model_dirs.items()}
    drain = drain or Drain()
    if settings.auth == "required" and not settings.database_url:
        raise RuntimeError(
            "API keys live in Postgres: set LASTEVENT_DATABASE_URL or LASTEVENT_AUTH=off"
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        async with serving(settings, models, drain, feed) as ctx:
            aio.dump_tasks_on_sigusr1()  # a hung API: where its tasks wait
            app.state.ctx = ctx
            aio.freeze_heap()
            yield

    async def provide_principal(request: Request[Any, Any, Any]) -> Principal:
        ctx: Context = request.app.state.ctx
        authorization = request.headers.get("authorization")
        token = request.query_params.get(tokens.QUERY)
        if token is not None and not authorization:
            return await _stream_token_principal(ctx, request, token)
        return await ctx.auth.principal(authorization, _client(request))

    return Litestar(
        cors_config=cors_config(settings),
        route_handlers=[
            CompletionsController,
            RequestsController,
            ResponsesController,
            responses_socket,
            StoredCompletionsController,
            SystemController,
            VllmCompatController,
            AdminController,
            PlaygroundController,
            ConsoleController,
        ],
        dependencies={
            "ctx": Provide(_provide_ctx, sync_to_thread=False),
            "principal": Provide(provide_principal),
        },
        exception_handlers=_handlers(),
        lifespan=[lifespan],
        # every route's body: JSON that cannot be read is a 400 (Litestar's own reading
        # lets a RecursionError out as a 500), read before the key is checked
        request_class=JsonBodyRequest,
        request_max_body_size=settings.max_body_bytes,
        openapi_config=openapi_config(title="lastevent", version="0.1.0"),
        type_encoders={msgspec.Struct: msgspec.to_builtins},
        debug=False,
    )
