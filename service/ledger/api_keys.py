"""API keys and tenants in Postgres. Only a SHA-256 of each key's secret is stored.

A key looks like ``sk-le-<key id>-<secret>``; the key id is public (it names the key
in the ledger and in logs). The secrets are random 128-bit values, so a fast hash is
enough (no password stretching needed). Verifying a key is ``api/auth.py``'s job.

``get`` is on every request's path (when the API's cache has no fresh answer): it is
bounded in time and raises ``PostgresUnavailable`` when Postgres cannot be asked, so
the API can tell "no such key" (``None``) from "cannot know now".
"""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy import func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from service.ledger.ledger import PostgresUnavailable, asking
from service.ledger.models import ApiKeyRow, TenantRow

__all__ = ["ROLES", "ApiKeys", "PostgresUnavailable", "hash_secret"]

ROLES = ("user", "operator")


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class ApiKeys:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    async def create(
        self,
        tenant: str,
        *,
        role: str = "user",
        models: list[str] | None = None,
        key_id: str | None = None,
        secret: str | None = None,
    ) -> str:
        """Create the tenant if needed and a key for it; return the whole key (shown once)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        key_id = key_id or secrets.token_hex(6)
        secret = secret or secrets.token_hex(16)
        async with self.engine.begin() as conn:
            await conn.execute(
                insert(TenantRow)
                .values(name=tenant)
                .on_conflict_do_nothing(index_elements=["name"])
            )
            await conn.execute(
                insert(ApiKeyRow)
                .values(
                    id=key_id,
                    tenant=tenant,
                    secret_hash=hash_secret(secret),
                    role=role,
                    models=",".join(models) if models else None,
                )
                .on_conflict_do_nothing(index_elements=["id"])
            )
        return f"sk-le-{key_id}-{secret}"

    async def set_keep_inputs(self, tenant: str, keep: bool) -> None:
        """Keep every request's input of ``tenant`` for audit (the tenant is made if new)."""
        stmt = insert(TenantRow).values(name=tenant, keep_inputs=keep)
        stmt = stmt.on_conflict_do_update(index_elements=["name"], set_={"keep_inputs": keep})
        async with self.engine.begin() as conn:
            await conn.execute(stmt)

    async def list(self, tenant: str | None = None) -> list[ApiKeyRow]:
        """Every key (of ``tenant``), oldest first, revoked ones included."""
        query = select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.id)
        if tenant is not None:
            query = query.where(ApiKeyRow.tenant == tenant)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [ApiKeyRow(**row._mapping) for row in rows]

    async def revoke(self, key_id: str) -> bool:
        """Revoke the key (its stream tokens with it); False if there is no such key
        or it was revoked already. API processes see it within ``auth_cache_s``."""
        query = (
            update(ApiKeyRow)
            .where(ApiKeyRow.id == key_id, ApiKeyRow.revoked_at.is_(None))
            .values(revoked_at=func.now())
        )
        async with self.engine.begin() as conn:
            result = await conn.execute(query)
        return bool(result.rowcount)

    async def get(self, key_id: str) -> ApiKeyRow | None:
        """The key's row, ``None`` if there is none; ``PostgresUnavailable`` if Postgres
        cannot be asked (down, refusing, or not answering within the lookup bound)."""
        async with asking(f"API key {key_id}"), self.engine.connect() as conn:
            row = (await conn.execute(select(ApiKeyRow).where(ApiKeyRow.id == key_id))).first()
        return None if row is None else ApiKeyRow(**row._mapping)
