"""API keys and tenants.

A key looks like ``sk-le-<key id>-<secret>``. The key id is public (it names the key
in the ledger and in logs); only a SHA-256 of the secret is stored. The secrets are
random 128-bit values, so a fast hash is enough (no password stretching needed).
Verified keys are cached per API process for ``auth_cache_s``: revoking a key takes
effect within that time on every replica.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import secrets
import time

from sqlalchemy import select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine

from service.db.models import ApiKeyRow, TenantRow

KEY_RE = re.compile(r"sk-le-([a-z0-9]{1,32})-([A-Za-z0-9]{8,128})")
ROLES = ("user", "operator")


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    key_id: str | None
    role: str = "user"
    models: tuple[str, ...] | None = None  # None: every model

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


ANONYMOUS = Principal(tenant="default", key_id=None)  # only when LASTEVENT_AUTH=off


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_key(raw: str) -> tuple[str, str] | None:
    match = KEY_RE.fullmatch(raw.strip())
    return None if match is None else (match.group(1), match.group(2))


class KeyStore:
    def __init__(self, engine: AsyncEngine, cache_s: float = 30.0) -> None:
        self.engine = engine
        self.cache_s = cache_s
        self._cache: dict[str, tuple[float, ApiKeyRow | None]] = {}

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
                insert(TenantRow).values(name=tenant).on_conflict_do_nothing(index_elements=["name"])
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

    async def verify(self, raw: str) -> Principal | None:
        parsed = parse_key(raw)
        if parsed is None:
            return None
        key_id, secret = parsed
        row = await self._row(key_id)
        if row is None or row.revoked_at is not None:
            return None
        if not hmac.compare_digest(row.secret_hash, hash_secret(secret)):
            return None
        models = tuple(row.models.split(",")) if row.models else None
        return Principal(tenant=row.tenant, key_id=row.id, role=row.role, models=models)

    async def _row(self, key_id: str) -> ApiKeyRow | None:
        now = time.monotonic()
        cached = self._cache.get(key_id)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1]
        async with self.engine.connect() as conn:
            row = (
                await conn.execute(select(ApiKeyRow).where(ApiKeyRow.id == key_id))
            ).first()
        value = None if row is None else ApiKeyRow(**row._mapping)
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[key_id] = (now, value)
        return value
