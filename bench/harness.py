"""What durability costs: lastevent vs the no-Redis baseline, same clients, same engine.

Both systems run the scripted engine at ``--rate`` tokens/s per stream (so the engine
is not what is measured) and are driven by the same asyncio HTTP/SSE clients in this
process, one system after the other. Reported for both, with lastevent / baseline:

* delivered tokens/s (all clients), time to first token;
* added latency per token: receipt time at the client minus the event's emit time
  (lastevent: its Redis entry id, stamped at append; baseline: stamped at emit);
* lastevent only: resume latency (reconnect with Last-Event-ID -> first replayed
  event) and lost/duplicated characters; Redis memory per stored token and per
  finished stream, and per-request keys left after the retention TTL.

    make bench                                   # small: 50 streams, ~1 minute
    .venv/bin/python -m bench.harness --streams 200 --rate 20 --tokens 200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.common import free_port, stop, wait_ok
import redis

MODEL = "SmolLM2-135M-Instruct"
REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def baseline(model_dir: Path, rate: float, logs: Path) -> Iterator[str]:
    port = free_port()
    with open(logs / "baseline.log", "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "bench.baseline", "--port", str(port),
                                 "--model-dir", str(model_dir), "--tokens-per-s", str(rate)],
                                stdout=out, stderr=out)
    try:
        wait_ok(f"http://127.0.0.1:{port}/", [proc])
        yield f"http://127.0.0.1:{port}"
    finally:
        stop([proc])


@contextlib.contextmanager
def lastevent(model_dir: Path, rate: float, redis_url: str, prefix: str, logs: Path,
              ttl_s: int, **extra: str) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "LASTEVENT_REDIS_URL": redis_url, "LASTEVENT_MODEL_DIR": str(model_dir),
           "LASTEVENT_PORT": str(port), "LASTEVENT_KEY_PREFIX": prefix, "LASTEVENT_AUTH": "off",
           "LASTEVENT_ENGINE": "scripted", "LASTEVENT_SCRIPTED_TOKENS_PER_S": str(rate),
           "LASTEVENT_WORKER_CONCURRENCY": "2000", "LASTEVENT_HOT_LOG_TTL_S": str(ttl_s),
           "LASTEVENT_MAX_STREAMS": "100000",
           **{f"LASTEVENT_{k.upper()}": v for k, v in extra.items()}}
    env.pop("LASTEVENT_DATABASE_URL", None)  # the stream path only, no ledger
    procs = []
    for role in ("worker", "api"):
        with open(logs / f"{role}.log", "wb") as out:
            procs.append(subprocess.Popen([sys.executable, "-m", "service.cli", role], env=env,
                                          stdout=out, stderr=out))
    try:
        wait_ok(f"http://127.0.0.1:{port}/healthz", procs)
        client = redis.Redis.from_url(redis_url)
        while not client.hlen(f"{prefix}:workers"):
            time.sleep(0.1)
        lastevent.api_pid = procs[1].pid  # type: ignore[attr-defined]
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(procs)


async def idle_streams(url: str, n: int, api_pid: int) -> tuple[float, float]:
    """Open ``n`` streams that stay idle (the engine is in a long prefill); return the API
    process's RSS before and with them open (bytes)."""
    import psutil

    api = psutil.Process(api_pid)
    before = api.memory_info().rss
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "idle"}]}
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    opened = 0
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        stack = contextlib.AsyncExitStack()
        async with stack:
            for _ in range(n):
                r = await stack.enter_async_context(
                    client.stream("POST", "/v1/chat/completions", json=body))
                assert r.status_code == 200, r.status_code
                opened += 1
            await asyncio.sleep(3)  # leases refreshed, tailer settled
            during = api.memory_info().rss
    return before, during


@dataclass
class Run:
    wall_s: float = 0.0
    tokens: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    added_ms: list[float] = field(default_factory=list)
    resume_ms: list[float] = field(default_factory=list)
    lost_chars: int = 0
    dup_chars: int = 0
    request_ids: list[str] = field(default_factory=list)


def parse_events(lines: list[str]) -> list[tuple[str | None, str]]:
    out, event_id = [], None
    for line in lines:
        if line.startswith("id: "):
            event_id = line[4:]
        elif line.startswith("data: "):
            out.append((event_id, line[6:]))
    return out


def content(data: str) -> str:
    if data == "[DONE]":
        return ""
    choices = json.loads(data).get("choices") or []
    return "".join((c.get("delta") or {}).get("content") or "" for c in choices)


async def one_stream(client: httpx.AsyncClient, text: str, run: Run, drop_at: int | None) -> None:
    body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text}]}
    start = time.time()
    got: list[str] = []
    last_id = None
    rid = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        rid = r.headers.get("x-request-id")
        event_id = None
        async for line in r.aiter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                data = line[6:]
                piece = content(data)
                now = time.time()
                if piece:
                    if not got:
                        run.ttft_ms.append((now - start) * 1000)
                    run.added_ms.append(now * 1000 - int(event_id.split("-")[0]))
                    got.append(piece)
                if data != "[DONE]" and json.loads(data).get("usage"):
                    run.tokens += json.loads(data)["usage"]["completion_tokens"]
                last_id = event_id
                if drop_at is not None and len(got) == drop_at:
                    break
    if rid:
        run.request_ids.append(rid)
    if drop_at is None or rid is None:
        return
    await asyncio.sleep(0.5)  # offline for a moment: events pile up in the log meanwhile
    sent = time.time()  # reconnect with Last-Event-ID and take the rest
    first = True
    async with client.stream("GET", f"/v1/requests/{rid}/events",
                             headers={"Last-Event-ID": last_id or ""}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                if first:
                    run.resume_ms.append((time.time() - sent) * 1000)
                    first = False
                data = line[6:]
                got.append(content(data))
                if data != "[DONE]" and json.loads(data).get("usage"):
                    run.tokens += json.loads(data)["usage"]["completion_tokens"]
    joined = "".join(got)
    run.lost_chars += max(0, len(text) - len(joined)) + (0 if joined == text[: len(joined)] else 1)
    run.dup_chars += max(0, len(joined) - len(text))


async def drive(url: str, streams: int, text: str, resumes: int) -> Run:
    run = Run()
    limits = httpx.Limits(max_connections=streams + 50, max_keepalive_connections=streams + 50)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        start = time.monotonic()
        plan = [random.randint(2, 30) if i < resumes else None for i in range(streams)]
        await asyncio.gather(*(one_stream(client, text, run, d) for d in plan))
        run.wall_s = time.monotonic() - start
    return run


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def redis_memory(redis_url: str, prefix: str, rids: list[str]) -> tuple[float, float]:
    client = redis.Redis.from_url(redis_url)
    per_token, per_stream = [], []
    for rid in rids[:20]:
        log_key, meta_key = f"{prefix}:{{{rid}}}:log", f"{prefix}:{{{rid}}}:meta"
        log_bytes = client.memory_usage(log_key) or 0
        meta_bytes = client.memory_usage(meta_key) or 0
        tokens = client.xlen(log_key)
        if tokens:
            per_token.append(log_bytes / tokens)
            per_stream.append(log_bytes + meta_bytes)
    return statistics.median(per_token), statistics.median(per_stream)


def measure_idle(args: argparse.Namespace) -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * args.idle + 1000)), hard))
    redis_url = os.environ.get("LASTEVENT_REDIS_URL", "redis://127.0.0.1:6379/0")
    logs = Path(tempfile.mkdtemp(prefix="bench-idle-"))
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    with lastevent(args.model_dir, args.rate, redis_url, prefix, logs, 60,
                   scripted_prefill_s="3600", worker_concurrency=str(args.idle + 10)) as url:
        before, during = asyncio.run(idle_streams(url, args.idle, lastevent.api_pid))  # type: ignore[attr-defined]
    per_stream = (during - before) / args.idle
    print(f"| API RSS with {args.idle} idle streams | {during / 2**20:.0f} MiB "
          f"(before: {before / 2**20:.0f} MiB) | {per_stream / 1024:.1f} KiB per stream |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=50)
    parser.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream")
    parser.add_argument("--tokens", type=int, default=100, help="answer length (about)")
    parser.add_argument("--resumes", type=int, default=10, help="streams that drop and resume")
    parser.add_argument("--model-dir", type=Path, default=REPO / ".cache/models" / MODEL)
    parser.add_argument("--idle", type=int, default=0,
                        help="only measure API RSS per idle stream with this many open")
    args = parser.parse_args()
    if args.idle:
        measure_idle(args)
        return
    redis_url = os.environ.get("LASTEVENT_REDIS_URL", "redis://127.0.0.1:6379/0")
    text = " ".join(f"w{i}" for i in range(args.tokens // 2))  # ~2 tokens per word
    logs = Path(tempfile.mkdtemp(prefix="bench-"))
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    with baseline(args.model_dir, args.rate, logs) as url:
        base = asyncio.run(drive(url, args.streams, text, 0))
    print("baseline: done", flush=True)
    ttl_s = 5
    with lastevent(args.model_dir, args.rate, redis_url, prefix, logs, ttl_s) as url:
        le = asyncio.run(drive(url, args.streams, text, args.resumes))
        mem_token, mem_stream = redis_memory(redis_url, prefix, le.request_ids)
    print("lastevent: done", flush=True)
    time.sleep(ttl_s + 1)
    left = sum(1 for _ in redis.Redis.from_url(redis_url).scan_iter(f"{prefix}:{{*", count=1000))

    def row(name: str, b: float, l: float, unit: str) -> str:
        ratio = l / b if b and b == b and l == l else float("nan")
        return f"| {name} | {b:.1f} {unit} | {l:.1f} {unit} | {ratio:.2f} |"

    print(f"\n{args.streams} streams x {args.rate:g} tok/s, ~{args.tokens} tokens each; "
          f"{args.resumes} of lastevent's streams drop and resume; logs in {logs}\n")
    print("| metric | baseline (no Redis) | lastevent | lastevent / baseline |")
    print("| --- | --- | --- | --- |")
    print(row("delivered tokens/s", base.tokens / base.wall_s, le.tokens / le.wall_s, "tok/s"))
    for q, name in ((0.5, "p50"), (0.99, "p99")):
        print(row(f"time to first token {name}", pct(base.ttft_ms, q), pct(le.ttft_ms, q), "ms"))
    for q, name in ((0.5, "p50"), (0.99, "p99"), (1.0, "max")):
        print(row(f"added latency per token {name}", pct(base.added_ms, q), pct(le.added_ms, q),
                  "ms"))
    print(f"| resume latency p50 / p99 | n/a | {pct(le.resume_ms, 0.5):.1f} / "
          f"{pct(le.resume_ms, 0.99):.1f} ms | |")
    print(f"| lost / duplicated characters | n/a | {le.lost_chars} / {le.dup_chars} | |")
    print(f"| Redis memory per stored token / per finished stream | n/a | {mem_token:.0f} B / "
          f"{mem_stream / 1024:.1f} KiB | |")
    print(f"| per-request keys left {ttl_s} s after the TTL | n/a | {left} | |")


if __name__ == "__main__":
    main()
