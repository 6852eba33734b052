"""The billing ledger: one row per request, written idempotently from its terminal event."""

from __future__ import annotations

import dataclasses
import datetime as dt
import time

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker, create_async_engine

from service.db.models import RequestRow


def make_engine(url: str) -> AsyncEngine:
    return create_async_engine(url, pool_size=5, max_overflow=5, pool_pre_ping=True)


@dataclasses.dataclass(frozen=True, slots=True)
class Record:
    id: str
    kind: str
    model: str
    created_at: dt.datetime
    first_token_at: dt.datetime | None
    ended_at: dt.datetime
    state: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    wasted_tokens: int
    error_code: str | None
    worker_id: str | None
    last_event_id: str | None


class Ledger:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._sessions = async_sessionmaker(engine, expire_on_commit=False)

    async def record(self, rec: Record) -> bool:
        """Insert the row; a second delivery of the same terminal event changes nothing.

        Returns True when this call wrote the row.
        """
        values = dataclasses.asdict(rec)
        values["total_tokens"] = rec.prompt_tokens + rec.completion_tokens
        values["recorded_ms"] = int(time.time() * 1000)
        stmt = insert(RequestRow).values(**values).on_conflict_do_nothing(index_elements=["id"])
        async with self.engine.begin() as conn:
            result = await conn.execute(stmt)
        return bool(result.rowcount)

    async def get(self, request_id: str) -> RequestRow | None:
        async with self._sessions() as session:
            return (
                await session.execute(select(RequestRow).where(RequestRow.id == request_id))
            ).scalar_one_or_none()
