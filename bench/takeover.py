"""The pause a client sees when its worker dies (kill -9), freezes (SIGSTOP) or stops
(SIGTERM) mid-answer, and whether stalls of a live worker or of Redis make anyone take a
live worker for lost: real processes, the scripted engine, default settings; figures for
the docs, printed, not asserted.

Per round, ``--streams`` clients stream an answer from a stack of one API process and
two workers on a Redis of the bench's own (``appendfsync always``: the default
durability ``disk``); once every stream is moving (and a random moment more, so the
signal falls anywhere in the heartbeat, poll and sweep cycles) the worker that owns most
of them is killed (``kill -9``: its connections close, the API processes see its named
connection gone within a poll and ``worker_connection_grace_s``), frozen (``SIGSTOP``,
past ``worker_stale_s``: its connection stays, the heartbeat finds it; it is killed
once its streams moved on) or stopped (``SIGTERM``, ``worker_drain_s`` small: it hands
them over itself). The other worker continues them from the log. A replacement worker
is started once they moved on, and is ready before the next round.

Reported per setting: the pause, the gap between the last content event the lost worker
wrote and the first the next one wrote, as the client received them (p50 / p99 / max
over the paused streams of all rounds); split by the log lines into the signal to
"queued again" (detection) or "handed over", to "continuing it" (the next worker's
claim), to that worker's first event at the client; the same clients' normal
inter-event gap and pause / gap; tokens prefilled again per takeover (billing rows);
takeovers of streams whose worker was not signalled; every text checked against the
question (the scripted engine echoes it): lost / duplicated characters.

Then ``--stalls`` stalls of 3 s each of a live worker (SIGSTOP, SIGCONT; the two in
turn) and as many of Redis (SIGSTOP, SIGCONT) under streams that run throughout: how
many live workers were taken for lost (API log lines, and billing rows with a takeover)
and every text checked.

    make bench-takeover                            # = .venv/bin/python -m bench.takeover
    .venv/bin/python -m bench.takeover --kills 4 --stops 2 --handovers 2 --stalls 5

Needs Postgres (``LASTEVENT_TEST_PG_URL``, else the local server on 5432, else an
embedded one): a database of its own is made and dropped. Writes ``takeover.md`` and
every stream's event times (``takeover.json``) to ``--out``, the processes' logs to
``<out>/logs/takeover``. The default run takes about 15 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import difflib
import functools
import itertools
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import msgspec
import redis

from service.settings import Settings
from service.store.keys import Keys
from tests.conftest import migrated_database
from tests.e2e.conftest import Stack, make_stack
from tests.servers import OwnRedis

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
HEARTBEAT_S = 1.0  # workers/runner.py: Runner._heartbeat sleeps this long between beats
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
SAFETY_S = 90.0  # a hang guard only

_decode = msgspec.json.Decoder().decode


@dataclasses.dataclass
class Stream:
    """One streaming client: its content events as (monotonic receipt time, emit time in
    unix ms -- the event id's, stamped at append --, text)."""

    question: str
    request_id: str = ""
    events: list[tuple[float, int, str]] = dataclasses.field(default_factory=list)
    done: bool = False
    error: str = ""
    victim: bool = False  # its worker was the one killed / stopped
    signal_at: float = 0.0  # monotonic time of the kill / SIGTERM (victims)
    signal_wall: float = 0.0  # the same, unix time (to compare with log lines)
    claimed_wall: float | None = None  # when the next worker took it ("continuing it")

    @property
    def text(self) -> str:
        return "".join(piece for _, _, piece in self.events)

    def gaps(self) -> list[float]:
        return [b[0] - a[0] for a, b in itertools.pairwise(self.events)]

    def pause_index(self) -> int | None:
        """The gap (its index in gaps()) the client waited longest in between the signal
        and the first event the next worker wrote: the first appended after the next
        worker's claim (the old one's are all older than its requeue, the new one's
        younger than the claim). The old worker's last event can reach the client late,
        with the next worker's first, so the pause is the longest gap up to that event.
        Without the claim's log line: the largest gap after the signal."""
        if self.claimed_wall is not None:
            claimed_ms = int(self.claimed_wall * 1000)
            first = next((i for i, e in enumerate(self.events) if e[1] >= claimed_ms), None)
            if not first:
                return None
            after = next(i for i, e in enumerate(self.events) if e[0] >= self.signal_at)
            gaps = self.gaps()
            return max(range(max(0, after - 1), first), key=lambda i: gaps[i])
        return self.largest_after_signal()

    def largest_after_signal(self) -> int | None:
        after = [
            (g, i) for i, g in enumerate(self.gaps()) if self.events[i + 1][0] >= self.signal_at
        ]
        return max(after)[1] if after else None

    def resumed_at(self) -> float | None:
        """Monotonic receipt time of the first event the next worker wrote."""
        i = self.pause_index()
        return None if i is None else self.events[i + 1][0]


async def run_stream(client: httpx.AsyncClient, s: Stream) -> None:
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": len(s.question) + 16,
        "messages": [{"role": "user", "content": s.question}],
    }
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                s.error = f"HTTP {r.status_code}"
                return
            s.request_id = r.headers.get("x-request-id", "")
            # an event's lines: "data: ...", then "id: <unix ms>-<seq>" (the log entry's
            # id), then a blank line; its pieces are timed when its data line arrives
            pieces: list[tuple[float, str]] = []
            async for line in r.aiter_lines():
                if line.startswith("id: "):
                    emit_ms = int(line[4:].split("-", 1)[0])
                    s.events += [(at, emit_ms, piece) for at, piece in pieces]
                    pieces = []
                    continue
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    s.done = True
                    break
                chunk: dict[str, Any] = _decode(data)
                for choice in chunk.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        pieces.append((time.monotonic(), piece))
                if "error" in chunk:
                    s.error = str(chunk["error"])
    except httpx.HTTPError as exc:
        s.error = f"{type(exc).__name__}: {exc}"


WORDS = ("the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "and", "runs")


@functools.cache
def body_text(model_dir: Path, tokens: int) -> str:
    """ASCII words, about one token each (one content event per token), ``tokens`` long."""
    from service.tokenize import ModelInfo

    model = ModelInfo.load(model_dir)
    words = [WORDS[0]]
    while len(model.encode(" ".join(words))) < tokens:
        words.append(WORDS[len(words) % len(WORDS)])
    return " ".join(words)


def question(tag: str, model_dir: Path, tokens: int) -> str:
    return f"Question {tag}: {body_text(model_dir, tokens)}"


@dataclasses.dataclass
class Setting:
    name: str
    mode: str  # kill | stop | term
    rounds: int


@dataclasses.dataclass
class Result:
    setting: Setting
    streams: list[Stream]
    rows: dict[str, dict[str, Any]]
    # victims, from the log lines: signal -> queued again (sweeper) or handed over;
    # -> claimed ("continuing it"); -> the next content event at the client
    phases: dict[str, list[float]]
    rounds: int
    took_s: float


class Bench:
    def __init__(self, st: Stack, args: argparse.Namespace) -> None:
        self.st = st
        self.args = args
        self.redis = redis.Redis.from_url(st.settings.redis_url or "")
        self.keys = Keys(st.settings.key_prefix, st.settings.partitions)
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.count = 0

    def start_worker(self, wait: bool = True) -> str:
        name = f"w{self.count}"
        self.count += 1
        self.workers[name] = self.st.start_worker(name, wait=wait)
        return name

    def wait_ready(self, name: str) -> None:
        deadline = time.monotonic() + 240
        while "ready (engine" not in self.st.tail(name, 1_000_000):
            if self.workers[name].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker {name} did not start: {self.st.tail(name)}")
            time.sleep(0.05)

    async def round(
        self, client: httpx.AsyncClient, tag: str, sig: signal.Signals | None, tokens: int
    ) -> list[Stream]:
        """One round: stream, then (unless ``sig`` is None: a warm-up) signal the worker
        owning most streams, start its replacement once they moved on, wait for it."""
        d = self.args.model_dir
        streams = [Stream(question(f"{tag}-{i}", d, tokens)) for i in range(self.args.streams)]
        tasks = [asyncio.create_task(run_stream(client, s)) for s in streams]
        deadline = time.monotonic() + SAFETY_S
        while any(len(s.events) < 10 and not s.done and not s.error for s in streams):
            if time.monotonic() > deadline:
                raise TimeoutError("the streams did not start")
            await asyncio.sleep(0.01)
        if sig is None:
            await asyncio.wait_for(asyncio.gather(*tasks), SAFETY_S)
            return streams
        # anywhere in the heartbeat and sweep cycles, which are not in step
        await asyncio.sleep(random.uniform(0.0, 1.0))
        # the streams still mid-answer (a stalled machine may have let some finish)
        owners = {s.request_id: self.owner(s.request_id) for s in streams if not s.done}
        counts = collections.Counter(o for o in owners.values() if o)
        if not counts:
            print(f"  round {tag}: every stream ended before the signal", file=sys.stderr)
            await asyncio.wait_for(asyncio.gather(*tasks), SAFETY_S)
            return streams
        [(victim, _)] = counts.most_common(1)
        proc = self.workers.pop(victim)
        at, wall = time.monotonic(), time.time()
        proc.send_signal(sig)
        victims = [s for s in streams if owners.get(s.request_id) == victim]
        for s in victims:
            s.victim, s.signal_at, s.signal_wall = True, at, wall
        # the replacement starts once another worker holds the victims' requests: its
        # start would compete with the takeover for the CPUs
        while any(
            not s.done and not s.error and self.owner(s.request_id) in ("", victim) for s in victims
        ):
            if time.monotonic() > at + SAFETY_S:
                raise TimeoutError(f"round {tag}: no takeover")
            await asyncio.sleep(0.02)
        if sig == signal.SIGSTOP:  # frozen past the staleness bound: gone for good now
            proc.kill()
        fresh = self.start_worker(wait=False)
        await asyncio.wait_for(asyncio.gather(*tasks), SAFETY_S)
        await asyncio.to_thread(proc.wait, 30)
        await asyncio.to_thread(self.wait_ready, fresh)
        return streams

    def owner(self, rid: str) -> str:
        """The name of the worker (any ever started here) owning ``rid`` now, or ''."""
        raw = self.redis.hget(self.keys.meta(rid), "owner")
        owner = raw.decode() if isinstance(raw, bytes) else ""
        return next((f"w{i}" for i in range(self.count) if owner.startswith(f"w{i}-")), "")


LINE = re.compile(
    r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*?request (\S+): "
    r"(its worker \S+ is lost(?: \([^)]*\))?; queued again|handed over to another worker|"
    r"continuing it)"
)


def log_times(logs: Path) -> dict[tuple[str, str], list[float]]:
    """(request id, "queued" | "claimed") -> the unix times of those log lines: queued
    again by the sweeper or handed over by its worker; continued by the next worker."""
    found: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for path in logs.glob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            m = LINE.search(line)
            if m:
                t = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                what = "claimed" if m.group(3) == "continuing it" else "queued"
                found[(m.group(2), what)].append(t)
    return found


def billing_rows(database_url: str, rids: list[str], timeout_s: float = 60) -> dict[str, Any]:
    from sqlalchemy import bindparam, text
    from sqlalchemy.ext.asyncio import create_async_engine

    query = text(
        "SELECT id, state, prompt_tokens, completion_tokens, takeovers, handovers,"
        " reprefill_tokens FROM requests WHERE id IN :ids"
    ).bindparams(bindparam("ids", expanding=True))

    async def fetch() -> dict[str, Any]:
        engine = create_async_engine(database_url)
        rows: dict[str, Any] = {}
        try:
            deadline = time.monotonic() + timeout_s
            while len(rows) < len(rids) and time.monotonic() < deadline:
                async with engine.connect() as conn:
                    got = (await conn.execute(query, {"ids": rids})).mappings().all()
                rows = {str(r["id"]): dict(r) for r in got}
                if len(rows) < len(rids):
                    await asyncio.sleep(0.5)
        finally:
            await engine.dispose()
        return rows

    return asyncio.run(fetch())


async def drive(bench: Bench, setting: Setting) -> list[Stream]:
    sig = SIGNALS[setting.mode]
    streams: list[Stream] = []
    async with httpx.AsyncClient(base_url=bench.st.url, timeout=SAFETY_S) as client:
        await bench.round(client, f"{setting.mode}-warm", None, 20)
        for k in range(setting.rounds):
            streams += await bench.round(client, f"{setting.mode}{k}", sig, bench.args.tokens)
            print(f"  {setting.name}: {k + 1}/{setting.rounds}", file=sys.stderr, flush=True)
    return streams


def run_stack(
    settings: list[Setting], args: argparse.Namespace, server: OwnRedis, db: str
) -> tuple[list[Result], list[dict[str, str]]]:
    tmp = args.out / "logs" / "takeover"
    shutil.rmtree(tmp, ignore_errors=True)
    st = make_stack(
        tmp,
        server.url,
        db,
        args.model_dir,
        scripted_tokens_per_s=args.rate,
        durability=args.durability,
        **({"worker_stale_s": args.stale} if args.stale else {}),
        **({"worker_connection_grace_s": args.grace} if args.grace is not None else {}),
        worker_drain_s=args.drain,
        worker_concurrency=32,
        recorder_claim_idle_ms=1000,  # a killed worker's outbox entries are recorded soon
    )
    bench = Bench(st, args)
    results = []
    stalls: list[dict[str, str]] = []
    try:
        bench.start_worker()
        bench.start_worker()
        st.start_api()
        for setting in settings:
            started = time.monotonic()
            print(f"running: {setting.name} ...", file=sys.stderr, flush=True)
            streams = asyncio.run(drive(bench, setting))
            took = time.monotonic() - started
            rows = billing_rows(db, [s.request_id for s in streams if s.request_id])
            results.append(
                Result(setting, streams, rows, phases(st, streams), setting.rounds, took)
            )
        for what in ("worker", "redis") if args.stalls else ():
            print(f"running: {args.stalls} stalls of {what} ...", file=sys.stderr, flush=True)
            stalls.append(stall_figures(bench, server, what, db))
    finally:
        st.stop()
    return results, stalls


def phases(st: Stack, streams: list[Stream]) -> dict[str, list[float]]:
    """Victims, from the log lines: signal -> queued again (detection) or handed over;
    -> claimed ("continuing it"); -> the next content event at the client."""
    lines = log_times(st.logs)
    found: dict[str, list[float]] = {"queued": [], "claimed": [], "event": []}
    for s in (s for s in streams if s.victim):
        queued = [t for t in lines[(s.request_id, "queued")] if t >= s.signal_wall - 0.05]
        # the next worker may log its claim a moment before the old one its handover
        claimed = [t for t in lines[(s.request_id, "claimed")] if t >= s.signal_wall - 0.05]
        if not queued or not claimed:
            continue
        s.claimed_wall = claimed[0]
        resumed = s.resumed_at()
        if resumed is None:
            continue
        # unix times: the log lines'; the client's receipt: signal + monotonic offset
        found["queued"].append(queued[0] - s.signal_wall)
        found["claimed"].append(max(0.0, claimed[0] - queued[0]))
        found["event"].append(s.signal_wall + resumed - s.signal_at - claimed[0])
    return found


STALL_S = 3.0


def stall_figures(bench: Bench, server: OwnRedis, what: str, db: str) -> dict[str, str]:
    """``--stalls`` stalls of 3 s of a live worker (the two in turn) or of Redis, 1 s
    apart, under ``--streams`` clients streaming throughout: were live workers taken for
    lost, and is every text whole?"""
    args = bench.args
    before = len(lost_lines(bench.st))
    streams: list[Stream] = []
    done = asyncio.Event()

    async def client(i: int) -> None:
        async with httpx.AsyncClient(base_url=bench.st.url, timeout=SAFETY_S) as http:
            k = 0
            while not done.is_set():
                s = Stream(question(f"{what}-stall-{i}-{k}", args.model_dir, args.tokens * 3))
                streams.append(s)
                await run_stream(http, s)
                k += 1

    def freeze(n: int, sig: signal.Signals) -> None:
        if what == "redis":
            server.pause() if sig == signal.SIGSTOP else server.resume()
            return
        names = sorted(bench.workers)
        os.kill(bench.workers[names[n % len(names)]].pid, sig)

    async def stalls() -> None:
        clients = [asyncio.create_task(client(i)) for i in range(args.streams)]
        await asyncio.sleep(2.0)
        for n in range(args.stalls):
            freeze(n, signal.SIGSTOP)
            await asyncio.sleep(STALL_S)
            freeze(n, signal.SIGCONT)
            await asyncio.sleep(1.0)
        done.set()
        await asyncio.wait_for(asyncio.gather(*clients), SAFETY_S)

    started = time.monotonic()
    asyncio.run(stalls())
    rows = billing_rows(db, [s.request_id for s in streams if s.request_id])
    taken = sum(1 for row in rows.values() if row["takeovers"])
    judged = len(lost_lines(bench.st)) - before
    lost = dup = 0
    for s in streams:
        a, b = char_diff(s.question, s.text)
        lost, dup = lost + a, dup + b
    failed = sum(1 for s in streams if s.error or not s.done)
    whom = "a live worker (SIGSTOP, the two in turn)" if what == "worker" else "Redis (SIGSTOP)"
    return {
        "stalls": f"{args.stalls} x {STALL_S:g} s of {whom}, 1 s apart",
        "streams (running throughout)": f"{len(streams)} ({args.streams} at a time)",
        "**false takeovers**: billing rows with one / API log lines": f"**{taken} / {judged}**",
        "text = question: lost / duplicated chars": (
            f"{lost} / {dup} ({sum(1 for s in streams if s.text == s.question)} of "
            f"{len(streams)} exact)"
        ),
        "failed streams / billing rows": f"{failed} / {len(rows)} of {len(streams)}",
        "took": f"{time.monotonic() - started:.0f} s",
    }


def lost_lines(st: Stack) -> list[str]:
    """The API processes' log lines that took a worker for lost."""
    return [
        line
        for path in st.logs.glob("api-*.log")
        for line in path.read_text(errors="replace").splitlines()
        if "its connection is gone" in line or "its heartbeat is stale" in line
    ]


def pct(data: list[float], q: float) -> float:
    if not data:
        return float("nan")
    xs = sorted(data)
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def char_diff(want: str, got: str) -> tuple[int, int]:
    """(lost, duplicated) characters of ``got`` against ``want``."""
    lost = dup = 0
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, want, got, False).get_opcodes():
        if op in ("delete", "replace"):
            lost += i2 - i1
        if op in ("insert", "replace"):
            dup += j2 - j1
    return lost, dup


def figures(r: Result, args: argparse.Namespace) -> dict[str, str]:
    sc = r.setting
    victims = [s for s in r.streams if s.victim]
    pauses, normal = [], []
    for s in r.streams:
        gaps = s.gaps()
        skip = s.pause_index() if s.victim else None
        if skip is not None:
            pauses.append(gaps[skip])
        normal += [g for i, g in enumerate(gaps) if i != skip]
    gap50 = statistics.median(normal) if normal else float("nan")
    resumed = [t - s.signal_at for s in victims if (t := s.resumed_at()) is not None]
    timed = sum(1 for s in victims if s.claimed_wall is not None)
    lost = dup = 0
    for s in r.streams:
        a, b = char_diff(s.question, s.text)
        lost, dup = lost + a, dup + b
    moves = {"kill": "takeovers", "stop": "takeovers", "term": "handovers"}[sc.mode]
    vrows = [r.rows[s.request_id] for s in victims if s.request_id in r.rows]
    per_move = [
        row["reprefill_tokens"] / (row["takeovers"] + row["handovers"])
        for row in vrows
        if row["takeovers"] + row["handovers"]
    ]
    others = [r.rows[s.request_id] for s in r.streams if not s.victim and s.request_id in r.rows]
    spurious = sum(1 for row in others if row["takeovers"] + row["handovers"])
    d = Settings()
    if sc.mode == "kill":
        grace, poll = d.worker_connection_grace_s, d.worker_connection_poll_s
        bound = f"{grace:g} - {grace + 2 * poll:g} s (grace {grace:g} s + up to 2 polls)"
    elif sc.mode == "stop":
        stale, sweep = d.worker_stale_s, d.sweep_interval_s
        bound = (
            f"{stale - HEARTBEAT_S:g} - {stale + sweep:g} s "
            f"(stale_s - heartbeat {HEARTBEAT_S:g} s .. stale_s + sweep {sweep:g} s)"
        )
    else:
        bound = (
            f"none: handed over after worker_drain_s {args.drain:g} s + the claim loop's "
            "blocked read (<= 0.5 s); the streams move meanwhile"
        )

    def ms2(xs: list[float]) -> str:
        if not xs:
            return "-"
        return f"{pct(xs, 0.5) * 1000:.0f} / {max(xs) * 1000:.0f} ms"

    def s3(xs: list[float]) -> str:
        return f"{pct(xs, 0.5):.2f} / {pct(xs, 0.99):.2f} / {max(xs, default=float('nan')):.2f} s"

    return {
        "setting": sc.name,
        "rounds (streams paused)": f"{r.rounds} ({len(victims)})",
        "**pause p50 / p99 / max**": f"**{s3(pauses)}**",
        "detection window (expected)": bound,
        "signal -> queued again (sweeper) / handed over (SIGTERM), p50 / max": ms2(
            r.phases["queued"]
        ),
        "-> claimed by the next worker (queue read, claim, log read), p50 / max": ms2(
            r.phases["claimed"]
        ),
        "-> next event at the client (re-prefill, first token, append, tail), p50 / max": ms2(
            r.phases["event"]
        ),
        "signal -> the next worker's first event at the client, p50 / max": ms2(resumed),
        "paused streams timed by the claim's log line": f"{timed} of {len(victims)}",
        "normal inter-event gap p50 / p99 / max (every other gap)": (
            f"{gap50 * 1000:.1f} / {pct(normal, 0.99) * 1000:.1f} / "
            f"{max(normal, default=float('nan')) * 1000:.0f} ms"
        ),
        "pause / normal gap: p50 / p99": (
            f"{pct(pauses, 0.5) / gap50:.0f}x / {pct(pauses, 0.99) / pct(normal, 0.99):.0f}x"
        ),
        "re-prefilled tokens per takeover, median (prompt tokens)": (
            f"{pct(per_move, 0.5):.0f} ({pct([row['prompt_tokens'] for row in vrows], 0.5):.0f})"
        ),
        "billing: paused streams with 1 takeover (kill, stop) / handover (SIGTERM)": (
            f"{sum(1 for row in vrows if row[moves] == 1 == row['takeovers'] + row['handovers'])}"
            f" of {len(victims)}"
        ),
        "takeovers of streams whose worker was not signalled": (
            f"{spurious} of {len(r.streams) - len(victims)}"
        ),
        "text = question: lost / duplicated chars": (
            f"{lost} / {dup} ({sum(1 for s in r.streams if s.text == s.question)} of "
            f"{len(r.streams)} exact)"
        ),
        "failed streams / billing rows": (
            f"{sum(1 for s in r.streams if s.error or not s.done)} / {len(r.rows)} of "
            f"{len(r.streams)}"
        ),
        "took": f"{r.took_s:.0f} s",
    }


def raw_json(results: list[Result]) -> str:
    """Every stream's events (receipt s after its first, emit unix ms), for a closer look."""
    out = []
    for r in results:
        for s in r.streams:
            t0 = s.events[0][0] if s.events else 0.0
            out.append(
                {
                    "setting": r.setting.name,
                    "request_id": s.request_id,
                    "victim": s.victim,
                    "first_wall": s.signal_wall - (s.signal_at - t0) if s.victim else None,
                    "signal_s": s.signal_at - t0 if s.victim else None,
                    "claimed_wall": s.claimed_wall,
                    "pause_index": s.pause_index() if s.victim else None,
                    "events": [[round(t - t0, 4), ms] for t, ms, _ in s.events],
                }
            )
    return msgspec.json.encode(out).decode() + "\n"


def table(results: list[dict[str, str]], head: str = "setting") -> str:
    keys = list(results[0])
    lines = ["| " + " | ".join(["", *(r[head] for r in results)]) + " |"]
    lines.append("|" + "---|" * (len(results) + 1))
    for k in keys[1:]:
        lines.append("| " + " | ".join([k, *(r[k] for r in results)]) + " |")
    return "\n".join(lines)


@contextlib.contextmanager
def local_postgres() -> Iterator[str]:
    """An admin URL: ``LASTEVENT_TEST_PG_URL``, the local server on 5432, else embedded."""
    from service.cli.embedded import EmbeddedPostgres, answers

    url = os.environ.get("LASTEVENT_TEST_PG_URL")
    if url:
        yield url
        return
    if answers("127.0.0.1", 5432):
        yield "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
        return
    server = EmbeddedPostgres(Path(tempfile.mkdtemp(prefix="bench-pg-")))
    print("no Postgres on 127.0.0.1:5432: using an embedded one", file=sys.stderr)
    try:
        yield server.start()
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=12, help="kill -9 rounds")
    parser.add_argument("--stops", type=int, default=12, help="SIGSTOP rounds (past the bound)")
    parser.add_argument("--handovers", type=int, default=12, help="SIGTERM rounds")
    parser.add_argument("--stalls", type=int, default=50, help="3 s stalls of each kind")
    parser.add_argument(
        "--durability", default="disk", help="LASTEVENT_DURABILITY (its Redis: always)"
    )
    parser.add_argument("--stale", type=float, default=0, help="worker_stale_s (0: default)")
    parser.add_argument("--grace", type=float, default=None, help="worker_connection_grace_s")
    parser.add_argument("--drain", type=float, default=0.2, help="worker_drain_s (SIGTERM)")
    parser.add_argument("--streams", type=int, default=8, help="streams per round")
    parser.add_argument("--tokens", type=int, default=100, help="answer length (about)")
    parser.add_argument("--rate", type=float, default=40.0, help="tokens/s per stream")
    parser.add_argument("--model-dir", type=Path, default=REPO / ".cache/models" / MODEL)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    args = parser.parse_args()
    from service.cli.model import prepare_model

    args.model_dir = prepare_model(args.model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    started, load = time.monotonic(), os.getloadavg()[0]
    settings = [
        Setting("kill -9 (its connection closes)", "kill", args.kills),
        Setting("SIGSTOP past worker_stale_s (its heartbeat)", "stop", args.stops),
        Setting(f"SIGTERM, worker_drain_s {args.drain:g} s", "term", args.handovers),
    ]
    with contextlib.ExitStack() as stack:
        server = OwnRedis(
            Path(tempfile.mkdtemp(prefix="bench-takeover-redis-")), appendfsync="always"
        )
        server.start()
        stack.callback(server.stop)
        db = stack.enter_context(migrated_database(stack.enter_context(local_postgres())))
        results, stalls = run_stack([s for s in settings if s.rounds], args, server, db)
    d = Settings()
    command = " ".join(["python -m bench.takeover", *sys.argv[1:]])
    heading = (
        f"Takeover pause: 1 API process, 2 workers (a fresh pair each round), scripted "
        f"engine at {args.rate:g} tok/s per stream, {args.streams} streams per round, "
        f"~{args.tokens} tokens each; default settings (connection grace "
        f"{d.worker_connection_grace_s:g} s, poll {d.worker_connection_poll_s:g} s; heartbeat "
        f"every {HEARTBEAT_S:g} s, stale after {d.worker_stale_s:g} s, sweep every "
        f"{d.sweep_interval_s:g} s); {os.cpu_count()} CPUs, load average {load:.1f} at the "
        f"start, {os.getloadavg()[0]:.1f} at the end. Command: `{command}`"
    )
    md = heading + "\n\n" + table([figures(r, args) for r in results])
    if stalls:
        md += "\n\nStalls of 3 s under streams, nobody killed:\n\n" + table(stalls, "stalls")
    (args.out / "takeover.md").write_text(md + "\n")
    (args.out / "takeover.json").write_text(raw_json(results))
    print("\n" + md + "\n")
    print(
        f"wrote {args.out / 'takeover.md'}, takeover.json; logs in {args.out / 'logs'}/takeover; "
        f"took {time.monotonic() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
