"""What operators and tenants look up in the ledger: requests found by filters (keyset
paging, newest first), a tenant's stored chat completions (OpenAI's list, update and
delete), and spend per day.

Every query here is bounded by an index of migration 0007: each filter column is followed
by ``(ended_at, id)``, so a filtered page is one index range scan read from its end, and
the next page starts strictly after the last row shown (no ``OFFSET``: page 1,000 costs
what page 1 does).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from sqlalchemy import Select, delete, func, inspect, select, tuple_, update
from sqlalchemy.ext.asyncio import AsyncEngine, async_sessionmaker

from service.ledger.ledger import asking
from service.ledger.models import ArchiveRow, RequestRow


@dataclasses.dataclass(frozen=True, slots=True)
class Filters:
    """Equality on each column that is set; ``metadata``: every pair present; ``since`` /
    ``until``: ``ended_at`` in [since, until)."""

    tenant: str | None = None
    api_key_id: str | None = None
    end_user: str | None = None
    model: str | None = None
    state: str | None = None
    error_code: str | None = None
    finish_reason: str | None = None
    kind: str | None = None
    metadata: dict[str, str] | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None


# Filters' equality fields and their columns
_EQUAL = (
    "tenant",
    "api_key_id",
    "end_user",
    "model",
    "state",
    "error_code",
    "finish_reason",
    "kind",
)


@dataclasses.dataclass(frozen=True, slots=True)
class Position:
    """Where a page of requests (newest first) ended: the last row's ``ended_at`` and id."""

    ended_at: dt.datetime
    request_id: str

    def encode(self) -> str:
        micros = round(self.ended_at.timestamp() * 1_000_000)
        return f"{micros}.{self.request_id}"

    @classmethod
    def decode(cls, raw: str) -> Position | None:
        """``None`` for a string ``encode`` never made."""
        micros, _, request_id = raw.partition(".")
        if not (micros.isdigit() and len(micros) <= 17 and 0 < len(request_id) <= 64):
            return None
        when = dt.datetime.fromtimestamp(int(micros) / 1_000_000, tz=dt.UTC)
        return cls(when, request_id)


@dataclasses.dataclass(frozen=True, slots=True)
class StoredPage:
    rows: list[RequestRow]
    has_more: bool


def row_dict(row: RequestRow) -> dict[str, Any]:
    """A row's columns by their names (``metadata`` included), times as ISO 8601."""
    out: dict[str, Any] = {}
    for attr in inspect(RequestRow).column_attrs:
        value = getattr(row, attr.key)
        out[attr.columns[0].name] = value.isoformat() if isinstance(value, dt.datetime) else value
    return out


def _filtered(query: Select[Any], f: Filters) -> Select[Any]:
    for name in _EQUAL:
        value = getattr(f, name)
        if value is not None:
            query = query.where(getattr(RequestRow, name) == value)
    if f.metadata:
        query = query.where(RequestRow.metadata_.contains(f.metadata))
    if f.since is not None:
        query = query.where(RequestRow.ended_at >= f.since)
    if f.until is not None:
        query = query.where(RequestRow.ended_at < f.until)
    return query


class Audit:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self._sessions = async_sessionmaker(engine, expire_on_commit=False)

    async def requests(
        self, f: Filters, *, limit: int, after: Position | None = None
    ) -> tuple[list[RequestRow], Position | None]:
        """A page of rows, newest first, and where the next one starts (``None``: no more)."""
        query = _filtered(select(RequestRow), f)
        if after is not None:
            key = tuple_(RequestRow.ended_at, RequestRow.id)
            query = query.where(key < tuple_(after.ended_at, after.request_id))
        query = query.order_by(RequestRow.ended_at.desc(), RequestRow.id.desc()).limit(limit + 1)
        async with asking("requests"), self._sessions() as session:
            rows = list((await session.execute(query)).scalars())
        if len(rows) <= limit:
            return rows, None
        last = rows[limit - 1]
        return rows[:limit], Position(last.ended_at, last.id)

    async def request(self, request_id: str) -> RequestRow | None:
        async with asking(f"request {request_id}"), self._sessions() as session:
            query = select(RequestRow).where(RequestRow.id == request_id)
            return (await session.execute(query)).scalar_one_or_none()

    async def stored(
        self,
        tenant: str,
        *,
        model: str | None,
        metadata: dict[str, str] | None,
        after: str | None,
        limit: int,
        descending: bool,
    ) -> StoredPage | None:
        """A tenant's stored chat completions in the order they were made; ``None`` when
        ``after`` names none of them."""
        query = select(RequestRow).where(RequestRow.tenant == tenant, RequestRow.stored)
        if model is not None:
            query = query.where(RequestRow.model == model)
        if metadata:
            query = query.where(RequestRow.metadata_.contains(metadata))
        async with asking("stored completions"), self._sessions() as session:
            if after is not None:
                anchor = await self._stored_row(session, tenant, after)
                if anchor is None:
                    return None
                # a row comparison: an index bound on (tenant, created_at, id), where an
                # OR of the two cases would read the tenant's list from its start
                key, at = (
                    tuple_(RequestRow.created_at, RequestRow.id),
                    (anchor.created_at, anchor.id),
                )
                query = query.where(key < tuple_(*at) if descending else key > tuple_(*at))
            order = (RequestRow.created_at, RequestRow.id)
            query = query.order_by(*(c.desc() if descending else c.asc() for c in order))
            rows = list((await session.execute(query.limit(limit + 1))).scalars())
        return StoredPage(rows[:limit], len(rows) > limit)

    @staticmethod
    async def _stored_row(session: Any, tenant: str, request_id: str) -> RequestRow | None:
        query = select(RequestRow).where(
            RequestRow.id == request_id, RequestRow.tenant == tenant, RequestRow.stored
        )
        row: RequestRow | None = (await session.execute(query)).scalar_one_or_none()
        return row

    async def stored_one(self, tenant: str, request_id: str) -> RequestRow | None:
        async with asking(f"stored completion {request_id}"), self._sessions() as session:
            return await self._stored_row(session, tenant, request_id)

    async def set_metadata(
        self, tenant: str, request_id: str, metadata: dict[str, str] | None
    ) -> RequestRow | None:
        """Replace a stored completion's metadata (OpenAI's update); ``None``: no such one."""
        stmt = (
            update(RequestRow)
            .where(RequestRow.id == request_id, RequestRow.tenant == tenant, RequestRow.stored)
            .values(metadata_=metadata)
        )
        async with asking(f"stored completion {request_id}"), self.engine.begin() as conn:
            if not (await conn.execute(stmt)).rowcount:
                return None
        return await self.stored_one(tenant, request_id)

    async def forget(self, tenant: str, request_id: str) -> bool:
        """OpenAI's delete: the stored completion is no longer listed, its metadata and its
        archive (input and output) are gone; the billing row stays. Whether it was there."""
        unlisted = (
            update(RequestRow)
            .where(RequestRow.id == request_id, RequestRow.tenant == tenant, RequestRow.stored)
            .values(stored=False, metadata_=None)
        )
        async with asking(f"stored completion {request_id}"), self.engine.begin() as conn:
            if not (await conn.execute(unlisted)).rowcount:
                return False
            await conn.execute(delete(ArchiveRow).where(ArchiveRow.request_id == request_id))
        return True

    async def archives(self, request_ids: list[str]) -> dict[str, bytes]:
        """The archived logs of these requests (those that have one), in one query."""
        if not request_ids:
            return {}
        query = select(ArchiveRow.request_id, ArchiveRow.data).where(
            ArchiveRow.request_id.in_(request_ids)
        )
        async with asking("archives"), self.engine.connect() as conn:
            return {rid: data for rid, data in await conn.execute(query)}

    async def spend(
        self, since: dt.datetime, until: dt.datetime, tenant: str | None
    ) -> list[dict[str, Any]]:
        """Usage per UTC day, tenant and model, for ``ended_at`` in [since, until)."""
        day = func.to_char(func.timezone("UTC", RequestRow.ended_at), "YYYY-MM-DD").label("day")
        query = select(
            day,
            RequestRow.tenant,
            RequestRow.model,
            func.count().label("requests"),
            *(func.coalesce(func.sum(getattr(RequestRow, c)), 0).label(c) for c in SPEND_SUMS),
        ).where(RequestRow.ended_at >= since, RequestRow.ended_at < until)
        if tenant is not None:
            query = query.where(RequestRow.tenant == tenant)
        query = query.group_by(day, RequestRow.tenant, RequestRow.model).order_by(
            day, RequestRow.tenant, RequestRow.model
        )
        async with asking("spend"), self.engine.connect() as conn:
            return [dict(r._mapping) for r in await conn.execute(query)]


SPEND_SUMS = (
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "wasted_tokens",
    "reprefill_tokens",
)
