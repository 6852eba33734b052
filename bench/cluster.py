"""One Redis node vs a Redis Cluster, the same lastevent stack and clients, side by side.

The stack (a worker and an API process, the scripted engine at ``--rate`` tokens/s per
stream) runs first on one Redis node (the local one, else an embedded Valkey), then on a
local cluster of three primaries and three replicas (``tests/cluster.py``) with
``LASTEVENT_REDIS_CLUSTER=true`` and ``--partitions``. The same clients (``bench/clients.py``)
drive both at each concurrency of ``--streams``. Reported: delivered tokens/s, time to
first token, added latency per token, resume latency, and the CPU Redis spent per 1,000
delivered tokens (on the cluster: its primaries, and all six nodes with the replicas'
replication work), with cluster / one node ratios.

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


def table(
    one: dict[int, tuple[Run, dict[str, float]]], many: dict[int, tuple[Run, dict[str, float]]]
) -> str:
    rows = [
        "| streams | metric | one node | cluster | cluster / one node |",
        "| --- | --- | --- | --- | --- |",
    ]

    def row(n: int, name: str, a: float, b: float, unit: str) -> None:
        ratio = f"{b / a:.2f}" if a else "n/a"
        rows.append(f"| {n} | {name} | {a:.1f} {unit} | {b:.1f} {unit} | {ratio} |")

    for n in sorted(one):
        (r1, c1), (r2, c2) = one[n], many[n]
        row(n, "delivered tokens/s", r1.tokens_per_s, r2.tokens_per_s, "tok/s")
        row(n, "time to first token p50", pct(r1.ttft_ms, 0.5), pct(r2.ttft_ms, 0.5), "ms")
        row(n, "time to first token p99", pct(r1.ttft_ms, 0.99), pct(r2.ttft_ms, 0.99), "ms")
        row(n, "added latency per token p50", pct(r1.added_ms, 0.5), pct(r2.added_ms, 0.5), "ms")
        row(n, "added latency per token p99", pct(r1.added_ms, 0.99), pct(r2.added_ms, 0.99), "ms")
        row(n, "resume latency p50", pct(r1.resume_ms, 0.5), pct(r2.resume_ms, 0.5), "ms")
        one_cpu = _ms_per_1k(c1["all"], r1)
        row(
            n,
            "Redis CPU per 1,000 tokens (primaries)",
            one_cpu,
            _ms_per_1k(c2["primaries"], r2),
            "ms",
        )
        row(n, "Redis CPU per 1,000 tokens (all nodes)", one_cpu, _ms_per_1k(c2["all"], r2), "ms")
        rows.append(
            f"| {n} | failed streams / lost / duplicated chars | {r1.errors} / {r1.lost_chars} / "
            f"{r1.dup_chars} | {r2.errors} / {r2.lost_chars} / {r2.dup_chars} | |"
        )
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
        many = measure(
            "cluster",
            cluster.url,
            pids,
            args,
            text,
            logs,
            redis_cluster="true",
            partitions=str(args.partitions),
        )
    command = " ".join(["python -m bench.cluster", *sys.argv[1:]])
    md = (
        f"One Redis node vs a Redis Cluster (3 primaries + 3 replicas, {args.partitions} "
        f"partitions), {args.rate:g} tok/s per stream, ~{args.tokens} tokens, {args.resumes} "
        f"streams drop and resume. Command: `{command}`\n\n{table(one, many)}\n"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cluster.md").write_text(md)
    print("\n" + md)
    print(f"wrote {args.out / 'cluster.md'}; took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
