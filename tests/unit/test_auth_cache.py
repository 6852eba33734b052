"""The API key cache's policy when Postgres cannot be asked, over a fake key store.

A verified key keeps working past the cache time, a key the store called unknown or
revoked stays a 401, a key never seen is a 503 with Retry-After, and the first answer
after the outage refreshes as usual. A bug in the store is not an outage. (The real
Postgres, stopped for real: tests/e2e/test_postgres_down.py.)
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from sqlalchemy import exc as sa_exc

from service.api import auth as auth_module
from service.api.auth import Authenticator, TooManyFailures
from service.errors import ServiceUnavailable, Unauthorized
from service.ledger.api_keys import hash_secret
from service.ledger.ledger import PostgresUnavailable, unreachable
from service.ledger.models import ApiKeyRow
from service.settings import Settings
from tests.waiting import eventually

SECRET = "0123456789abcdef"


def key(key_id: str, secret: str = SECRET) -> str:
    return f"Bearer sk-le-{key_id}-{secret}"


def row(key_id: str, *, revoked: bool = False) -> ApiKeyRow:
    return ApiKeyRow(
        id=key_id,
        tenant=f"t-{key_id}",
        secret_hash=hash_secret(SECRET),
        role="user",
        models=None,
        revoked_at=dt.datetime.now(dt.UTC) if revoked else None,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class FakeKeys:
    """``ApiKeys.get`` over a dict; ``down`` makes it raise as the real one does when
    Postgres cannot be asked, ``hold`` makes it wait, ``bug`` raise something else."""

    def __init__(self, rows: dict[str, ApiKeyRow]) -> None:
        self.rows = rows
        self.down = False
        self.bug: Exception | None = None
        self.hold: asyncio.Event | None = None
        self.asked: list[str] = []

    async def get(self, key_id: str) -> ApiKeyRow | None:
        self.asked.append(key_id)
        if self.hold is not None:
            await self.hold.wait()
        if self.bug is not None:
            raise self.bug
        if self.down:
            raise PostgresUnavailable(f"API key {key_id}: ConnectionRefusedError: refused")
        return self.rows.get(key_id)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(auth_module, "time", c)  # the module's clock only, not asyncio's
    return c


@pytest.fixture
def store() -> FakeKeys:
    return FakeKeys({"good": row("good"), "revoked": row("revoked", revoked=True)})


def authenticator(store: FakeKeys, **kw: Any) -> Authenticator:
    kw.setdefault("cache_s", 30.0)
    kw.setdefault("auth", Settings().auth)
    return Authenticator(store, **kw)  # type: ignore[arg-type]


async def code_of(a: Authenticator, header: str, client: str | None = None) -> str:
    try:
        principal = await a.principal(header, client)
    except (Unauthorized, ServiceUnavailable, TooManyFailures) as exc:
        return f"{exc.status_code} {exc.code}"
    return f"ok {principal.tenant}"


async def test_past_the_cache_time_the_last_answers_are_served_while_the_store_is_down(
    clock: Clock, store: FakeKeys
) -> None:
    a = authenticator(store)
    assert await code_of(a, key("good")) == "ok t-good"
    assert await code_of(a, key("revoked")) == "401 invalid_api_key"
    assert await code_of(a, key("nokey")) == "401 invalid_api_key"  # no such key: cached too
    store.down = True
    clock.now += 3600  # far past the cache time
    assert await code_of(a, key("good")) == "ok t-good"
    assert a.store_failing
    clock.now += 3600
    assert await code_of(a, key("good")) == "ok t-good"
    assert await code_of(a, key("good", "x" * 16)) == "401 invalid_api_key"  # wrong secret
    assert await code_of(a, key("revoked")) == "401 invalid_api_key"
    assert await code_of(a, key("nokey")) == "401 invalid_api_key"
    assert await code_of(a, "Bearer garbage") == "401 invalid_api_key"
    with pytest.raises(ServiceUnavailable) as never_seen:
        await a.principal(key("newkey"))
    assert never_seen.value.status_code == 503
    assert never_seen.value.code == "key_store_unavailable"
    assert int(never_seen.value.headers["Retry-After"]) >= 1
    await asyncio.gather(*a._refreshes)


async def test_the_first_answer_after_the_outage_refreshes_as_usual(
    clock: Clock, store: FakeKeys
) -> None:
    a = authenticator(store, probe_interval_s=1.0)
    assert await code_of(a, key("good")) == "ok t-good"
    store.down = True
    clock.now += 31
    assert await code_of(a, key("good")) == "ok t-good"  # stale, the store failed
    assert await code_of(a, key("newkey")) == "503 key_store_unavailable"
    store.down = False
    store.rows["good"] = row("good", revoked=True)  # revoked during the outage
    store.rows["newkey"] = row("newkey")
    clock.now += 1.5  # past the probe interval: the next lookup asks the store again
    assert await code_of(a, key("newkey")) == "ok t-newkey"
    assert not a.store_failing
    assert await code_of(a, key("good")) == "401 invalid_api_key"  # stale: asked, revoked


async def test_while_failing_the_store_is_probed_once_per_interval(
    clock: Clock, store: FakeKeys
) -> None:
    a = authenticator(store, probe_interval_s=5.0)
    assert await code_of(a, key("good")) == "ok t-good"
    store.down = True
    clock.now += 31
    assert await code_of(a, key("good")) == "ok t-good"
    asked = len(store.asked)
    for i in range(20):  # neither a known key nor unknown ones make the store be asked
        assert await code_of(a, key("good")) == "ok t-good"
        assert await code_of(a, key(f"new{i}")) == "503 key_store_unavailable"
    assert len(store.asked) == asked
    clock.now += 5.5
    assert await code_of(a, key("new0")) == "503 key_store_unavailable"  # this one probed
    assert await code_of(a, key("new1")) == "503 key_store_unavailable"  # this one did not
    assert len(store.asked) == asked + 1


async def test_a_cached_key_does_not_wait_for_a_hanging_probe(
    clock: Clock, store: FakeKeys
) -> None:
    a = authenticator(store, probe_interval_s=1.0)
    assert await code_of(a, key("good")) == "ok t-good"
    store.down = True
    clock.now += 31
    assert await code_of(a, key("good")) == "ok t-good"
    store.hold = asyncio.Event()  # half-dead: the next lookup does not come back
    store.down = False
    clock.now += 2
    # the probe runs in the background: this request gets the last answer now
    assert await asyncio.wait_for(code_of(a, key("good")), 5) == "ok t-good"
    assert len(a._refreshes) == 1
    store.hold.set()
    await asyncio.gather(*a._refreshes)
    assert not a.store_failing


async def test_concurrent_requests_for_a_key_share_one_lookup(
    clock: Clock, store: FakeKeys
) -> None:
    a = authenticator(store)
    store.hold = asyncio.Event()
    waiting = [asyncio.create_task(code_of(a, key("good"))) for _ in range(5)]
    await eventually(lambda: store.asked, "the lookup to start")
    waiting[0].cancel()  # a client that goes away cancels nothing for the others
    store.hold.set()
    results = await asyncio.gather(*waiting[1:])
    assert results == ["ok t-good"] * 4
    assert store.asked == ["good"]


async def test_a_bug_in_the_store_is_not_an_outage(clock: Clock, store: FakeKeys) -> None:
    a = authenticator(store)
    assert await code_of(a, key("good")) == "ok t-good"
    clock.now += 31
    store.bug = RuntimeError("a bug")
    with pytest.raises(RuntimeError):
        await a.principal(key("good"))
    assert not a.store_failing


async def test_the_cache_drops_its_oldest_answers_first(clock: Clock, store: FakeKeys) -> None:
    a = authenticator(store, max_entries=3)
    assert await code_of(a, key("good")) == "ok t-good"
    for i in range(3):
        clock.now += 1
        store.rows[f"k{i}"] = row(f"k{i}")
        assert await code_of(a, key(f"k{i}")) == f"ok t-k{i}"
    assert "good" not in a._cache and len(a._cache) == 3


class _Pg(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


def _dbapi(orig: BaseException, *, invalidated: bool = False) -> sa_exc.DBAPIError:
    err = sa_exc.DBAPIError("SELECT 1", {}, orig, connection_invalidated=invalidated)  # type: ignore[arg-type]
    err.__cause__ = orig
    return err


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (ConnectionRefusedError(111, "refused"), True),
        (FileNotFoundError(2, "no socket"), True),  # a unix socket whose server stopped
        (ConnectionResetError(104, "reset"), True),
        (TimeoutError(), True),  # asyncpg's connect timeout, the lookup's bound
        (sa_exc.TimeoutError("QueuePool limit reached"), True),
        (_dbapi(Exception("connection is closed"), invalidated=True), True),
        (_dbapi(_Pg("08003")), True),  # connection does not exist
        (_dbapi(_Pg("57P01")), True),  # admin shutdown
        (_dbapi(_Pg("57P03")), True),  # the database system is starting up
        (_dbapi(_Pg("42601")), False),  # a syntax error is a bug
        (_dbapi(_Pg("3D000")), False),  # no such database: a misconfiguration
        (sa_exc.IntegrityError("INSERT", {}, Exception("dup")), False),
        (ValueError("a bug"), False),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, BaseException) else str(x),
)
def test_what_counts_as_unreachable(exc: BaseException, expected: bool) -> None:
    assert unreachable(exc) is expected


def test_a_bug_raised_while_handling_an_outage_is_a_bug() -> None:
    bug = KeyError("a bug")
    bug.__context__ = ConnectionRefusedError(111, "refused")  # raised in its except block
    assert not unreachable(bug)


async def test_made_up_keys_neither_ask_twice_nor_push_real_keys_out(
    clock: Clock, store: FakeKeys
) -> None:
    a = authenticator(store, max_entries=2)
    assert await code_of(a, key("good")) == "ok t-good"
    for i in range(50):  # a flood of well-formed keys that do not exist
        assert await code_of(a, key(f"madeup{i}")) == "401 invalid_api_key"
    assert await code_of(a, key("madeup7")) == "401 invalid_api_key"
    assert store.asked.count("madeup7") == 1  # remembered: the store is not asked again
    store.down = True  # the real key is still known without the store
    assert await code_of(a, key("good")) == "ok t-good"
    assert store.asked.count("good") == 1


async def test_an_address_that_sent_too_many_bad_keys_is_refused_without_asking(
    clock: Clock, store: FakeKeys
) -> None:
    a = authenticator(store, failures_per_minute=3)
    assert await code_of(a, key("good"), "10.0.0.1") == "ok t-good"
    for i in range(3):
        assert await code_of(a, key(f"guess{i}"), "10.0.0.1") == "401 invalid_api_key"
    asked = len(store.asked)
    assert await code_of(a, key("guess9"), "10.0.0.1") == "429 too_many_auth_failures"
    assert await code_of(a, key("good", "y" * 16), "10.0.0.1") == "429 too_many_auth_failures"
    assert len(store.asked) == asked  # refused before any lookup
    # a key the cache knows still works from there (an office behind one address)...
    assert await code_of(a, key("good"), "10.0.0.1") == "ok t-good"
    # ... another address is not affected, and the minute passes
    assert await code_of(a, key("guess0"), "10.0.0.2") == "401 invalid_api_key"
    clock.now += 61
    assert await code_of(a, key("guess0"), "10.0.0.1") == "401 invalid_api_key"
    # a missing key costs nothing and is not counted
    b = authenticator(store, failures_per_minute=1)
    for _ in range(3):
        assert await code_of(b, "", "10.0.0.3") == "401 missing_api_key"
