"""Billing you can reconcile, streams operators can replay -- processes killed for real.

This module has its own database, so `lastevent billing reconcile` sees only its rows.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import csv
import io
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from service.store.keys import Keys
from service.stream.ids import Cursor
from tests.conftest import migrated_database
from tests.e2e.conftest import Stack, free_port, make_stack
from tests.e2e.helpers import LONG, chat_body, raw_events
from tests.waiting import wait_until

OPERATOR = "op-secret"


class FlakyProxy:
    """A TCP proxy to Postgres that refuses connections while ``down``."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.down = False
        self.refused = 0  # connections turned away while down
        self.port = free_port()
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            if self.down:
                client.close()
                self.refused += 1
                continue
            upstream = socket.create_connection(self.target)
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.close()

    def set_down(self) -> None:
        self.down = True
        for c in self._conns:  # cut what is open, like a stopped server
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        self._conns.clear()

    def close(self) -> None:
        self._server.close()


@pytest.fixture(scope="module")
def billing_db(pg_admin_url: str) -> Iterator[str]:
    with migrated_database(pg_admin_url) as url:
        yield url


@pytest.fixture(scope="module")
def proxy(billing_db: str) -> Iterator[FlakyProxy]:
    from sqlalchemy.engine import make_url

    u = make_url(billing_db)
    p = FlakyProxy((u.host or "127.0.0.1", u.port or 5432))
    yield p
    p.close()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    billing_db: str,
    model_dir: Path,
    proxy: FlakyProxy,
) -> Iterator[Stack]:
    from sqlalchemy.engine import make_url

    st = make_stack(
        tmp_path_factory.mktemp("billing"),
        redis_url,
        billing_db,
        model_dir,
        worker_concurrency=16,
        operator_token=OPERATOR,
        hot_log_ttl_s=600,
    )
    via_proxy = (
        make_url(billing_db)
        .set(host="127.0.0.1", port=proxy.port)
        .render_as_string(hide_password=False)
    )
    try:
        st.start_worker(database_url=via_proxy, recorder_claim_idle_ms=1000)
        st.start_api()
        yield st
    finally:
        st.stop()


def sql(url: str, query: str, **params: Any) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        engine = create_async_engine(url)
        try:
            async with engine.begin() as conn:
                result = await conn.execute(text(query), params)
                return [dict(r) for r in result.mappings()] if result.returns_rows else []
        finally:
            await engine.dispose()

    return asyncio.run(run())


def rows_for(url: str, rids: list[str]) -> list[dict[str, Any]]:
    return sql(url, "SELECT * FROM requests WHERE id = ANY(:ids)", ids=rids)


def wait_rows(url: str, rids: list[str], timeout_s: float = 60) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = rows_for(url, rids)
        if len(rows) >= len(rids):
            return rows
        time.sleep(0.2)
    return rows_for(url, rids)


def cli(
    stack: Stack, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, **stack.settings.to_env(), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def _complete_many(url: str, model: str, n: int) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        sem = asyncio.Semaphore(16)

        async def one(i: int) -> dict[str, Any]:
            async with sem:
                r = await client.post(
                    "/v1/chat/completions", json=chat_body(model, f"request {i}: é€ 🤖")
                )
                return r.json()

        return await asyncio.gather(*(one(i) for i in range(n)))


def test_postgres_down_while_100_requests_finish(
    stack: Stack, proxy: FlakyProxy, billing_db: str
) -> None:
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() - 1))
    proxy.set_down()
    try:
        answers = asyncio.run(_complete_many(stack.url, stack.model, 100))  # streaming unaffected
        rids = [a["id"] for a in answers]
        # the recorder tried the ledger again since (it retries with a backoff of <= 5 s)
        tried = proxy.refused
        wait_until(lambda: proxy.refused > tried, "the recorder to retry the ledger", timeout=60)
        assert rows_for(billing_db, rids) == []  # nothing could be written yet
    finally:
        proxy.down = False
    rows = wait_rows(billing_db, rids)
    assert len(rows) == 100 and len({r["id"] for r in rows}) == 100
    by_id = {r["id"]: r for r in rows}
    for a in answers:
        row = by_id[a["id"]]
        assert (row["prompt_tokens"], row["completion_tokens"], row["total_tokens"]) == (
            a["usage"]["prompt_tokens"],
            a["usage"]["completion_tokens"],
            a["usage"]["total_tokens"],
        )
        assert row["state"] == "finished" and row["dispatched_at"] is not None
    done = cli(stack, "billing", "reconcile", "--since", since)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "checked 100 terminal events" in done.stdout and "clean" in done.stdout


def test_recorder_killed_between_insert_and_ack(stack: Stack, billing_db: str) -> None:
    # a second prefix: a worker with no recorder, and recorders we kill and restart
    own = make_stack(
        stack.logs.parent / "kill",
        stack.settings.redis_url or "",
        billing_db,
        Path(stack.settings.model_dir or ""),
        recorder_in_worker=False,
    )
    try:
        own.start_worker()
        own.start_api()
        answers = asyncio.run(_complete_many(own.url, own.model, 5))
        rids = [a["id"] for a in answers]
        crashing = own._spawn(
            "recorder", "recorder-crash", worker_id="rec-a", recorder_crash_after_insert=True
        )
        assert crashing.wait(timeout=60) == 17  # it committed a row, then died before the ack
        # (one per partition at most: each partition's outbox has its own loop)
        assert 1 <= len(rows_for(billing_db, rids)) <= own.settings.partitions
        healthy = own._spawn(
            "recorder", "recorder-ok", worker_id="rec-b", recorder_claim_idle_ms=500
        )
        rows = wait_rows(billing_db, rids, timeout_s=30)
        assert sorted(r["id"] for r in rows) == sorted(rids)  # exactly one row each
        healthy.terminate()
        healthy.wait(timeout=10)
    finally:
        own.stop()


def test_same_terminal_event_twice_is_one_row(stack: Stack, billing_db: str) -> None:
    from service.ledger.ledger import Ledger
    from service.stream.events import Summary

    summary = Summary(
        request_id=f"chatcmpl-dup{time.time_ns()}",
        kind="chat",
        model="m",
        created_ms=int(time.time() * 1000),
        state="finished",
        finish_reason="stop",
        prompt_tokens=3,
        completion_tokens=4,
    )

    async def twice() -> list[bool]:
        engine = create_async_engine(billing_db)
        try:
            ledger = Ledger(engine)
            end_id = f"{int(time.time() * 1000)}-0"
            return [await ledger.record(summary, end_id), await ledger.record(summary, end_id)]
        finally:
            await engine.dispose()

    assert asyncio.run(twice()) == [True, False]
    assert len(rows_for(billing_db, [summary.request_id])) == 1


def test_resume_from_the_archive_after_the_hot_log_expired(
    tmp_path: Path, stack: Stack, billing_db: str
) -> None:
    short = make_stack(
        tmp_path,
        stack.settings.redis_url or "",
        billing_db,
        Path(stack.settings.model_dir or ""),
        hot_log_ttl_s=2,
    )
    try:
        short.start_worker()
        short.start_api()
        with httpx.Client(base_url=short.url, timeout=30) as client:
            rid, live = raw_events(
                client,
                "POST",
                "/v1/chat/completions",
                json=chat_body(short.model, LONG, stream=True),
            )
            ids = [
                line.split(b": ", 1)[1].decode()
                for line in live.split(b"\n")
                if line.startswith(b"id: ")
            ]
            middle = ids[len(ids) // 2]
            _, hot_rest = raw_events(
                client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": middle}
            )
            assert len(wait_rows(billing_db, [rid])) == 1  # archived
            hot = short.store()
            log_key = Keys(short.settings.key_prefix).log(rid)
            try:  # the hot log's TTL (2 s) runs out: what follows is read from the archive
                wait_until(lambda: not hot.exists(log_key), "the hot log to expire", timeout=60)
            finally:
                hot.close()
            _, cold_rest = raw_events(
                client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": middle}
            )
            _, cold_all = raw_events(client, "GET", f"/v1/requests/{rid}/events")
            bad = client.get(f"/v1/requests/{rid}/events", headers={"Last-Event-ID": "1-0"})
        assert cold_rest == hot_rest and len(cold_rest) > 100
        assert cold_all == live
        assert bad.status_code == 400
    finally:
        short.stop()


def test_replay_byte_for_byte_with_timing(stack: Stack, billing_db: str) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        rid, live = raw_events(
            client,
            "POST",
            "/v1/chat/completions",
            json=chat_body(
                stack.model, LONG[:120], stream=True, stream_options={"include_usage": True}
            ),
        )
        # cancelled mid-way: a second request, cancelled after a few events
        with client.stream(
            "POST", "/v1/chat/completions", json=chat_body(stack.model, LONG, stream=True)
        ) as r:
            cancelled = r.headers["x-request-id"]
            for i, _ in enumerate(r.iter_lines()):
                if i == 12:
                    break
        assert client.post(f"/v1/requests/{cancelled}/cancel").json()["state"] == "cancelled"
        _, cancelled_live = raw_events(client, "GET", f"/v1/requests/{cancelled}/events")
    for request_id, expected in ((rid, live), (cancelled, cancelled_live)):
        out = cli(stack, "replay", request_id, "--speed", "max")
        assert out.returncode == 0, out.stderr
        assert out.stdout.encode() == expected
    timed = cli(stack, "replay", rid, "--speed", "1", "--format", "text")
    assert timed.stdout == LONG[:120]
    # at speed 1 each event goes out no earlier than its original offset from the first
    # (the replay sleeps the gaps between the ids' milliseconds): measured from before the
    # request, a lower bound that a slow machine cannot break; no upper bound
    chunks: list[tuple[float, bytes]] = []
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        requested_at = time.monotonic()
        with client.stream(
            "GET",
            f"/v1/admin/requests/{rid}/replay",
            params={"speed": "1"},
            headers={"Authorization": f"Bearer {OPERATOR}"},
        ) as r:
            chunks += [(time.monotonic(), chunk) for chunk in r.iter_raw()]
    replayed = b"".join(chunk for _, chunk in chunks)
    assert replayed == live  # same frames, same ids, same order
    ends, total = [], 0  # where each chunk ends in the body
    for _, chunk in chunks:
        total += len(chunk)
        ends.append(total)
    offsets = []  # (original offset, replay offset) of each frame with an id
    first_ms = None
    for match in re.finditer(rb"^id: ([^\n]*)\n", replayed, flags=re.M):
        ms = Cursor.parse(match[1].decode()).event.ms
        first_ms = ms if first_ms is None else first_ms
        arrived = chunks[bisect.bisect_right(ends, match.start())][0]  # its first byte's chunk
        offsets.append(((ms - first_ms) / 1000, arrived - requested_at))
    assert len(offsets) == len(re.findall(rb"^id: ", live, flags=re.M)) > 2
    span = offsets[-1][0]
    assert span > 0  # the original took time: the bound below says something
    late = [(orig, got) for orig, got in offsets if got < orig - 0.002]
    assert not late, f"frames sent before their original offset (s): {late}"
    print(
        f"\nreplay at speed 1: original span {span:.3f} s, replay span "
        f"{offsets[-1][1] - offsets[0][1]:.3f} s over {len(chunks)} chunks"
    )
    # the operator route: same bytes (for the operator token; with no key this stack,
    # whose auth is off, takes the caller for tenant ``default``: the request's own)
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        own = client.get(f"/v1/admin/requests/{rid}/replay")
        assert own.status_code == 200 and own.content == live
        ok = client.get(
            f"/v1/admin/requests/{rid}/replay", headers={"Authorization": f"Bearer {OPERATOR}"}
        )
        assert ok.content == live


def test_replay_of_an_errored_request(tmp_path: Path, stack: Stack, billing_db: str) -> None:
    faulty = make_stack(
        tmp_path,
        stack.settings.redis_url or "",
        billing_db,
        Path(stack.settings.model_dir or ""),
        scripted_fail_after=4,
    )
    try:
        faulty.start_worker()
        faulty.start_api()
        with httpx.Client(base_url=faulty.url, timeout=30) as client:
            rid, live = raw_events(
                client,
                "POST",
                "/v1/chat/completions",
                json=chat_body(faulty.model, LONG, stream=True),
            )
        assert b'"error"' in live
        out = cli(faulty, "replay", rid)
        assert out.stdout.encode() == live
    finally:
        faulty.stop()


def test_reconcile_detects_deleted_and_tampered_rows(stack: Stack, billing_db: str) -> None:
    time.sleep(1.1)  # a window that holds only this test's requests (whole seconds)
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time()))
    answers = asyncio.run(_complete_many(stack.url, stack.model, 3))
    rids = [a["id"] for a in answers]
    wait_rows(billing_db, rids)
    clean = cli(stack, "billing", "reconcile", "--since", since)
    assert clean.returncode == 0, clean.stdout
    sql(billing_db, "DELETE FROM requests WHERE id = :id", id=rids[0])
    sql(
        billing_db,
        "UPDATE requests SET completion_tokens = completion_tokens + 1 WHERE id = :id",
        id=rids[1],
    )
    report = cli(stack, "billing", "reconcile", "--since", since)
    assert report.returncode == 1
    assert f"MISSING row for {rids[0]}" in report.stdout
    assert f"MISMATCH {rids[1]}: completion_tokens" in report.stdout
    export = cli(stack, "billing", "export", "--since", since)
    assert export.returncode == 0
    assert export.stdout.splitlines()[0].startswith("tenant,model,requests")
    assert "default,SmolLM2-135M-Instruct" in export.stdout


def test_cli_export_quotes_what_a_spreadsheet_would_run(stack: Stack, billing_db: str) -> None:
    """A tenant or model name that starts like a formula is written as text (``'=...``)
    by ``lastevent billing export`` as by the console's CSV: the CLI wrote it bare."""
    time.sleep(1.1)  # a window that holds only this test's requests (whole seconds)
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time()))
    rids = [a["id"] for a in asyncio.run(_complete_many(stack.url, stack.model, 2))]
    wait_rows(billing_db, rids)
    names = [("=HYPERLINK(1)", "@SUM(A1)"), ("+1", "-2")]
    for rid, (tenant, model) in zip(rids, names, strict=True):
        sql(
            billing_db,
            "UPDATE requests SET tenant = :t, model = :m WHERE id = :id",
            t=tenant,
            m=model,
            id=rid,
        )
    export = cli(stack, "billing", "export", "--since", since)
    assert export.returncode == 0, export.stderr
    table = list(csv.DictReader(io.StringIO(export.stdout)))
    assert sorted((r["tenant"], r["model"]) for r in table) == sorted(
        (f"'{t}", f"'{m}") for t, m in names
    )
