"""The billing ledger and the log archive: written once per request, idempotently.

``record`` inserts the request's row and its archived log in one transaction with
``INSERT ... ON CONFLICT DO NOTHING`` on the request id, so delivering the same
terminal event twice (a recorder killed between commit and ack) changes nothing.
"""

from __future__ import annotations

import datetime as dt
import time
from typing import Any

from sqlalchemy import delete, func, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from service.ledger.models import ArchiveRow, RequestRow
from service.stream import archive as archive_format
from service.stream.events import Event, Summary
from service.stream.ids import EventId


def make_engine(url: str) -> AsyncEngine:
    return create_async_engine(url, pool_size=5, max_overflow=5, pool_pre_ping=True)


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
        "error_code": s.error_code,
        "worker_id": s.worker_id,
        "last_event_id": end_id,
        "recorded_ms": int(time.time() * 1000),
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
        async with self._sessions() as session:
            return (
                await session.execute(select(RequestRow).where(RequestRow.id == request_id))
            ).scalar_one_or_none()

    async def close(self) -> None:
        await self.engine.dispose()

    async def check(self) -> str:
        """``"ok"`` if Postgres answers, else what went wrong (``/readyz``)."""
        try:
            async with self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except (SQLAlchemyError, OSError) as exc:
            return f"error: {exc}"
        return "ok"

    async def archived(self, request_id: str) -> list[tuple[EventId, Event]] | None:
        """The archived log's entries (the hot log's ids and payloads), if there is one."""
        blob = await self.archive(request_id)
        return None if blob is None else archive_format.unpack(blob)

    async def archive(self, request_id: str) -> bytes | None:
        async with self.engine.connect() as conn:
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
        stmt = delete(ArchiveRow)
        if older_than is not None:
            stmt = stmt.where(ArchiveRow.ended_at < older_than)
        if tenant is not None:
            stmt = stmt.where(ArchiveRow.tenant == tenant)
        async with self.engine.begin() as conn:
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
                )
                .where(RequestRow.ended_at >= since, RequestRow.ended_at < until)
                .group_by(RequestRow.tenant, RequestRow.model)
                .order_by(RequestRow.tenant, RequestRow.model)
            )
            return list(result.all())
