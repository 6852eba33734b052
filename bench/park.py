"""Park vs burn: what clients that hang up cost, and what one that comes back waits for --
lastevent's parking (the defaults) against the resume grace alone (parking off, a 30 s
grace: the behaviour before it), in the same run; real processes, the scripted engine.

The workload is AIPerf's request cancellation (``--request-cancellation-rate 30
--request-cancellation-delay 1``): ``--requests`` streaming requests of ``--tokens``
tokens at ``--rate`` tokens/s, ``--concurrency`` at a time; a ``--hangup`` share of the
clients drop their connection after ``--delay`` s and never come back. Besides them,
``--returns`` clients per ``--away`` value drop theirs after ``--delay`` s and come back
that many seconds later with ``Last-Event-ID``.

Reported per setting: requests hung up; tokens generated after their last reader left
(the billing row's completion tokens, or for a parked request what its log carries plus
what was thrown away at the park, less what the reader had been sent: p50 / max); the
waste of all of them as a share of every token generated; for each ``--away``, the pause
a returning reader saw (its reconnect to the first event the log did not hold when it
came back: p50 / p99) and whether its text was whole (the scripted engine echoes the
question).

    make bench-park                        # = .venv/bin/python -m bench.park
    .venv/bin/python -m bench.park --away 5,60,600 --returns 10

Needs Redis and Postgres as ``make bench-takeover`` does. Writes ``park.md`` to ``--out``
and the processes' logs to ``<out>/logs/park-*``. The default run takes about 3 minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from bench.harness import local_redis
from bench.takeover import billing_rows, local_postgres, pct, question
from service.store.keys import EVENT_FIELD, Keys
from service.stream import events as ev
from service.stream.lifecycle import Meta
from tests.conftest import migrated_database
from tests.e2e.conftest import Stack, make_stack

REPO = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
SETTINGS = {  # name -> the stack's settings
    "parked (defaults)": {},
    "grace only (before)": {"park_after_s": -1.0, "resume_window_s": 30.0},
}


@dataclasses.dataclass
class Client:
    role: str  # stay | hangup | back
    away_s: float = 0.0
    request_id: str = ""
    text: str = ""
    want: str = ""
    last_id: str = ""  # the last event id it saw before it left
    pause_s: float | None = None  # back: reconnect -> first event the log did not hold


async def stream(client: httpx.AsyncClient, c: Client, args: argparse.Namespace) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": c.want}],
        "stream": True,
        "max_tokens": args.tokens * 2,
    }
    leave_at = time.monotonic() + args.delay if c.role != "stay" else None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        c.request_id = r.headers["x-request-id"]
        async for event_id, data in sse(r):
            c.text += content(data)
            c.last_id = event_id or c.last_id
            if leave_at is not None and time.monotonic() >= leave_at:
                break


async def come_back(client: httpx.AsyncClient, c: Client, store: redis.Redis, keys: Keys) -> None:
    await asyncio.sleep(c.away_s)
    held = store.xrevrange(keys.log(c.request_id), count=1)
    last_logged = held[0][0].decode() if held else "0-0"
    back_at = time.monotonic()
    headers = {"Last-Event-ID": c.last_id}
    async with client.stream("GET", f"/v1/requests/{c.request_id}/events", headers=headers) as r:
        async for event_id, data in sse(r):
            c.text += content(data)
            entry = (event_id or "").split(":")[0]
            if c.pause_s is None and entry and _after(entry, last_logged):
                c.pause_s = time.monotonic() - back_at


def _after(a: str, b: str) -> bool:
    return tuple(map(int, a.split("-"))) > tuple(map(int, b.split("-")))


async def sse(r: httpx.Response) -> Any:
    """(id, data) of each event (the blank line dispatches it, as the standard says)."""
    event_id, data = None, None
    async for line in r.aiter_lines():
        if line.startswith("data: "):
            data = line[6:]
        elif line.startswith("id: "):
            event_id = line[4:]
        elif line == "" and data is not None:
            yield event_id, data
            event_id, data = None, None


def content(data: str) -> str:
    if data == "[DONE]":
        return ""
    payload = json.loads(data)
    return "".join((c.get("delta") or {}).get("content") or "" for c in payload.get("choices", []))


async def drive(st: Stack, args: argparse.Namespace) -> list[Client]:
    rng = random.Random(7)
    clients = [
        Client("hangup" if rng.random() < args.hangup else "stay") for _ in range(args.requests)
    ]
    aways = [float(x) for x in args.away.split(",") if x]
    clients += [Client("back", away) for away in aways for _ in range(args.returns)]
    for i, c in enumerate(clients):
        c.want = question(f"{i}", args.model_dir, args.tokens)
    store = redis.Redis.from_url(st.settings.redis_url or "")
    keys = Keys(st.settings.key_prefix, st.settings.partitions)
    slots = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=st.url, timeout=httpx.Timeout(900)) as client:

        async def one(c: Client) -> None:
            async with slots:
                await stream(client, c, args)
            if c.role == "back":
                await come_back(client, c, store, keys)

        await asyncio.gather(*(one(c) for c in clients))
    return clients


def settle(st: Stack, clients: list[Client], db: str) -> dict[str, Any]:
    """Once every hung-up request ended or is parked: the tokens each generated after its
    reader left, and the tokens all requests generated."""
    store = redis.Redis.from_url(st.settings.redis_url or "")
    keys = Keys(st.settings.key_prefix, st.settings.partitions)
    gone = [c for c in clients if c.role == "hangup"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        states = [store.hget(keys.meta(c.request_id), Meta.STATE) for c in gone]
        if all(s is not None and s.decode() != "running" for s in states):
            break
        time.sleep(0.2)
    ended = [c.request_id for c in clients if c.role != "hangup" or _ended(store, keys, c)]
    rows = billing_rows(db, ended)
    out: dict[str, Any] = {"after_left": [], "generated": 0}
    for c in clients:
        entries = store.xrange(keys.log(c.request_id))
        events = [(eid.decode(), ev.decode(f[EVENT_FIELD])) for eid, f in entries]
        logged = ev.completion_tokens(e for _, e in events)
        meta = store.hgetall(keys.meta(c.request_id))
        discarded = int(meta.get(Meta.DISCARDED.encode(), b"0"))
        row = rows.get(c.request_id)
        made = row["completion_tokens"] if row is not None else logged + discarded
        out["generated"] += made
        if c.role == "hangup":
            seen = [e for eid, e in events if not _after(eid, c.last_id.split(":")[0] or "0-0")]
            delivered = ev.completion_tokens(seen)
            out["after_left"].append(max(0, made - delivered))
    return out


def _ended(store: redis.Redis, keys: Keys, c: Client) -> bool:
    state = store.hget(keys.meta(c.request_id), Meta.STATE)
    return state is not None and state.decode() not in ("running", "parked", "queued")


def run_setting(
    name: str, overrides: dict[str, Any], args: argparse.Namespace, redis_url: str, db: str
) -> dict[str, str]:
    tmp = args.out / "logs" / f"park-{len(name)}"
    shutil.rmtree(tmp, ignore_errors=True)
    st = make_stack(
        tmp,
        redis_url,
        db,
        args.model_dir,
        scripted_tokens_per_s=args.rate,
        worker_concurrency=64,
        **overrides,
    )
    try:
        st.start_worker()
        st.start_api()
        print(f"running: {name} ...", file=sys.stderr, flush=True)
        clients = asyncio.run(drive(st, args))
        figures = settle(st, clients, db)
    finally:
        st.stop()
    after = figures["after_left"]
    row = {
        "setting": name,
        "hung up": str(len(after)),
        "tokens after the last reader left, p50 / max": (
            f"{statistics.median(after):.0f} / {max(after)}" if after else "-"
        ),
        "waste / generated": f"{sum(after) / max(1, figures['generated']):.1%}",
    }
    for away in sorted({c.away_s for c in clients if c.role == "back"}):
        back = [c for c in clients if c.role == "back" and c.away_s == away]
        pauses = [c.pause_s * 1000 for c in back if c.pause_s is not None]
        whole = sum(c.text == c.want for c in back)
        row[f"back after {away:g} s: pause p50 / p99 (ms), whole texts"] = (
            f"{pct(pauses, 0.5):.0f} / {pct(pauses, 0.99):.0f}, {whole}/{len(back)}"
            if pauses
            else f"- (it had ended), {whole}/{len(back)}"
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rate", type=float, default=50.0, help="tokens/s per stream")
    parser.add_argument("--hangup", type=float, default=0.3, help="share that hangs up for good")
    parser.add_argument("--delay", type=float, default=1.0, help="s before a client hangs up")
    parser.add_argument("--away", default="5,60", help="s a returning client stays away")
    parser.add_argument("--returns", type=int, default=5, help="returning clients per --away")
    parser.add_argument("--model-dir", type=Path, default=REPO / ".cache/models" / MODEL)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    args = parser.parse_args()
    from service.cli.model import prepare_model

    args.model_dir = prepare_model(args.model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    started, load = time.monotonic(), os.getloadavg()[0]
    rows = []
    with contextlib.ExitStack() as stack:
        redis_url = os.environ.get("LASTEVENT_REDIS_URL") or stack.enter_context(local_redis())
        db = stack.enter_context(migrated_database(stack.enter_context(local_postgres())))
        for name, overrides in SETTINGS.items():
            rows.append(run_setting(name, overrides, args, redis_url, db))
    command = " ".join(["python -m bench.park", *sys.argv[1:]])
    heading = (
        f"Park vs burn: {args.requests} streaming requests of ~{args.tokens} tokens at "
        f"{args.rate:g} tok/s, {args.concurrency} at a time, {args.hangup:.0%} hang up after "
        f"{args.delay:g} s for good; {args.returns} more per away time come back; 1 API "
        f"process, 1 worker, scripted engine; {os.cpu_count()} CPUs, load average "
        f"{load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end. Command: `{command}`"
    )
    cols = list(rows[0])
    md = "\n".join(
        [
            heading,
            "",
            "| " + " | ".join(cols) + " |",
            "| " + " | ".join("---" for _ in cols) + " |",
            *("| " + " | ".join(r.get(c, "-") for c in cols) + " |" for r in rows),
        ]
    )
    (args.out / "park.md").write_text(md + "\n")
    print("\n" + md + "\n")
    print(f"wrote {args.out / 'park.md'}; took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
