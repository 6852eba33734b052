"""TTFT and inter-token latency: vLLM's own OpenAI server vs lastevent with a vLLM worker.

Same model, same engine settings, same prompts and concurrency, one after the other
on this machine. Prints medians / p99s for both and the ratio lastevent / vLLM.

    make bench-vllm            # or: .venv-vllm/bin/python -m bench.vllm_compare --help

Needs the vLLM venv (`make test-vllm` creates it) and a Redis (LASTEVENT_REDIS_URL,
default redis://127.0.0.1:6379/0, else an embedded Valkey is started).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.common import free_port, start_roles, stop, wait_ok

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


@contextlib.contextmanager
def vllm_server(model_dir: Path, log: Path) -> Iterator[str]:
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
        yield f"http://127.0.0.1:{port}"
    finally:
        stop([proc])


@contextlib.contextmanager
def lastevent_stack(model_dir: Path, redis_url: str, logs: Path) -> Iterator[str]:
    port = free_port()
    env = {
        **os.environ,
        **ENGINE_ENV,
        "LASTEVENT_REDIS_URL": redis_url,
        "LASTEVENT_MODEL_DIR": str(model_dir),
        "LASTEVENT_PORT": str(port),
        "LASTEVENT_KEY_PREFIX": f"bench{uuid.uuid4().hex[:6]}",
        "LASTEVENT_ENGINE": "vllm",
        "LASTEVENT_VLLM_DTYPE": "float32",
        "LASTEVENT_VLLM_ENFORCE_EAGER": "true",
        "LASTEVENT_VLLM_KV_CACHE_GB": "1",
        "LASTEVENT_VLLM_MAX_MODEL_LEN": "2048",
        "LASTEVENT_WORKER_CONCURRENCY": "64",
        "LASTEVENT_AUTH": "off",  # no ledger, so no API keys (the API refuses to start else)
        "LASTEVENT_DURABILITY": os.environ.get("LASTEVENT_DURABILITY", "memory"),
    }
    env.pop("LASTEVENT_DATABASE_URL", None)  # no ledger: measure the stream path only
    procs = start_roles(env, logs)
    try:
        wait_ok(f"http://127.0.0.1:{port}/healthz", procs)
        deadline = time.monotonic() + 300
        while b"ready (engine vllm)" not in (logs / "worker.log").read_bytes():
            if procs[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((logs / "worker.log").read_text()[-3000:])
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(procs)


async def one_request(
    client: httpx.AsyncClient, prompt: str, max_tokens: int
) -> tuple[float, list[float]]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "stream": True,
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
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    ttft = arrivals[0] - start
    return ttft, [b - a for a, b in itertools.pairwise(arrivals)]


async def load(
    url: str, concurrency: int, per_client: int, max_tokens: int
) -> dict[str, list[float]]:
    ttfts: list[float] = []
    itls: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await one_request(client, "warm up", 8)

        async def client_loop(i: int) -> None:
            for j in range(per_client):
                ttft, gaps = await one_request(client, PROMPTS[(i + j) % len(PROMPTS)], max_tokens)
                ttfts.append(ttft)
                itls.extend(gaps)

        await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
    return {"ttft": ttfts, "itl": itls}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def table(results: dict[int, dict[str, dict[str, list[float]]]]) -> str:
    rows = [
        "| concurrency | metric | vLLM server (ms) | lastevent (ms) | lastevent / vLLM |",
        "| --- | --- | --- | --- | --- |",
    ]
    for c, by_system in results.items():
        for metric in ("ttft", "itl"):
            for name, q in (("p50", 0.5), ("p99", 0.99)):
                v = pct(by_system["vllm"][metric], q)
                le = pct(by_system["lastevent"][metric], q)
                rows.append(
                    f"| {c} | {metric.upper()} {name} | {v:.1f} | {le:.1f} | {le / v:.2f} |"
                )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=Path(__file__).resolve().parents[1] / ".cache/models" / MODEL,
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--per-client", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    redis_url = os.environ.get("LASTEVENT_REDIS_URL", "redis://127.0.0.1:6379/0")
    logs = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    results: dict[int, dict[str, dict[str, list[float]]]] = {c: {} for c in args.concurrency}
    with vllm_server(args.model_dir, logs / "vllm-server.log") as url:
        for c in args.concurrency:
            results[c]["vllm"] = asyncio.run(load(url, c, args.per_client, args.max_tokens))
            print(f"vLLM server, concurrency {c}: done", flush=True)
    with lastevent_stack(args.model_dir, redis_url, logs) as url:
        for c in args.concurrency:
            results[c]["lastevent"] = asyncio.run(load(url, c, args.per_client, args.max_tokens))
            print(f"lastevent, concurrency {c}: done", flush=True)
    print()
    print(table(results))
    print(f"\n{args.per_client} requests per client, max_tokens {args.max_tokens}; logs in {logs}")


if __name__ == "__main__":
    main()
