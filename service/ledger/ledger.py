"""The billing ledger and the log archive: written once per request, idempotently.

``record`` inserts the request's row and its archived log in one transaction with
``INSERT ... ON CONFLICT DO NOTHING`` on the request id, so delivering the same
terminal event twice (a recorder killed between commit and ack) changes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import delete, func, select, text, update
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.engine import make_url
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from service.ledger.models import ArchiveRow, RequestRow
from service.stream import archive as archive_format
from service.stream.events import Event, Summary
from service.stream.ids import EventId

CONNECT_TIMEOUT_S = 5.0  # a connection attempt to a half-dead server gives up after this
POOL_TIMEOUT_S = 5.0  # waiting for a pooled connection (all busy or all connecting)
LOOKUP_TIMEOUT_S = 5.0  # one read on a request's path, pool wait and pre-ping included


def make_engine(
    url: str,
    *,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
    pool_timeout_s: float = POOL_TIMEOUT_S,
    pool_size: int = 5,
) -> AsyncEngine:
    """The engine every process uses. A server that accepts connections and never
    answers (half-dead, or a black-holed network) costs a caller ``connect_timeout_s``,
    not asyncpg's default minute."""
    connect_args: dict[str, Any] = {}
    if make_url(url).get_driver_name() == "asyncpg":
        connect_args["timeout"] = connect_timeout_s
    return create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_pre_ping=True,
        pool_timeout=pool_timeout_s,
        connect_args=connect_args,
    )


class PostgresUnavailable(Exception):
    """Postgres could not be asked: down, refusing, unreachable, shutting down, or too
    slow to answer. Not a bug: the API answers 503 (or serves what it already knows)."""


# SQLSTATEs that say "the server is not there for you", not "your query is wrong":
# class 08 (connection exception) is matched by prefix
_UNREACHABLE_SQLSTATES = frozenset(
    {
        "57P01",  # admin_shutdown (the server is stopping)
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now (starting up, shutting down, in recovery)
        "53300",  # too_many_connections
    }
)


def unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` means Postgres could not be reached (rather than a bug).

    What the asyncpg engine actually raises (measured): a stopped server, connection
    refused, a missing unix socket or a connection closed on accept -- the bare
    ``OSError`` (``ConnectionRefusedError``, ``FileNotFoundError``,
    ``ConnectionResetError``); a connect timeout -- ``TimeoutError``; a pooled
    connection whose server went away -- ``sqlalchemy.exc.InterfaceError`` or
    ``DBAPIError`` with ``connection_invalidated`` (asyncpg's
    ``ConnectionDoesNotExistError``, SQLSTATE 08003, from ``AdminShutdownError``
    57P01). The asyncpg dialect maps no error to ``OperationalError``; other drivers
    do, so it counts too. The pool's own checkout timeout is
    ``sqlalchemy.exc.TimeoutError``.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError | sa_exc.TimeoutError | sa_exc.OperationalError):
            return True  # OSError includes TimeoutError and every ConnectionError
        if isinstance(current, sa_exc.DBAPIError) and current.connection_invalidated:
            return True
        state = getattr(current, "sqlstate", None)
        if isinstance(state, str) and (state.startswith("08") or state in _UNREACHABLE_SQLSTATES):
            return True
        orig = current.orig if isinstance(current, sa_exc.DBAPIError) else None
        current = current.__cause__ or orig  # not __context__: a bug raised while handling
    return False


@contextlib.asynccontextmanager
async def asking(what: str, timeout_s: float = LOOKUP_TIMEOUT_S) -> AsyncIterator[None]:
    """Bound a read on a request's path and turn "Postgres is unreachable" into
    ``PostgresUnavailable``; anything else (a bug) propagates as it is."""
    try:
        async with asyncio.timeout(timeout_s):
            yield
    except Exception as exc:
        if unreachable(exc):
            detail = str(exc) or "no answer"
            raise PostgresUnavailable(f"{what}: {type(exc).__name__}: {detail}") from exc
        raise


def _ts(ms: int | None) -> dt.datetime | None:
    return None if ms is None else dt.datetime.fromtimestamp(ms / 1000, tz=dt.UTC)


def row_values(s: Summary, end_id: str) -> dict[str, Any]:
    ended_ms = int(end_id.split("-")[0])
    return {
        "id": s.request_id,
        "tenant": s.tenant or "default",
        "api_key_id": s.api_key_id,
        "kind": s.kind,
        "model": s.model,
        "created_at": _ts(s.created_ms),
        "dispatched_at": _ts(s.dispatched_ms),
        "first_token_at": _ts(s.first_token_ms),
        "ended_at": _ts(ended_ms),
        "state": s.state,
        "finish_reason": s.finish_reason,
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "wasted_tokens": s.wasted_tokens,
        "takeovers": s.takeovers,
        "handovers": s.handovers,
        "reprefill_tokens": s.reprefill_tokens,
        "error_code": s.error_code,
        "end_user": s.user,
        "worker_id": s.worker_id,
        "last_event_id": end_id,
        "recorded_ms": int(time.time() * 1000),
        "metadata_": s.metadata,
        "stored": s.listed,
    }


class Ledger:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._sessions = async_sessionmaker(engine, expire_on_commit=False)

    async def record(
        self, summary: Summary, end_id: str, archive: tuple[bytes, int, int] | None = None
    ) -> bool:
        """Row (and archive: blob, events, raw size) in one transaction. True if new."""
        values = row_values(summary, end_id)
        stmt = insert(RequestRow).values(**values).on_conflict_do_nothing(index_elements=["id"])
        async with self.engine.begin() as conn:
            result = await conn.execute(stmt)
            if archive is not None:
                blob, n_events, raw_size = archive
                await conn.execute(
                    insert(ArchiveRow)
                    .values(
                        request_id=summary.request_id,
                        tenant=values["tenant"],
                        ended_at=values["ended_at"],
                        events=n_events,
                        raw_bytes=raw_size,
                        data=blob,
                    )
                    .on_conflict_do_nothing(index_elements=["request_id"])
                )
        return bool(result.rowcount)

    async def get(self, request_id: str) -> RequestRow | None:
        """The request's row; ``PostgresUnavailable`` if Postgres cannot be asked."""
        async with asking(f"request {request_id}"), self._sessions() as session:
            return (
                await session.execute(select(RequestRow).where(RequestRow.id == request_id))
            ).scalar_one_or_none()

    async def close(self) -> None:
        await self.engine.dispose()

    async def check(self) -> str:
        """``"ok"`` if Postgres answers, else what went wrong (``/readyz``)."""
        try:
            async with asking("readiness"), self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except (PostgresUnavailable, SQLAlchemyError, OSError) as exc:
            return f"error: {exc}"
        return "ok"

    async def archived(self, request_id: str) -> list[tuple[EventId, Event]] | None:
        """The archived log's entries (the hot log's ids and payloads), if there is one;
        ``PostgresUnavailable`` if Postgres cannot be asked (not ``None``: that says
        there is no such request)."""
        blob = await self.archive(request_id)
        return None if blob is None else archive_format.unpack(blob)

    async def delete_archive(self, request_id: str) -> bool:
        """Remove one request's archived log (its billing row stays); whether one was there."""
        async with asking(f"archive of {request_id}"), self.engine.begin() as conn:
            stmt = delete(ArchiveRow).where(ArchiveRow.request_id == request_id)
            return int((await conn.execute(stmt)).rowcount) > 0

    async def archive(self, request_id: str) -> bytes | None:
        async with asking(f"archive of {request_id}"), self.engine.connect() as conn:
            return (
                await conn.execute(
                    select(ArchiveRow.data).where(ArchiveRow.request_id == request_id)
                )
            ).scalar_one_or_none()

    async def rows_between(self, since: dt.datetime, until: dt.datetime) -> list[RequestRow]:
        async with self._sessions() as session:
            result = await session.execute(
                select(RequestRow)
                .where(RequestRow.ended_at >= since, RequestRow.ended_at < until)
                .order_by(RequestRow.ended_at)
            )
            return list(result.scalars())

    async def purge_archives(self, *, older_than: dt.datetime | None, tenant: str | None) -> int:
        """Delete archived logs (answers and the inputs kept in them) ended before
        ``older_than``, of one tenant or all; stored completions among them are no longer
        listed (their billing rows stay). How many archives went."""
        stmt = delete(ArchiveRow)
        unlist = update(RequestRow).where(RequestRow.stored).values(stored=False)
        if older_than is not None:
            stmt = stmt.where(ArchiveRow.ended_at < older_than)
            unlist = unlist.where(RequestRow.ended_at < older_than)
        if tenant is not None:
            stmt = stmt.where(ArchiveRow.tenant == tenant)
            unlist = unlist.where(RequestRow.tenant == tenant)
        async with self.engine.begin() as conn:
            await conn.execute(unlist)
            return int((await conn.execute(stmt)).rowcount)

    async def usage_by_tenant(self, since: dt.datetime, until: dt.datetime) -> list[Any]:
        async with self.engine.connect() as conn:
            result = await conn.execute(
                select(
                    RequestRow.tenant,
                    RequestRow.model,
                    func.count().label("requests"),
                    func.sum(RequestRow.prompt_tokens).label("prompt_tokens"),
                    func.sum(RequestRow.completion_tokens).label("completion_tokens"),
                    func.sum(RequestRow.total_tokens).label("total_tokens"),
                    func.sum(RequestRow.wasted_tokens).label("wasted_tokens"),
                    func.sum(RequestRow.reprefill_tokens).label("reprefill_tokens"),
                )
                .where(RequestRow.ended_at >= since, RequestRow.ended_at < until)
                .group_by(RequestRow.tenant, RequestRow.model)
                .order_by(RequestRow.tenant, RequestRow.model)
            )
            return list(result.all())
