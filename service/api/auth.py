"""Who is calling: ``Authorization: Bearer sk-le-<key id>-<secret>`` -> a ``Principal``.

Verified keys are cached per API process for ``auth_cache_s``: revoking a key takes
effect within that time on every replica. The keys themselves live in Postgres
(``service/ledger/api_keys.py``).
"""

from __future__ import annotations

import dataclasses
import hmac
import re
import time

from service.errors import Unauthorized
from service.ledger.api_keys import ApiKeys, hash_secret
from service.ledger.models import ApiKeyRow

KEY_RE = re.compile(r"sk-le-([a-z0-9]{1,32})-([A-Za-z0-9]{8,128})")


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    key_id: str | None
    role: str = "user"
    models: tuple[str, ...] | None = None  # None: every model

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


ANONYMOUS = Principal(tenant="default", key_id=None)  # only when LASTEVENT_AUTH=off


def parse_key(raw: str) -> tuple[str, str] | None:
    match = KEY_RE.fullmatch(raw.strip())
    return None if match is None else (match.group(1), match.group(2))


class Authenticator:
    def __init__(self, keys: ApiKeys | None, *, auth: str = "required", cache_s: float = 30.0):
        self.keys = keys
        self.auth = auth
        self.cache_s = cache_s
        self._cache: dict[str, tuple[float, ApiKeyRow | None]] = {}

    async def principal(self, authorization: str | None) -> Principal:
        """The caller, from the ``Authorization`` header; ``Unauthorized`` otherwise."""
        raw = (authorization or "").strip()
        if raw.lower().startswith("bearer "):
            raw = raw[7:].strip()
        if self.auth == "off" and parse_key(raw) is None:
            return ANONYMOUS  # SDKs insist on some api_key; with auth off, only real keys count
        if not raw:
            raise Unauthorized(
                "no API key: send 'Authorization: Bearer sk-le-...'", code="missing_api_key"
            )
        if self.keys is None:
            raise Unauthorized(
                "API keys need a database (LASTEVENT_DATABASE_URL)", code="no_key_store"
            )
        principal = await self.verify(raw)
        if principal is None:
            raise Unauthorized("the API key is not valid", code="invalid_api_key")
        return principal

    async def verify(self, raw: str) -> Principal | None:
        parsed = parse_key(raw)
        if parsed is None or self.keys is None:
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
        assert self.keys is not None
        now = time.monotonic()
        cached = self._cache.get(key_id)
        if cached is not None and now - cached[0] < self.cache_s:
            return cached[1]
        value = await self.keys.get(key_id)
        if len(self._cache) > 10_000:
            self._cache.clear()
        self._cache[key_id] = (now, value)
        return value
