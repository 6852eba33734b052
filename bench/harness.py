"""What durability costs: lastevent vs the no-Redis baseline, same clients, same engine.

Both systems run the scripted engine at ``--rate`` tokens/s per stream (so the engine
is not what is measured) and are driven by the same asyncio HTTP/SSE clients in this
process (``bench/clients.py``), at each concurrency of ``--streams``, one system after
the other. Reported for both, with lastevent / baseline: delivered tokens/s, time to
first token, added latency per token (receipt minus emit time), abort latency, lost
and duplicated characters; for lastevent also resume latency, Redis memory per stored
token and per finished stream, per-request keys left after the retention TTL, and
(``--idle``) API memory per open idle stream. Writes ``results.md``, ``results.json``
and PNG plots to ``--out``.

    make bench                                   # small: 50 and 200 streams, < 2 minutes
    .venv/bin/python -m bench.harness --streams 50,200,500 --tokens 200 --idle 1000,10000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import redis

from bench import report
from bench.clients import MODEL, Run, drive
from bench.common import free_port, start_roles, stop, wait_ok
from service.store.keys import Keys

REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def baseline(
    model_dir: Path, rate: float, logs: Path, prefill_s: float = 0.0
) -> Iterator[tuple[str, list[int]]]:
    port = free_port()
    with open(logs / "baseline.log", "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.baseline",
                "--port",
                str(port),
                "--model-dir",
                str(model_dir),
                "--tokens-per-s",
                str(rate),
                "--prefill-s",
                str(prefill_s),
            ],
            stdout=out,
            stderr=out,
        )
    try:
        wait_ok(f"http://127.0.0.1:{port}/aborts", [proc])
        yield f"http://127.0.0.1:{port}", [proc.pid]
    finally:
        stop([proc])


@contextlib.contextmanager
def lastevent(
    model_dir: Path, rate: float, redis_url: str, prefix: str, logs: Path, ttl_s: int, **extra: str
) -> Iterator[tuple[str, list[int]]]:
    """A worker process and an API process; yields (base url, [worker pid, API pid])."""
    port = free_port()
    env = {
        **os.environ,
        "LASTEVENT_REDIS_URL": redis_url,
        "LASTEVENT_MODEL_DIR": str(model_dir),
        "LASTEVENT_PORT": str(port),
        "LASTEVENT_KEY_PREFIX": prefix,
        "LASTEVENT_AUTH": "off",
        # the stream path as it was measured before durability levels (bench.durability
        # measures them): the local Redis has no AOF
        "LASTEVENT_DURABILITY": os.environ.get("LASTEVENT_DURABILITY", "memory"),
        "LASTEVENT_ENGINE": "scripted",
        "LASTEVENT_SCRIPTED_TOKENS_PER_S": str(rate),
        "LASTEVENT_WORKER_CONCURRENCY": "2000",
        "LASTEVENT_HOT_LOG_TTL_S": str(ttl_s),
        "LASTEVENT_MAX_STREAMS": "100000",
        **{f"LASTEVENT_{k.upper()}": v for k, v in extra.items()},
    }
    env.pop("LASTEVENT_DATABASE_URL", None)  # the stream path only, no ledger
    procs = start_roles(env, logs)
    try:
        wait_ok(f"http://127.0.0.1:{port}/healthz", procs)
        cluster = extra.get("redis_cluster") == "true"
        client = (redis.RedisCluster if cluster else redis.Redis).from_url(redis_url)
        while not client.hlen(Keys(prefix).workers):
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", [p.pid for p in procs]
    finally:
        stop(procs)


async def idle_streams(url: str, n: int, api_pid: int) -> tuple[int, int]:
    """Open ``n`` streams that stay idle (the engine is in a long prefill); return the API
    process's RSS before and with them open (bytes)."""
    import psutil

    api = psutil.Process(api_pid)
    before = api.memory_info().rss
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "idle"}]}
    async with contextlib.AsyncExitStack() as stack:
        # httpcore scans its whole pool on every request: one client per 100 streams
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=600))
            for _ in range(0, n, 100)
        ]
        for i in range(n):
            r = await stack.enter_async_context(
                clients[i // 100].stream("POST", "/v1/chat/completions", json=body)
            )
            if r.status_code != 200:
                raise RuntimeError(f"idle stream {i}: HTTP {r.status_code}")
            if i % 1000 == 999:
                print(f"  idle: {i + 1}/{n} streams open", file=sys.stderr, flush=True)
        await asyncio.sleep(3)  # leases refreshed, tailer settled
        during = api.memory_info().rss
    return before, during


def redis_memory(redis_url: str, prefix: str, rids: list[str]) -> tuple[float, float]:
    """Median bytes per completion token stored, and per finished stream (log + meta)."""
    client = redis.Redis.from_url(redis_url)
    per_token, per_stream = [], []
    for rid in rids:
        log_key, meta_key = Keys(prefix).log(rid), Keys(prefix).meta(rid)
        log_bytes = client.memory_usage(log_key, samples=0) or 0
        meta_bytes = client.memory_usage(meta_key, samples=0) or 0
        last = client.xrevrange(log_key, count=1)
        if not log_bytes or not last:
            continue
        from service.stream import events as ev

        end = ev.decode(last[0][1][b"e"])
        if isinstance(end, ev.End) and end.completion_tokens:
            per_token.append(log_bytes / end.completion_tokens)
            per_stream.append(log_bytes + meta_bytes)
    if not per_token:
        return float("nan"), float("nan")
    return statistics.median(per_token), statistics.median(per_stream)


@contextlib.contextmanager
def cpu_seconds(pids: list[int], redis_url: str | None) -> Iterator[dict[str, float]]:
    """CPU seconds spent meanwhile by: these processes, Redis (if given), this client."""
    import psutil

    procs = [psutil.Process(p) for p in pids]
    names = ["server"] if len(pids) == 1 else ["worker", "api"]

    def redis_cpu() -> float:
        if redis_url is None:
            return 0.0
        info = redis.Redis.from_url(redis_url).info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    def sample() -> list[float]:
        return [sum(p.cpu_times()[:2]) for p in procs] + [redis_cpu(), time.process_time()]

    out: dict[str, float] = {}
    before = sample()
    yield out
    after = sample()
    for name, b, a in zip([*names, "redis", "client"], before, after, strict=True):
        if redis_url is not None or name != "redis":
            out[name] = a - b


def answer_text(model_dir: Path, tokens: int) -> str:
    """Words the scripted engine echoes back as about ``tokens`` tokens (then EOS)."""
    from service.tokenize import ModelInfo

    model = ModelInfo.load(model_dir)
    words: list[str] = []
    while len(model.encode(" ".join(words))) < tokens:
        words.append(f"w{len(words)}")
    return " ".join(words)


def raise_fd_limit(n: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n)), hard))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--streams",
        default="50,200",
        help="concurrent streams, comma-separated (the last is the headline)",
    )
    parser.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream")
    parser.add_argument("--tokens", type=int, default=100, help="answer length (about)")
    parser.add_argument("--resumes", type=int, default=10, help="streams that drop and resume")
    parser.add_argument("--aborts", type=int, default=10, help="streams cancelled part way")
    parser.add_argument("--idle", default="", help="API RSS per idle stream at these counts")
    parser.add_argument("--model-dir", type=Path, default=REPO / ".cache/models" / MODEL)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    args = parser.parse_args()
    levels = [int(n) for n in args.streams.split(",") if n]
    idle = [int(n) for n in args.idle.split(",") if n]
    raise_fd_limit(4 * max([*levels, *idle]) + 1000)
    if not (args.model_dir / "tokenizer.json").exists():
        from service.cli.model import prepare_model

        prepare_model(args.model_dir)
    with contextlib.ExitStack() as stack:
        redis_url = os.environ.get("LASTEVENT_REDIS_URL") or stack.enter_context(local_redis())
        run_all(args, levels, idle, redis_url)


@contextlib.contextmanager
def local_redis() -> Iterator[str]:
    """The Redis on 127.0.0.1:6379 if one answers, else an embedded Valkey for the run."""
    from service.cli.embedded import EmbeddedRedis, answers

    if answers("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0"
        return
    server = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="bench-redis-")))
    print("no Redis on 127.0.0.1:6379: using an embedded Valkey", file=sys.stderr)
    try:
        yield server.start()
    finally:
        server.stop()


def run_all(args: argparse.Namespace, levels: list[int], idle: list[int], redis_url: str) -> None:
    text = answer_text(args.model_dir, args.tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    ttl_s = 10
    started = time.monotonic()
    base_runs: dict[int, Run] = {}
    le_runs: dict[int, Run] = {}
    with baseline(args.model_dir, args.rate, logs) as (url, pids):
        for n in levels:
            with cpu_seconds(pids, None) as cpu:
                base_runs[n] = asyncio.run(drive(url, "baseline", n, text, aborts=args.aborts))
            base_runs[n].cpu_s = cpu
    with lastevent(args.model_dir, args.rate, redis_url, prefix, logs, ttl_s) as (url, pids):
        for n in levels:
            with cpu_seconds(pids, redis_url) as cpu:
                le_runs[n] = asyncio.run(
                    drive(url, "lastevent", n, text, drops=args.resumes, aborts=args.aborts)
                )
            le_runs[n].cpu_s = cpu
            if n == levels[-1]:  # the last 20 to finish: still well inside the TTL
                plain = le_runs[n].request_ids[-20:]
                mem_token, mem_stream = redis_memory(redis_url, prefix, plain)
        ended = time.monotonic()
    idle_rows: list[tuple[str, str]] = []
    for n in idle:
        with baseline(args.model_dir, args.rate, logs, prefill_s=3600) as (url, pids):
            b_before, b_during = asyncio.run(idle_streams(url, n, pids[0]))
        with lastevent(
            args.model_dir,
            args.rate,
            redis_url,
            f"{prefix}i",
            logs,
            60,
            scripted_prefill_s="3600",
            worker_concurrency=str(n + 10),
        ) as (url, pids):
            before, during = asyncio.run(idle_streams(url, n, pids[-1]))
        idle_rows.append(
            (
                f"{(b_during - b_before) / n / 1024:.1f} KiB ({b_before / 2**20:.0f} -> "
                f"{b_during / 2**20:.0f} MiB)",
                f"{(during - before) / n / 1024:.1f} KiB ({before / 2**20:.0f} -> "
                f"{during / 2**20:.0f} MiB) | "
                f"{(during - before) / max(b_during - b_before, 1):.2f}",
            )
        )
    time.sleep(max(0.0, ttl_s + 2 - (time.monotonic() - ended)))
    left = sum(
        1 for _ in redis.Redis.from_url(redis_url).scan_iter(f"{prefix}:{{*}}:r:*", count=1000)
    )

    runs = {n: (base_runs[n], le_runs[n]) for n in levels}
    top = levels[-1]
    extra = {
        "Redis memory per stored token / per finished stream": (
            f"{mem_token:.0f} B / {mem_stream / 1024:.1f} KiB"
        ),
        f"per-request keys left {ttl_s} s after the TTL": str(left),
    }
    idle_table = [
        f"| server RSS per open idle stream, {n} streams | {b} | {le} |"
        for n, (b, le) in zip(idle, idle_rows, strict=True)
    ]
    command = " ".join(["python -m bench.harness", *sys.argv[1:]])
    heading = (
        f"{top} streams x {args.rate:g} tok/s, ~{args.tokens} tokens each; "
        f"{args.resumes} of lastevent's streams drop and resume, {args.aborts} of each "
        f"system's are aborted part way. Command: `{command}`"
    )
    md = "\n\n".join(
        [
            heading,
            "\n".join([report.main_table(*runs[top], extra), *idle_table]),
            "Throughput vs concurrency:",
            report.sweep_table(runs, args.rate),
            "Where the CPU goes (all of it on one 2-core machine):",
            report.cpu_table(runs),
        ]
    )
    (args.out / "results.md").write_text(md + "\n")
    (args.out / "results.json").write_text(report.summary_json(runs))
    pngs = report.plots(runs, args.rate, args.out)
    print("\n" + md + "\n")
    print(
        f"wrote {args.out / 'results.md'}, results.json, "
        f"{', '.join(p.name for p in pngs)}; logs in {logs}; "
        f"took {time.monotonic() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
