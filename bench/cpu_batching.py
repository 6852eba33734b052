"""The embedded CPU engine, batched vs one request at a time, from outside.

``make run``'s stack (one API process, one worker with the CPU engine and the bundled
SmolLM2-135M-Instruct, the local Redis and a fresh Postgres database), twice: with
``LASTEVENT_CPU_MAX_BATCH=8`` (batched) and ``=1`` (one at a time, the engine before
batching). For 1, 2, 4 and 8 concurrent clients, each streaming a greedy chat of exactly
64 tokens (``ignore_eos``), sent together: every client's time to first token, the time
until the last one ended, and the aggregate tokens per second. The two stacks run in
turn, round after round (A B A B), and the figures are medians over the rounds; ratios
are to a lone request of the same engine in the same run.

    python -m bench.cpu_batching [--rounds 3] [--concurrency 1 2 4 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from bench.takeover import local_postgres
from service.cli.model import is_prepared, prepare_model
from service.settings import Settings
from tests.conftest import migrated_database
from tests.e2e.conftest import Stack, make_stack

QUESTIONS = [
    "Describe a walk through an old city at dawn.",
    "Explain how a bicycle stays upright.",
    "Write about the smell of rain on hot stone.",
    "Tell the story of a lost umbrella.",
    "What makes a good cup of tea?",
    "Describe the sea in winter.",
    "How do bees find their way home?",
    "Write a letter from a lighthouse keeper.",
]


async def one_chat(
    client: httpx.AsyncClient, url: str, model: str, q: str, n: int
) -> dict[str, float]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": q}],
        "stream": True,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
    }
    started = time.perf_counter()
    first = None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if first is None and line.startswith("data: {") and _text(line[6:]):
                first = time.perf_counter()
    ended = time.perf_counter()
    return {"ttft": (first or ended) - started, "end": ended - started}


def _text(chunk: str) -> str:
    """A chunk's content (the first chunk says the role, with no text)."""
    choices = json.loads(chunk).get("choices") or [{}]
    return str((choices[0].get("delta") or {}).get("content") or "")


async def burst(url: str, model: str, c: int, n: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=600) as client:
        started = time.perf_counter()
        done = await asyncio.gather(
            *(one_chat(client, url, model, QUESTIONS[i % len(QUESTIONS)], n) for i in range(c))
        )
        took = time.perf_counter() - started
    return {
        "ttft": sorted(d["ttft"] for d in done),
        "last_end": took,
        "tokens_per_s": c * n / took,
    }


def stack_of(tmp: Path, redis_url: str, db: str, model_dir: Path, batch: int, chunk: int) -> Stack:
    return make_stack(
        tmp / f"batch{batch}",
        redis_url,
        db,
        model_dir,
        engine="cpu",
        cpu_max_batch=batch,
        cpu_prefill_chunk=chunk,
        worker_concurrency=8,
    )


def run(args: argparse.Namespace) -> dict[str, dict[int, list[dict[str, Any]]]]:
    model_dir = Settings().resolved_model_dir
    if not is_prepared(model_dir):
        prepare_model(model_dir)
    results: dict[str, dict[int, list[dict[str, Any]]]] = {"batched": {}, "one at a time": {}}
    with ExitStack() as stack:
        admin = stack.enter_context(local_postgres())
        db = stack.enter_context(migrated_database(admin))
        stacks = {
            "batched": stack_of(
                args.out, args.redis_url, db, model_dir, args.max_batch, args.prefill_chunk
            ),
            "one at a time": stack_of(args.out, args.redis_url, db, model_dir, 1, 1 << 20),
        }
        for st in stacks.values():
            stack.callback(st.stop)
            st.start_worker()
            st.start_api()
        for st in stacks.values():  # warm up: the first requests load caches
            asyncio.run(burst(st.url, st.model, 2, 8))
        for r in range(args.rounds):
            for c in args.concurrency:
                for name, st in stacks.items():
                    print(f"round {r + 1}: {name}, {c} at once ...", file=sys.stderr, flush=True)
                    got = asyncio.run(burst(st.url, st.model, c, args.tokens))
                    results[name].setdefault(c, []).append(got)
    return results


def table(results: dict[str, dict[int, list[dict[str, Any]]]], args: argparse.Namespace) -> str:
    med = statistics.median
    lone = {
        name: (
            med(r["ttft"][0] for r in per[1]) if 1 in per else float("nan"),
            med(r["tokens_per_s"] for r in per[1]) if 1 in per else float("nan"),
        )
        for name, per in results.items()
    }
    lines = [
        "| engine | clients | TTFT p50 / max (s) | last TTFT / lone TTFT | last ends (s) "
        "| tokens/s (all) | / lone request's |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in args.concurrency:
        for name, per in results.items():
            rounds = per[c]
            p50 = med(med(r["ttft"]) for r in rounds)
            top = med(r["ttft"][-1] for r in rounds)
            ends = med(r["last_end"] for r in rounds)
            rate = med(r["tokens_per_s"] for r in rounds)
            lines.append(
                f"| {name} | {c} | {p50:.2f} / {top:.2f} | {top / lone[name][0]:.1f}x "
                f"| {ends:.1f} | {rate:.1f} | {rate / lone[name][1]:.2f}x |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8, help="the batched engine's")
    parser.add_argument(
        "--prefill-chunk", type=int, default=Settings().cpu_prefill_chunk, help="the batched's"
    )
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if 1 not in args.concurrency:
        args.concurrency = [1, *args.concurrency]
    results = run(args)
    text = table(results, args)
    head = (
        f"{args.tokens} greedy tokens per client, {args.rounds} rounds, medians; "
        f"batched = LASTEVENT_CPU_MAX_BATCH={args.max_batch} (prefill chunk "
        f"{args.prefill_chunk}), one at a time = 1"
    )
    print(f"\n{head}\n\n{text}")
    (args.out / "cpu_batching.md").write_text(f"{head}\n\n{text}\n")
    (args.out / "cpu_batching.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
