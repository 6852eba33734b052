"""Who is calling: ``Authorization: Bearer sk-le-<key id>-<secret>`` -> a ``Principal``.

Verified keys are cached per API process for ``auth_cache_s``: revoking a key takes
effect within that time on every replica. The keys themselves live in Postgres
(``service/ledger/api_keys.py``).

When Postgres cannot be asked (down, refusing, or not answering within the ledger's
lookup bound), the last answer the store gave for a key is served however old it is --
a verified key keeps working, a key it called unknown or revoked stays a 401 -- and a
key never seen before is a 503 with ``Retry-After`` (``key_store_unavailable``): this
process cannot know. After a failure at most one lookup per ``probe_interval_s`` asks
the store (a cached key's in the background, so its request does not wait); the first
answer ends the outage and the cache refreshes as usual again.

Keys the store called unknown are remembered apart (``_unknown``), so a flood of made-up
keys neither asks Postgres twice for one nor pushes real keys out of the cache; and a
client address that sent ``failures_per_minute`` credentials that were not valid gets
429 (``too_many_auth_failures``) for the rest of that minute for any key the cache
cannot answer alone (``throttle.py``): it costs Postgres nothing more.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import re
import time
from typing import TypeVar

from service.api.throttle import FailureLimit
from service.errors import ApiError, ServiceUnavailable, Unauthorized
from service.ledger.api_keys import ApiKeys, PostgresUnavailable, hash_secret
from service.ledger.models import ApiKeyRow
from service.settings import Auth

log = logging.getLogger("lastevent.auth")
T = TypeVar("T")

KEY_RE = re.compile(r"sk-le-([a-z0-9]{1,32})-([A-Za-z0-9]{8,128})")


@dataclasses.dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    key_id: str | None
    role: str = "user"
    models: tuple[str, ...] | None = None  # None: every model
    keep_inputs: bool = False  # the tenant keeps every request's input for audit

    def may_use(self, model: str) -> bool:
        return self.models is None or model in self.models


ANONYMOUS = Principal(tenant="default", key_id=None)  # only when LASTEVENT_AUTH=off


def parse_key(raw: str) -> tuple[str, str] | None:
    match = KEY_RE.fullmatch(raw.strip())
    return None if match is None else (match.group(1), match.group(2))


RETRY_AFTER_S = 2  # told to the holder of a key never seen while the store is down
PROBE_INTERVAL_S = 1.0  # while the store is failing: at most one lookup per interval
MAX_ENTRIES = 10_000
MAX_UNKNOWN = 100_000  # key ids the store called unknown, remembered apart


class TooManyFailures(ApiError):
    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(
            "too many API keys or stream tokens that are not valid came from this address; "
            f"retry in {retry_after_s} s",
            code="too_many_auth_failures",
            headers={"Retry-After": str(retry_after_s)},
        )


@dataclasses.dataclass(frozen=True, slots=True)
class _Answer:
    asked: float  # time.monotonic() when the store was asked
    row: ApiKeyRow | None  # None: no such key


class Authenticator:
    def __init__(
        self,
        keys: ApiKeys | None,
        *,
        auth: Auth,  # (these two: Settings' auth, auth_cache_s)
        cache_s: float,
        probe_interval_s: float = PROBE_INTERVAL_S,
        max_entries: int = MAX_ENTRIES,
        failures_per_minute: int = 0,
    ):
        self.keys = keys
        self.auth = auth
        self.cache_s = cache_s
        self.probe_interval_s = probe_interval_s
        self.max_entries = max_entries
        self._cache: dict[str, _Answer] = {}  # known keys, oldest answer first
        self._unknown: dict[str, float] = {}  # key id -> when the store said "no such key"
        self.failures = FailureLimit(failures_per_minute)
        self._lookups: dict[str, asyncio.Future[ApiKeyRow | None]] = {}  # one per key
        self._refreshes: set[asyncio.Task[None]] = set()
        self._failing_since: float | None = None  # the store's last lookup failed
        self._next_probe = 0.0

    @property
    def store_failing(self) -> bool:
        return self._failing_since is not None

    def throttle(self, client: str | None) -> int:
        """Seconds the client address must wait before a credential the cache cannot
        answer is looked at (0: none)."""
        return 0 if client is None else self.failures.retry_after(client, time.monotonic())

    def failed(self, client: str | None) -> None:
        if client is not None:
            self.failures.failed(client, time.monotonic())

    async def principal(self, authorization: str | None, client: str | None = None) -> Principal:
        """The caller, from the ``Authorization`` header; ``Unauthorized`` otherwise
        (``ServiceUnavailable`` for a key not seen before while Postgres is down;
        ``TooManyFailures`` for one the cache cannot answer, from a client that sent too
        many that were not valid)."""
        try:
            return await self._principal(authorization, client)
        except Unauthorized as exc:
            if exc.code != "missing_api_key":
                self.failed(client)
            raise

    async def _principal(self, authorization: str | None, client: str | None) -> Principal:
        raw = (authorization or "").strip()
        if raw.lower().startswith("bearer "):
            raw = raw[7:].strip()
        if self.auth == Auth.OFF and parse_key(raw) is None:
            return ANONYMOUS  # SDKs insist on some api_key; with auth off, only real keys count
        if not raw:
            raise Unauthorized(
                "no API key: send 'Authorization: Bearer sk-le-...'", code="missing_api_key"
            )
        if self.keys is None:
            raise Unauthorized(
                "API keys need a database (LASTEVENT_DATABASE_URL)", code="no_key_store"
            )
        wait = self.throttle(client)
        if wait and not self._known(raw):
            raise TooManyFailures(wait)
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
        return Principal(
            tenant=row.tenant,
            key_id=row.id,
            role=row.role,
            models=models,
            keep_inputs=bool(row.keep_inputs),
        )

    def _fresh(self, key_id: str) -> _Answer | None:
        """The cache's answer for the key, if it is younger than ``cache_s``."""
        cached = self._cache.get(key_id)
        if cached is None or time.monotonic() - cached.asked >= self.cache_s:
            return None
        return cached

    def _known(self, raw: str) -> bool:
        """The key is in the cache, fresh and whole (so checking it asks nobody)."""
        parsed = parse_key(raw)
        fresh = None if parsed is None else self._fresh(parsed[0])
        if parsed is None or fresh is None or fresh.row is None:
            return False
        return hmac.compare_digest(fresh.row.secret_hash, hash_secret(parsed[1]))

    async def live(self, key_id: str) -> bool:
        """The key is known and unrevoked (stream tokens made from it stay valid)."""
        row = await self._row(key_id)
        return row is not None and row.revoked_at is None

    async def _row(self, key_id: str) -> ApiKeyRow | None:
        if (fresh := self._fresh(key_id)) is not None:
            return fresh.row
        now = time.monotonic()
        cached = self._cache.get(key_id)
        unknown = self._unknown.get(key_id)
        if unknown is not None and now - unknown < self.cache_s:
            return None
        if self._failing_since is not None:
            if now < self._next_probe:  # the store just failed: do not make everyone wait on it
                return self._last_answer(key_id)
            self._next_probe = now + self.probe_interval_s  # this request probes; no one else
            if cached is not None:
                self._refresh_in_background(key_id)
                return cached.row
        try:
            return await self._lookup(key_id)
        except PostgresUnavailable as exc:
            return self._last_answer(key_id, exc)

    def _last_answer(self, key_id: str, exc: PostgresUnavailable | None = None) -> ApiKeyRow | None:
        """What the store last said about the key, however old; 503 if it never said."""
        cached = self._cache.get(key_id)
        if cached is not None:
            return cached.row
        if key_id in self._unknown:
            return None
        raise ServiceUnavailable(
            "the API key store is unavailable, and this key has not been verified before; retry",
            code="key_store_unavailable",
            retry_after_s=RETRY_AFTER_S,
        ) from exc

    async def _lookup(self, key_id: str) -> ApiKeyRow | None:
        """Ask the store, one lookup per key at a time (concurrent requests share it; a
        caller that goes away does not cancel it for the others)."""
        pending = self._lookups.get(key_id)
        if pending is None:
            pending = asyncio.ensure_future(self._ask(key_id))
            self._lookups[key_id] = pending
            pending.add_done_callback(lambda done: self._looked_up(key_id, done))
        return await asyncio.shield(pending)

    def _looked_up(self, key_id: str, done: asyncio.Future[ApiKeyRow | None]) -> None:
        if self._lookups.get(key_id) is done:
            del self._lookups[key_id]
        if not done.cancelled():
            done.exception()  # retrieved: every caller may have gone

    async def _ask(self, key_id: str) -> ApiKeyRow | None:
        assert self.keys is not None
        asked = time.monotonic()
        try:
            row = await self.keys.get(key_id)
        except PostgresUnavailable as exc:
            self._failed(exc)
            raise
        if self._failing_since is not None:
            log.warning(
                "the API key store answers again (after %.1f s)",
                time.monotonic() - self._failing_since,
            )
            self._failing_since = None
        _remember(
            self._cache, key_id, None if row is None else _Answer(asked, row), self.max_entries
        )
        _remember(self._unknown, key_id, asked if row is None else None, MAX_UNKNOWN)
        return row

    def _failed(self, exc: PostgresUnavailable) -> None:
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
            log.warning(
                "the API key store is unavailable (%s): serving the last verified answers;"
                " keys not seen before get 503",
                exc,
            )
        self._next_probe = now + self.probe_interval_s

    def _refresh_in_background(self, key_id: str) -> None:
        async def refresh() -> None:
            with contextlib.suppress(PostgresUnavailable):
                await self._lookup(key_id)

        task = asyncio.create_task(refresh(), name=f"auth-refresh-{key_id}")
        self._refreshes.add(task)
        task.add_done_callback(self._refreshed)

    def _refreshed(self, task: asyncio.Task[None]) -> None:
        self._refreshes.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("refreshing a cached API key failed", exc_info=exc)


def _remember(cache: dict[str, T], key: str, value: T | None, most: int) -> None:
    """Put (or, for None, drop) ``key`` at the end of ``cache``, which stays in order of
    asking; the oldest go beyond ``most``."""
    cache.pop(key, None)
    if value is None:
        return
    cache[key] = value
    while len(cache) > most:
        del cache[next(iter(cache))]
