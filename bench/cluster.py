"""One Redis node vs a Redis Cluster, the same lastevent stack and clients, side by side.

The stack (a worker and an API process, the scripted engine at ``--rate`` tokens/s per
stream) runs first on one Redis node (the local one, else an embedded Valkey), then on a
local cluster of three primaries and three replicas (``tests/cluster.py``) with
``LASTEVENT_REDIS_CLUSTER=true`` and ``--partitions``. The same clients (``bench/clients.py``)
drive both at each concurrency of ``--streams``. Reported: delivered tokens/s, time to
first token, added latency per token, resume latency, and the CPU Redis spent per 1,000
delivered tokens (on the cluster: its primaries, and all six nodes with the replicas'
replication work), with cluster / one node ratios; then the cluster again at
``LASTEVENT_DURABILITY=replica`` (readers sent what a replica acknowledged), with its
ratio to the cluster at ``memory``.

Everything runs on this one machine, so a cluster's six servers share its cores with the
stack and the clients: the CPU per token is the comparable figure, not the throughput.

    make bench-cluster
    .venv/bin/python -m bench.cluster --streams 50,200 --partitions 6
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil

from bench.clients import MODEL, Run, drive
from bench.harness import REPO, answer_text, lastevent, local_redis, raise_fd_limit
from bench.report import pct
from tests.cluster import LocalCluster


def _cpu(pid: int) -> float:
    return float(sum(psutil.Process(pid).cpu_times()[:2]))


@contextlib.contextmanager
def redis_cpu(pids: list[int]) -> Iterator[dict[str, float]]:
    """CPU seconds these Redis processes spent meanwhile, in all."""
    out: dict[str, float] = {}
    before = sum(_cpu(p) for p in pids)
    yield out
    out["redis"] = sum(_cpu(p) for p in pids) - before


def _node_pid(url: str) -> int:
    import redis

    return int(redis.Redis.from_url(url).info("server")["process_id"])


def measure(
    label: str,
    url: str,
    redis_pids: dict[str, list[int]],
    args: argparse.Namespace,
    text: str,
    logs: Path,
    **extra: str,
) -> dict[int, tuple[Run, dict[str, float]]]:
    out: dict[int, tuple[Run, dict[str, float]]] = {}
    prefix = f"bc{uuid.uuid4().hex[:6]}"
    with lastevent(args.model_dir, args.rate, url, prefix, logs, 10, **extra) as (base, _pids):
        for n in args.levels:
            with contextlib.ExitStack() as stack:
                cpus = {k: stack.enter_context(redis_cpu(p)) for k, p in redis_pids.items()}
                run = asyncio.run(drive(base, label, n, text, drops=args.resumes, aborts=0))
            out[n] = (run, {k: v["redis"] for k, v in cpus.items()})
    return out


def _ms_per_1k(seconds: float, run: Run) -> float:
    return seconds / max(run.tokens, 1) * 1000 * 1000


Measured = dict[int, tuple[Run, dict[str, float]]]


def table(one: Measured, many: Measured, committed: Measured) -> str:
    rows = [
        "| streams | metric | one node | cluster | cluster, `replica` | cluster / one node "
        "| `replica` / cluster |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def row(n: int, name: str, values: list[float], unit: str) -> None:
        a, b, c = values
        ratios = [f"{y / x:.2f}" if x else "n/a" for x, y in ((a, b), (b, c))]
        rows.append(
            f"| {n} | {name} | {a:.1f} {unit} | {b:.1f} {unit} | {c:.1f} {unit} | "
            f"{ratios[0]} | {ratios[1]} |"
        )

    for n in sorted(one):
        runs = [one[n][0], many[n][0], committed[n][0]]
        cpus = [one[n][1], many[n][1], committed[n][1]]
        row(n, "delivered tokens/s", [r.tokens_per_s for r in runs], "tok/s")
        for q in (0.5, 0.99):
            p = f"p{int(q * 100)}"
            row(n, f"time to first token {p}", [pct(r.ttft_ms, q) for r in runs], "ms")
            row(n, f"inter-token latency {p}", [pct(r.itl_ms, q) for r in runs], "ms")
            row(n, f"added latency per token {p}", [pct(r.added_ms, q) for r in runs], "ms")
        row(n, "resume latency p50", [pct(r.resume_ms, 0.5) for r in runs], "ms")
        pairs = list(zip(runs, cpus, strict=True))
        primaries = [_ms_per_1k(c.get("primaries", c["all"]), r) for r, c in pairs]
        row(n, "Redis CPU per 1,000 tokens (primaries)", primaries, "ms")
        every = [_ms_per_1k(c["all"], r) for r, c in pairs]
        row(n, "Redis CPU per 1,000 tokens (all nodes)", every, "ms")
        failed = " | ".join(f"{r.errors} / {r.lost_chars} / {r.dup_chars}" for r in runs)
        rows.append(f"| {n} | failed streams / lost / duplicated chars | {failed} | | |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="50,200", help="concurrent streams, comma-separated")
    parser.add_argument("--rate", type=float, default=20.0, help="tokens/s per stream")
    parser.add_argument("--tokens", type=int, default=100, help="answer length (about)")
    parser.add_argument("--resumes", type=int, default=10, help="streams that drop and resume")
    parser.add_argument(
        "--partitions", type=int, default=6, help="LASTEVENT_PARTITIONS on the cluster"
    )
    parser.add_argument("--model-dir", type=Path, default=REPO / ".cache/models" / MODEL)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    args = parser.parse_args()
    args.levels = [int(n) for n in args.streams.split(",") if n]
    raise_fd_limit(4 * max(args.levels) + 1000)
    if not (args.model_dir / "tokenizer.json").exists():
        from service.cli.model import prepare_model

        prepare_model(args.model_dir)
    text = answer_text(args.model_dir, args.tokens)
    logs = args.out / "logs-cluster"
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        url = os.environ.get("LASTEVENT_REDIS_URL") or stack.enter_context(local_redis())
        one = measure("one node", url, {"all": [_node_pid(url)]}, args, text, logs)
        cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="bench-cluster-"))).start()
        stack.callback(cluster.stop)
        pids = {
            "primaries": [n.proc.pid for n in cluster.primaries if n.proc],
            "all": [n.proc.pid for n in cluster.nodes if n.proc],
        }
        on_cluster = {"redis_cluster": "true", "partitions": str(args.partitions)}
        many = measure("cluster", cluster.url, pids, args, text, logs, **on_cluster)
        committed = measure(
            "cluster replica",
            cluster.url,
            pids,
            args,
            text,
            logs,
            durability="replica",
            **on_cluster,
        )
    command = " ".join(["python -m bench.cluster", *sys.argv[1:]])
    md = (
        f"One Redis node vs a Redis Cluster (3 primaries + 3 replicas, {args.partitions} "
        f"partitions), {args.rate:g} tok/s per stream, ~{args.tokens} tokens, {args.resumes} "
        f"streams drop and resume; the cluster at `memory`, then at `replica` (readers are "
        f"sent what a replica acknowledged). Command: `{command}`\n\n"
        f"{table(one, many, committed)}\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster.md").write_text(md)
    print("\n" + md)
    print(f"wrote {args.out / 'cluster.md'}; took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
