"""Takeover: a dead or frozen worker's answers continue on another worker, and a rolling
restart drops nothing -- real processes, killed, frozen and stopped for real.

The scripted engine echoes the question token by token (temperature 0 in effect), so an
uninterrupted answer is the question itself: every client's text must equal it exactly
(no gap, no repeat, no broken character), whatever worker wrote which part. The pause a
client sees is a figure of ``bench/takeover.py``, not an assertion here.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from httpx_sse import EventSource, ServerSentEvent

from service.store.keys import Keys
from service.stream import events as ev
from tests.conftest import migrated_database
from tests.e2e.conftest import Stack, make_stack
from tests.e2e.helpers import (
    LONG,
    assert_ids_increase,
    chat_body,
    content_of,
    finish_reason,
    ledger_row,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

SAFETY_S = 120.0  # a hang guard only


@pytest.fixture(scope="module")
def takeover_db(pg_admin_url: str) -> Iterator[str]:
    """A database of this module's own, so that reconcile sees only its rows."""
    with migrated_database(pg_admin_url) as url:
        yield url


@contextlib.contextmanager
def takeover_stack(
    tmp_path: Path, redis_url: str, db: str, model_dir: Path, stale_s: float
) -> Iterator[Stack]:
    st = make_stack(
        tmp_path,
        redis_url,
        db,
        model_dir,
        scripted_tokens_per_s=40.0,
        worker_stale_s=stale_s,
        worker_concurrency=32,
        recorder_claim_idle_ms=1000,  # a killed worker's recorder entries are taken soon
    )
    try:
        yield st
    finally:
        for p in st.procs:  # frozen ones would not stop
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        st.stop()


@pytest.fixture
def stack(tmp_path: Path, redis_url: str, takeover_db: str, model_dir: Path) -> Iterator[Stack]:
    # beats come every 1 s: a busy live worker is never taken for lost
    with takeover_stack(tmp_path, redis_url, takeover_db, model_dir, 2.0) as st:
        yield st


@pytest.fixture
def no_heartbeat(
    tmp_path: Path, redis_url: str, takeover_db: str, model_dir: Path
) -> Iterator[Stack]:
    """A stack whose heartbeats go stale after 10 min: only a connection can tell."""
    with takeover_stack(tmp_path, redis_url, takeover_db, model_dir, 600.0) as st:
        yield st


@dataclasses.dataclass
class Stream:
    """One streaming client in a thread: its events, its request id."""

    question: str
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    events: list[ServerSentEvent] = dataclasses.field(default_factory=list)
    request_id: str = ""
    started: threading.Event = dataclasses.field(default_factory=threading.Event)

    def run(self, url: str, model: str) -> None:
        body = chat_body(model, self.question, stream=True, **self.extra)
        with (
            httpx.Client(base_url=url, timeout=SAFETY_S) as client,
            client.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200, r.read()
            self.request_id = r.headers["x-request-id"]
            for event in EventSource(r).iter_sse():
                self.events.append(event)
                if len(self.events) >= 3:
                    self.started.set()
        self.started.set()

    @property
    def text(self) -> str:
        return content_of(self.events)


@dataclasses.dataclass
class Clients:
    st: Stack
    streams: list[Stream]
    pool: concurrent.futures.ThreadPoolExecutor
    futures: list[concurrent.futures.Future[None]]

    def wait_started(self) -> None:
        for s in self.streams:
            assert s.started.wait(SAFETY_S), "a stream never started"

    def join(self) -> None:
        for f in self.futures:
            f.result(timeout=SAFETY_S)
        self.pool.shutdown()


def start_streams(st: Stack, streams: list[Stream]) -> Clients:
    pool = concurrent.futures.ThreadPoolExecutor(len(streams))
    futures = [pool.submit(s.run, st.url, st.model) for s in streams]
    return Clients(st, streams, pool, futures)


def store(st: Stack) -> redis.Redis:
    return st.store()


def owner_of(st: Stack, rid: str) -> str:
    raw = store(st).hget(Keys(st.settings.key_prefix, st.settings.partitions).meta(rid), "owner")
    return raw.decode() if raw else ""


def logged_text(st: Stack, rid: str) -> str:
    entries = store(st).xrange(Keys(st.settings.key_prefix, st.settings.partitions).log(rid))
    found = (ev.decode(fields[b"e"]) for _, fields in entries)
    return "".join(e.text for e in found if isinstance(e, ev.Delta))


def claims(st: Stack, rid: str) -> list[tuple[str, str]]:
    """The log's claim marks: (worker, how) on the first delta each worker appended."""
    entries = store(st).xrange(Keys(st.settings.key_prefix, st.settings.partitions).log(rid))
    found = (ev.decode(fields[b"e"]) for _, fields in entries)
    return [(e.by, e.how or "") for e in found if isinstance(e, ev.Delta) and e.by is not None]


def proc_named(st: Stack, procs: dict[str, subprocess.Popen[bytes]], owner: str) -> str:
    [name] = [n for n in procs if owner.startswith(f"{n}-")]
    return name


def freeze_when(
    st: Stack, proc: subprocess.Popen[bytes], rid: str, ready: Callable[[str], bool]
) -> str:
    """SIGSTOP ``proc`` at a moment its log's text satisfies ``ready`` (freeze, look, let
    it go on and try again); returns the logged text it was frozen at."""
    deadline = time.monotonic() + SAFETY_S
    while time.monotonic() < deadline:
        os.kill(proc.pid, signal.SIGSTOP)
        shown = logged_text(st, rid)
        if ready(shown):
            return shown
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError("the log never reached the wanted cut")


def assert_whole(
    st: Stack, s: Stream, want: str, takeovers: int, handovers: int = 0, finish: str = "stop"
) -> None:
    assert s.text == want, f"{s.request_id}: text differs from an uninterrupted run"
    assert "\ufffd" not in s.text
    assert s.events[-1].data == "[DONE]"
    assert finish_reason(s.events) == finish
    assert_ids_increase(s.events)
    status = httpx.get(f"{st.url}/v1/requests/{s.request_id}").json()
    assert status["state"] == "finished", status
    row = ledger_row(st.settings.database_url or "", s.request_id, timeout_s=60)
    assert row is not None and row["state"] == "finished"
    assert (row["takeovers"], row["handovers"]) == (takeovers, handovers), row
    if takeovers or handovers:
        assert row["reprefill_tokens"] > row["prompt_tokens"], row
    # where a worker died or stopped and another continued: the console's marks
    marks = claims(st, s.request_id)
    hows = [how for _, how in marks]
    for how, times in (("takeover", takeovers), ("handover", handovers)):
        # at most one mark a time (none for a worker lost before its first delta)
        assert (1 <= hows.count(how) <= times) if times else how not in hows, marks
    if not (takeovers or handovers):
        assert hows == ["first"], marks
    elif hows[0] == "first":  # the first worker wrote something: another continued
        assert marks[0][0] != marks[-1][0], marks
    # a reader that comes later reads the same answer from the log, once
    replay = httpx.get(f"{st.url}/v1/requests/{s.request_id}/events", timeout=30).text
    assert replay.count("data: [DONE]") == 1


def reconcile_clean(st: Stack, since: str) -> None:
    """``lastevent billing reconcile`` over this test's requests (``since`` its start)."""
    env = {**os.environ, **st.settings.to_env()}
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "billing", "reconcile", "--since", since],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "clean" in done.stdout, done.stdout + done.stderr


def now() -> str:
    return datetime.now(UTC).isoformat()


def questions(n: int, body: str = LONG) -> list[str]:
    return [f"Question {i}. {body}" for i in range(n)]


def named_connections(st: Stack) -> list[tuple[redis.Redis, dict[str, Any]]]:
    """Every client connection of the stack's Redis (each cluster node's) with its node's
    client."""
    client = store(st)
    if isinstance(client, redis.RedisCluster):
        nodes = [client.get_redis_connection(n) for n in client.get_nodes()]
    else:
        nodes = [client]
    return [(node, c) for node in nodes for c in node.client_list()]


def kill_connection(st: Stack, worker_id: str) -> None:
    """``CLIENT KILL`` the worker's named connection (``lastevent-worker-<id>``)."""
    found = [
        (n, c) for n, c in named_connections(st) if c["name"] == f"lastevent-worker-{worker_id}"
    ]
    assert len(found) == 1, found
    [(node, conn)] = found
    assert node.client_kill_filter(_id=conn["id"]) == 1


def test_a_killed_workers_streams_continue_on_the_other(no_heartbeat: Stack) -> None:
    """kill -9: the kernel closes its connections, and the API processes take its requests
    over then -- long before its heartbeat (here: 10 min) could go stale."""
    st, since = no_heartbeat, now()
    procs = {"a": st.start_worker("a"), "b": st.start_worker("b")}
    st.start_api()
    st.start_api()  # two sweepers: one moves each job
    seen_connected(st, 2)
    clients = start_streams(st, [Stream(q) for q in questions(6)])
    clients.wait_started()
    owners = {s.request_id: owner_of(st, s.request_id) for s in clients.streams}
    victim = proc_named(st, procs, owners[clients.streams[0].request_id])
    procs[victim].send_signal(signal.SIGKILL)
    procs[victim].wait()
    clients.join()
    for s in clients.streams:
        lost = owners[s.request_id].startswith(f"{victim}-")
        assert_whole(st, s, s.question, takeovers=int(lost))
    logs = api_logs(st)
    assert f"worker {victim}-" in logs and "its connection is gone" in logs
    assert "its heartbeat is stale" not in logs
    reconcile_clean(st, since)


def api_logs(st: Stack) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(st.logs.glob("api-*.log")))


def seen_connected(st: Stack, n: int) -> None:
    """Wait until every API process's watch has seen ``n`` workers' named connections (a
    worker it never saw is left to its heartbeat: one that dies before is not judged)."""

    def seen() -> bool:
        wanted = f"lastevent_workers_connected {float(n)}"
        return all(wanted in httpx.get(f"{url}/metrics").text for url in st.api_urls)

    wait_until(seen, f"every API process to see {n} workers' connections")


def named_connections_of(st: Stack) -> list[str]:
    """The named connections of this stack's workers (other tests' stacks share Redis)."""
    keys = Keys(st.settings.key_prefix, st.settings.partitions)
    ours = {f"lastevent-worker-{w.decode()}" for w in store(st).hkeys(keys.workers)}
    return [c["name"] for _, c in named_connections(st) if c["name"] in ours]


def woken_after_takeover(
    st: Stack, clients: Clients, proc: subprocess.Popen[bytes], owner: str, taken: list[str]
) -> None:
    """``proc`` (``owner``, frozen) was taken for lost: another worker continues each of
    its requests ``taken``, and the log grows under it; then it wakes with appends in hand,
    every answer is whole, and it notices it was fenced out."""
    for rid in taken:
        wait_until(lambda rid=rid: owner_of(st, rid) not in ("", owner), "a takeover")
    first = taken[0]
    grown = len(logged_text(st, first))
    wait_until(lambda: len(logged_text(st, first)) > grown, "the log to grow")
    os.kill(proc.pid, signal.SIGCONT)
    clients.join()
    for s in clients.streams:
        assert_whole(st, s, s.question, takeovers=int(s.request_id in taken))
    name = owner.rsplit("-", 1)[0]
    wait_until(
        lambda: "taken over by another worker" in st.tail(name, 10**7),
        "the woken worker to notice it was fenced out",
    )


def test_a_live_worker_whose_connection_was_killed_is_fenced(no_heartbeat: Stack) -> None:
    """Its process lives (frozen, then woken) but its named connection was killed (a
    proxy reset, ``CLIENT KILL``): taken for gone, its requests go on elsewhere, and when it
    wakes its appends are fenced out -- nothing doubled -- and it announces itself again."""
    st, since = no_heartbeat, now()
    procs = {"a": st.start_worker("a"), "b": st.start_worker("b")}
    st.start_api()
    seen_connected(st, 2)
    clients = start_streams(st, [Stream(q) for q in questions(3)])
    clients.wait_started()
    first = clients.streams[0]
    owner = owner_of(st, first.request_id)
    name = proc_named(st, procs, owner)
    taken = [s.request_id for s in clients.streams if owner_of(st, s.request_id) == owner]
    os.kill(procs[name].pid, signal.SIGSTOP)  # (it cannot make its connection again)
    kill_connection(st, owner)
    woken_after_takeover(st, clients, procs[name], owner, taken)
    wait_until(
        lambda: f"lastevent-worker-{owner}" in named_connections_of(st),
        "the woken worker's named connection again",
    )
    assert "its connection is gone" in api_logs(st)
    # it serves again
    again = start_streams(st, [Stream(q) for q in questions(4, "again " * 20)])
    again.join()
    for s in again.streams:
        assert_whole(st, s, s.question, takeovers=0)
    reconcile_clean(st, since)


def test_a_cut_inside_a_stop_string_prefix_still_stops(stack: Stack) -> None:
    """Killed while the log ends right where a possible stop string ("STOP!") starts (the
    worker held "S", "ST" or "STO" back, or was about to make it): the next worker holds
    it again, and the answer ends just before the real stop, which is never shown."""
    st, since = stack, now()
    procs = {"a": st.start_worker("a"), "b": st.start_worker("b")}
    st.start_api()
    shown_part = " ".join(["STO", "ST", "STOa", "S", "STOP", "STO!"] * 8)
    question = f"{shown_part} STOP! this is never shown"
    clients = start_streams(st, [Stream(question, {"stop": ["STOP!"]})])
    clients.wait_started()
    [s] = clients.streams
    owner = proc_named(st, procs, owner_of(st, s.request_id))
    at = freeze_when(
        st, procs[owner], s.request_id, lambda t: len(t) > 20 and question[len(t)] == "S"
    )
    procs[owner].send_signal(signal.SIGKILL)
    procs[owner].wait()
    clients.join()
    assert s.text.startswith(at)
    assert_whole(st, s, shown_part + " ", takeovers=1)
    reconcile_clean(st, since)


def test_a_cut_inside_a_multibyte_character_completes_it(stack: Stack) -> None:
    """Killed while the next character the log will show is several bytes (and tokens)
    long: the next worker makes it whole, once."""
    st, since = stack, now()
    procs = {"a": st.start_worker("a"), "b": st.start_worker("b")}
    st.start_api()
    question = "Emoji and more: " + "🤖日本語👩‍👩‍👧€ " * 6
    clients = start_streams(st, [Stream(question)])
    clients.wait_started()
    [s] = clients.streams
    owner = proc_named(st, procs, owner_of(st, s.request_id))
    freeze_when(
        st, procs[owner], s.request_id, lambda t: len(t) > 20 and ord(question[len(t)]) > 0x7F
    )
    procs[owner].send_signal(signal.SIGKILL)
    procs[owner].wait()
    clients.join()
    assert_whole(st, s, question, takeovers=1)
    reconcile_clean(st, since)


def test_a_frozen_worker_woken_after_the_takeover_writes_nothing(stack: Stack) -> None:
    st, since = stack, now()
    procs = {"a": st.start_worker("a"), "b": st.start_worker("b")}
    st.start_api()
    clients = start_streams(st, [Stream(q) for q in questions(3)])
    clients.wait_started()
    first = clients.streams[0]
    frozen_owner = owner_of(st, first.request_id)
    frozen = proc_named(st, procs, frozen_owner)
    os.kill(procs[frozen].pid, signal.SIGSTOP)
    frozen_ids = [
        s.request_id for s in clients.streams if owner_of(st, s.request_id) == frozen_owner
    ]
    woken_after_takeover(st, clients, procs[frozen], frozen_owner, frozen_ids)
    # frozen, it kept its connection: the heartbeat found it
    logs = api_logs(st)
    assert "its heartbeat is stale" in logs and "its connection is gone" not in logs
    reconcile_clean(st, since)


def test_a_rolling_restart_under_load_drops_nothing(stack: Stack) -> None:
    """SIGTERM each worker in turn under 20 streams, starting its replacement first: a
    stopping worker lets requests finish for ``worker_drain_s`` and hands the rest over."""
    st, since = stack, now()
    slow = {"worker_drain_s": 0.5, "scripted_tokens_per_s": 15.0}  # ~20 s answers
    procs = {"a": st.start_worker("a", **slow), "b": st.start_worker("b", **slow)}
    st.start_api()
    clients = start_streams(st, [Stream(q) for q in questions(20)])
    clients.wait_started()
    for name in ("a", "b"):
        st.start_worker(f"{name}2", **slow)
        procs[name].send_signal(signal.SIGTERM)
        assert procs[name].wait(timeout=SAFETY_S) == 0, st.tail(name)
    # the first one stopped with answers running (the second may have none left by then,
    # on a slow machine: what it ran can have finished)
    assert "handed over to another worker" in st.tail("a", 10**7)
    clients.join()
    handed = 0
    for s in clients.streams:
        row = ledger_row(st.settings.database_url or "", s.request_id, timeout_s=60)
        assert row is not None
        handed += row["handovers"] > 0
        assert_whole(st, s, s.question, takeovers=0, handovers=row["handovers"])
    # (an answer may finish before its worker stops, on a slow machine; most do not)
    assert handed >= 1
    # a worker that stops cleanly leaves its heartbeat before its named connection: it
    # is never taken for lost
    assert "its connection is gone" not in api_logs(st)
    reconcile_clean(st, since)
