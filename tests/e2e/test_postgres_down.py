"""Postgres down for real: the API keeps serving the keys it has verified, and says 503
(never 500, never a 404 that would be a lie) for what it cannot know.

This module has its own Postgres (embedded, on a unix socket in a temporary
directory), stopped and frozen for real; the shared one is never touched. The first
tests ask a real driver against a refused port and a server that never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from httpx_sse import EventSource
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from service.api.auth import Authenticator
from service.cli.embedded import EmbeddedPostgres
from service.errors import ServiceUnavailable
from service.ledger.api_keys import ApiKeys
from service.ledger.ledger import Ledger, PostgresUnavailable, make_engine
from service.ledger.migrate import upgrade
from service.settings import Settings
from service.store.keys import Keys
from tests.e2e.conftest import Stack, free_port, running
from tests.e2e.helpers import chat_body, content_of, finish_reason, ledger_row
from tests.waiting import wait_until

CACHE_S = 1.0
SAFETY_S = 60.0  # every HTTP call's timeout: a safety net, not a measurement


# -- a real driver against a server that is not there, or does not answer ------------


@contextlib.contextmanager
def black_hole() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word (a half-dead server)."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield int(server.getsockname()[1])
    finally:
        server.close()
        for s in held:
            s.close()


async def _lookups_fail_as_unavailable(url: str) -> None:
    engine = make_engine(url, connect_timeout_s=0.5, pool_timeout_s=0.5)
    try:
        with pytest.raises(PostgresUnavailable):
            await ApiKeys(engine).get("somekey")
        ledger = Ledger(engine)
        with pytest.raises(PostgresUnavailable):
            await ledger.get("chatcmpl-" + "0" * 32)
        with pytest.raises(PostgresUnavailable):
            await ledger.archived("chatcmpl-" + "0" * 32)
        auth = Authenticator(ApiKeys(engine), auth=Settings().auth, cache_s=CACHE_S)
        with pytest.raises(ServiceUnavailable) as unavailable:
            await auth.principal("Bearer sk-le-somekey-0123456789abcdef")
        assert unavailable.value.code == "key_store_unavailable"
        assert "Retry-After" in unavailable.value.headers
    finally:
        await engine.dispose()


def test_a_refused_connection_is_unavailable() -> None:
    asyncio.run(
        _lookups_fail_as_unavailable(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/x")
    )


def test_a_server_that_never_answers_is_unavailable_after_the_connect_timeout() -> None:
    with black_hole() as port:
        asyncio.run(
            _lookups_fail_as_unavailable(f"postgresql+asyncpg://postgres@127.0.0.1:{port}/x")
        )


# -- the stack, on a Postgres of its own ------------------------------------------------


@pytest.fixture(scope="module")
def pg(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(tmp_path_factory.mktemp("pgdown"))
    try:
        upgrade(server.start())
        yield server
    finally:
        with contextlib.suppress(psutil.Error):
            for p in postgres_processes(server):
                p.resume()
        server.stop()


@pytest.fixture(scope="module")
def db_url(pg: EmbeddedPostgres) -> str:
    assert pg.url is not None
    return pg.url


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, db_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("pgdown-stack"),
        redis_url,
        db_url,
        model_dir,
        auth="required",
        auth_cache_s=CACHE_S,
    ) as st:
        yield st


def postgres_processes(pg: EmbeddedPostgres) -> list[psutil.Process]:
    assert pg.pid is not None
    postmaster = psutil.Process(pg.pid)
    return [postmaster, *postmaster.children(recursive=True)]


def sql(db_url: str, statement: str, **params: Any) -> None:
    async def run() -> None:
        engine = create_async_engine(db_url)
        try:
            async with engine.begin() as conn:
                await conn.execute(text(statement), params)
        finally:
            await engine.dispose()

    asyncio.run(run())


def make_key(db_url: str, tenant: str) -> str:
    async def create() -> str:
        engine = create_async_engine(db_url)
        try:
            return await ApiKeys(engine).create(tenant)
        finally:
            await engine.dispose()

    return asyncio.run(create())


def never_created_key() -> str:
    return f"sk-le-{secrets.token_hex(6)}-{secrets.token_hex(16)}"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(client: httpx.Client, st: Stack, key: str) -> tuple[int, str, dict[str, Any]]:
    """A streamed chat completion: (status, the streamed text, the error body if any).
    A 200's stream must be whole: it ends with a finish reason and ``[DONE]``."""
    body = chat_body(st.model, "hello there", stream=True, max_tokens=8)
    with client.stream("POST", "/v1/chat/completions", json=body, headers=auth(key)) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, "", r.json()
        events = list(EventSource(r).iter_sse())
    assert events and events[-1].data == "[DONE]", events[-3:]
    assert finish_reason(events) in ("stop", "length"), events[-3:]
    return 200, content_of(events), {}


def postgres_check(client: httpx.Client) -> str:
    resp = client.get("/readyz")
    return str(resp.json()["checks"]["postgres"])


def key_use_lapsed(used_at: float) -> bool:
    """Every answer cached at or before ``used_at`` (a monotonic time: the API's clock
    too) is past the cache time now."""
    return time.monotonic() - used_at > CACHE_S


def first_not_503(client: httpx.Client, st: Stack, key: str) -> tuple[int, str, dict[str, Any]]:
    """What a client that honours Retry-After gets once Postgres answers again."""
    outcome: list[tuple[int, str, dict[str, Any]]] = []

    def answered() -> bool:
        outcome[:] = [complete(client, st, key)]
        return outcome[0][0] != 503

    wait_until(answered, "the key store to answer again", timeout=SAFETY_S, interval=0.2)
    return outcome[0]


def forget_hot_log(st: Stack, rid: str) -> None:
    """The hot log has expired: what the API knows of the request is in the ledger."""
    keys = Keys(st.settings.key_prefix, st.settings.partitions)
    hot = st.store()
    try:
        hot.delete(keys.log(rid), keys.meta(rid), keys.readers(rid))
    finally:
        hot.close()


def assert_503(resp: httpx.Response, code: str) -> None:
    assert resp.status_code == 503, resp.text
    assert int(resp.headers["retry-after"]) >= 1
    error = resp.json()["error"]
    assert error["code"] == code and error["type"] == "service_unavailable"


def test_verified_keys_outlive_a_stopped_postgres(
    stack: Stack, pg: EmbeddedPostgres, db_url: str
) -> None:
    known = make_key(db_url, "acme")
    revoked = make_key(db_url, "acme")
    sql(
        db_url,
        "UPDATE api_keys SET revoked_at = now() WHERE id = :id",
        id=revoked.split("-")[2],
    )
    unknown = never_created_key()  # asked before the outage: "no such key"
    never_seen = never_created_key()  # first seen during the outage
    with httpx.Client(base_url=stack.url, timeout=SAFETY_S) as client:
        status, text_before, _ = complete(client, stack, known)
        assert status == 200 and text_before
        for bad in (revoked, unknown):
            resp = client.post(
                "/v1/chat/completions", json=chat_body(stack.model, "x"), headers=auth(bad)
            )
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        done = client.post(
            "/v1/chat/completions",
            json=chat_body(stack.model, "hi", max_tokens=4),
            headers=auth(known),
        )
        assert done.status_code == 200
        rid = done.json()["id"]
        used_at = time.monotonic()  # every key above was verified (and cached) before now
        assert ledger_row(db_url, rid) is not None, "the recorder did not record the request"
        forget_hot_log(stack, rid)
        from_ledger = client.get(f"/v1/requests/{rid}", headers=auth(known))
        assert from_ledger.status_code == 200 and from_ledger.json()["state"] == "finished"

        pg.stop()
        try:
            wait_until(
                lambda: postgres_check(client).startswith("error"),
                "/readyz to report postgres down",
                timeout=SAFETY_S,
            )
            wait_until(lambda: key_use_lapsed(used_at), "the cache time to pass", timeout=SAFETY_S)

            # the verified key keeps working, and its stream is whole
            status, text_during, error = complete(client, stack, known)
            assert status == 200, error
            assert text_during
            # what the store said stays said: revoked, unknown and wrong secrets stay 401
            for bad in (revoked, unknown, known[:-1] + ("x" if known[-1] != "x" else "y")):
                resp = client.post(
                    "/v1/chat/completions", json=chat_body(stack.model, "x"), headers=auth(bad)
                )
                assert resp.status_code == 401, resp.text
                assert resp.json()["error"]["code"] == "invalid_api_key"
            garbage = client.post(
                "/v1/chat/completions", json=chat_body(stack.model, "x"), headers=auth("nonsense")
            )
            assert garbage.status_code == 401
            assert garbage.json()["error"]["code"] == "invalid_api_key"
            # a key never seen cannot be known now: 503, try again later
            assert_503(
                client.post(
                    "/v1/chat/completions",
                    json=chat_body(stack.model, "x"),
                    headers=auth(never_seen),
                ),
                "key_store_unavailable",
            )
            # the hot log is gone and the ledger cannot be asked: not a 404, not a 500
            assert_503(client.get(f"/v1/requests/{rid}", headers=auth(known)), "ledger_unavailable")
            assert "the API key store is unavailable" in stack.tail(
                f"api-{stack.url.rsplit(':', 1)[1]}", 1_000_000
            )
        finally:
            pg.start()

        wait_until(lambda: postgres_check(client) == "ok", "postgres back", timeout=SAFETY_S)
        later = make_key(db_url, "acme")
        status, text_after, error = first_not_503(client, stack, later)
        assert status == 200, error
        assert text_after
        resp = client.post(
            "/v1/chat/completions", json=chat_body(stack.model, "x"), headers=auth(never_seen)
        )
        assert resp.status_code == 401  # the store answers again: it has no such key
        assert complete(client, stack, known)[0] == 200
        back = client.get(f"/v1/requests/{rid}", headers=auth(known))
        assert back.status_code == 200 and back.json()["state"] == "finished"


def test_the_archive_fallback_is_503_while_postgres_is_down(
    stack: Stack, pg: EmbeddedPostgres, db_url: str
) -> None:
    known = make_key(db_url, "acme")
    with httpx.Client(base_url=stack.url, timeout=SAFETY_S) as client:
        done = client.post(
            "/v1/chat/completions",
            json=chat_body(stack.model, "hi", max_tokens=4),
            headers=auth(known),
        )
        assert done.status_code == 200
        rid = done.json()["id"]
        assert ledger_row(db_url, rid) is not None
        forget_hot_log(stack, rid)
        assert client.get(f"/v1/requests/{rid}/events", headers=auth(known)).status_code == 200
        pg.stop()
        try:
            wait_until(
                lambda: postgres_check(client).startswith("error"),
                "/readyz to report postgres down",
                timeout=SAFETY_S,
            )
            events = client.get(f"/v1/requests/{rid}/events", headers=auth(known))
        finally:
            pg.start()
        wait_until(lambda: postgres_check(client) == "ok", "postgres back", timeout=SAFETY_S)
    assert_503(events, "ledger_unavailable")


def test_a_frozen_postgres_costs_a_bounded_wait_not_a_hang(
    stack: Stack, pg: EmbeddedPostgres, db_url: str
) -> None:
    """Every Postgres process stopped (SIGSTOP): connections are accepted by the kernel
    and pooled ones stay open, but nothing answers -- the half-dead server."""
    known = make_key(db_url, "acme")
    never_seen = never_created_key()
    with httpx.Client(base_url=stack.url, timeout=SAFETY_S) as client:
        assert complete(client, stack, known)[0] == 200
        used_at = time.monotonic()
        frozen = postgres_processes(pg)
        for p in frozen:
            p.suspend()
        try:
            wait_until(lambda: key_use_lapsed(used_at), "the cache time to pass", timeout=SAFETY_S)
            status, text_during, error = complete(client, stack, known)
            assert status == 200, error
            assert text_during
            assert_503(
                client.post(
                    "/v1/chat/completions",
                    json=chat_body(stack.model, "x"),
                    headers=auth(never_seen),
                ),
                "key_store_unavailable",
            )
            assert complete(client, stack, known)[0] == 200
        finally:
            for p in frozen:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.resume()
        later = make_key(db_url, "acme")
        status, _, error = first_not_503(client, stack, later)
        assert status == 200, error
