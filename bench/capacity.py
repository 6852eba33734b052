"""Capacity model: what N concurrent streams need of lastevent's front end, from the
measured per-token costs in docs/benchmarks.md (docs/capacity.md explains every input).

Pure arithmetic, no servers. Every default is a measured figure; pass your own.

    .venv/bin/python -m bench.capacity                          # 10,000 and 1,000,000 streams
    .venv/bin/python -m bench.capacity --streams 50000 --tokens-per-s 30 --answer-tokens 800
    .venv/bin/python -m bench.capacity --mode node --hot-log-ttl-s 600

Not modelled: the engines' GPUs (one worker process per engine; how many streams a GPU
carries is the engine's business), the load balancer, TLS, Postgres's own capacity.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

KIB = 1024
GB = 1e9


def _in(default: Any, help_text: str) -> Any:
    """An input: its default and, for ``--help``, what it is and where it was measured."""
    return dataclasses.field(default=default, metadata={"help": help_text})


@dataclasses.dataclass(frozen=True)
class Inputs:
    """One field per input; units in the names. Defaults: docs/capacity.md, "Inputs"."""

    tokens_per_s: float = _in(50.0, "per stream, while it generates")
    answer_tokens: int = _in(500, "completion tokens per request")
    mode: str = _in("split", "split: API processes + workers; node: both in one process")
    # CPU ms per 1,000 delivered tokens (benchmarks.md)
    api_ms: float = _in(60.0, "API process, 500 streams x 20 tok/s (make bench, issue 32)")
    worker_ms: float = _in(94.0, "worker outside the engine core, vLLM, 128 clients (issue 44)")
    redis_ms: float = _in(22.0, "one Redis node, 500 streams x 20 tok/s (make bench, issue 32)")
    node_factor: float = _in(0.83, "node / (API + worker) CPU, 128 clients (issue 44: 182 / 220)")
    node_redis_factor: float = _in(0.82, "node's Redis / split's Redis, 128 clients (51 / 62)")
    cluster_factor: float = _in(1.5, "primaries' CPU in a cluster / one node's (issue 17)")
    replica_factor: float = _in(0.34, "a replica's CPU / its primary's (issue 17, 200 streams)")
    utilisation: float = _in(0.6, "the share of a core (or a shard) planned busy")
    # memory
    api_stream_kib: float = _in(25.2, "API RSS per open stream, 10,000 streams (issue 7)")
    api_base_mib: float = _in(114.0, "API RSS with no stream open (issue 7)")
    api_max_streams: int = _in(10_000, "open streams per API process, measured (issue 7)")
    log_token_b: float = _in(42.0, "Redis bytes per stored token, 200-token answers (2026-12-05)")
    log_fixed_b: float = _in(300.0, "a log's bytes besides its tokens (8.5 KiB - 200 x 42 B)")
    hot_log_ttl_s: float = _in(3600.0, "LASTEVENT_HOT_LOG_TTL_S: a finished log stays this long")
    outbox_entry_b: float = _in(248.0, "Redis bytes per outbox entry (MEMORY USAGE, 100k entries)")
    outbox_retention_s: float = _in(7 * 86400.0, "LASTEVENT_OUTBOX_RETENTION_S")
    shard_gb: float = _in(25.0, "memory one Redis shard is given")
    shard_memory_use: float = _in(0.75, "of it, for data (the rest: AOF rewrite, fragmentation)")
    # Redis commands per delivered token
    redis_calls_per_token: float = _in(0.19, "EVALSHA + XREAD sent (commandstats, 32 clients)")
    redis_commands_per_token: float = _in(5.1, "every command run (INFO, 400 streams, 2026-12-05)")
    # network bytes per delivered token
    event_b: float = _in(255.0, "one SSE event of one token (chat chunk + id line)")
    wire_overhead_b: float = _in(90.0, "TCP/IP + TLS record per event sent alone")
    redis_in_b: float = _in(612.0, "into Redis per token (INFO, 400 streams, 2026-12-05)")
    redis_out_b: float = _in(270.0, "out of Redis per token (the same run)")
    # Postgres
    stored_share: float = _in(1.0, "requests archived (store: true): one more row each")
    postgres_tx_per_s: float = _in(10_000.0, "ASSUMED, not measured: commits one primary takes")
    cluster_max_primaries: int = _in(500, "Redis Cluster: 1,000 nodes at most, one replica each")


@dataclasses.dataclass(frozen=True)
class Line:
    group: str
    name: str
    formula: str
    value: float
    unit: str


def _load(i: Inputs, streams: float) -> list[Line]:
    tok = streams * i.tokens_per_s
    ended = tok / i.answer_tokens
    return [
        Line("load", "tokens delivered", "R = S x r", tok, "tok/s"),
        Line("load", "requests ended", "Q = R / L", ended, "req/s"),
        Line("load", "answer lasts", "L / r", i.answer_tokens / i.tokens_per_s, "s"),
    ]


def _cpu(i: Inputs, streams: float) -> list[Line]:
    tok = streams * i.tokens_per_s
    u = i.utilisation
    if i.mode == "node":
        node = tok * (i.api_ms + i.worker_ms) * i.node_factor / 1e6
        per_node = u * 1e6 / ((i.api_ms + i.worker_ms) * i.node_factor * i.tokens_per_s)
        return [
            Line("cpu", "node cores (busy)", "R x (a + w) x n / 1e6", node, "cores"),
            Line("cpu", "streams per node process", "u / (r x (a + w) x n / 1e6)", per_node, ""),
            Line("cpu", "node processes", "ceil(cores / u)", math.ceil(node / u), ""),
        ]
    api = tok * i.api_ms / 1e6
    api_procs = max(math.ceil(api / u), math.ceil(streams / i.api_max_streams))
    worker = tok * i.worker_ms / 1e6
    per_worker = u * 1e6 / (i.worker_ms * i.tokens_per_s)
    return [
        Line("cpu", "API cores (busy)", "R x a / 1e6", api, "cores"),
        Line("cpu", "API processes", "max(ceil(cores / u), S / 10,000)", api_procs, ""),
        Line("cpu", "worker front-end cores (busy)", "R x w / 1e6", worker, "cores"),
        Line("cpu", "streams per worker at u", "u / (r x w / 1e6)", per_worker, ""),
        Line("cpu", "workers (engines) at least", "ceil(cores / u)", math.ceil(worker / u), ""),
    ]


def _redis_cores(i: Inputs, tok: float) -> float:
    """Redis CPU for ``tok`` tokens a second, all on one node."""
    factor = i.node_redis_factor if i.mode == "node" else 1.0
    return tok * i.redis_ms * factor / 1e6


def _redis_bytes(i: Inputs, streams: float) -> tuple[float, float, float]:
    """(open logs, finished logs kept for the TTL, outbox entries kept for the retention)."""
    ended = streams * i.tokens_per_s / i.answer_tokens
    live = streams * (i.log_fixed_b + i.log_token_b * i.answer_tokens / 2)
    hot = ended * i.hot_log_ttl_s * (i.log_fixed_b + i.log_token_b * i.answer_tokens)
    return live, hot, ended * i.outbox_retention_s * i.outbox_entry_b


def _redis(i: Inputs, streams: float) -> list[Line]:
    tok = streams * i.tokens_per_s
    one_node = _redis_cores(i, tok)
    fits = one_node <= i.utilisation
    by_cpu = 1 if fits else math.ceil(one_node * i.cluster_factor / i.utilisation)
    live, hot, outbox = _redis_bytes(i, streams)
    total = live + hot + outbox
    by_mem = math.ceil(total / (i.shard_gb * GB * i.shard_memory_use))
    n = max(by_cpu, by_mem)
    each = (one_node if n == 1 else one_node * i.cluster_factor) / n
    rows = [
        ("CPU, all on one node", "R x d / 1e6", one_node, "cores"),
        ("shards by CPU", "ceil(cores x c / u) (1 if one node fits)", by_cpu, ""),
        ("memory: open logs", "S x (f + b x L / 2)", live / GB, "GB"),
        ("memory: finished logs", "Q x TTL x (f + b x L)", hot / GB, "GB"),
        ("memory: outbox", "Q x retention x e", outbox / GB, "GB"),
        ("memory in all", "sum", total / GB, "GB"),
        ("shards by memory", "ceil(GB / (M x m))", by_mem, ""),
        ("primaries", "max(by CPU, by memory)", n, ""),
        ("CPU per primary", "cores x c / primaries", each, "cores"),
        ("memory per primary", "GB / primaries", total / GB / n, "GB"),
        ("replica CPU each", "CPU per primary x p", each * i.replica_factor, "cores"),
        ("calls sent per primary", "R x k / primaries", tok * i.redis_calls_per_token / n, "/s"),
        (
            "commands run per primary",
            "R x K / primaries",
            tok * i.redis_commands_per_token / n,
            "/s",
        ),
        (
            "network per primary, in + out",
            "R x (ri + ro) x 8 / primaries",
            tok * (i.redis_in_b + i.redis_out_b) * 8 / 1e9 / n,
            "Gbit/s",
        ),
    ]
    return [Line("redis", *row) for row in rows]


def _rest(i: Inputs, streams: float, api_procs: int) -> list[Line]:
    tok = streams * i.tokens_per_s
    ended = tok / i.answer_tokens
    api_mem = (api_procs * i.api_base_mib * KIB * KIB + streams * i.api_stream_kib * KIB) / GB
    return [
        Line("memory", "API RSS in all", "P x base + S x 25.2 KiB", api_mem, "GB"),
        Line(
            "network",
            "to clients",
            "R x (event + overhead) x 8",
            tok * (i.event_b + i.wire_overhead_b) * 8 / 1e9,
            "Gbit/s",
        ),
        Line("postgres", "transactions (one per request)", "Q", ended, "/s"),
        Line("postgres", "rows written", "Q x (1 + stored)", ended * (1 + i.stored_share), "/s"),
        Line("postgres", "billing rows a day", "Q x 86,400", ended * 86400, "rows"),
    ]


def per_unit(i: Inputs) -> list[Line]:
    """Streams one unit of each resource carries at ``utilisation`` (independent of S)."""
    u, r = i.utilisation, i.tokens_per_s
    primary_cpu = u / (_redis_cores(i, r) * i.cluster_factor)  # streams
    per_stream_b = sum(_redis_bytes(i, 1.0))
    if i.mode == "node":
        node = u * 1e6 / ((i.api_ms + i.worker_ms) * i.node_factor * r)
        front = [("node process (one per engine)", "u / (r (a + w) n / 1e6)", node)]
    else:
        front = [
            ("worker process (one per engine)", "u / (r w / 1e6)", u * 1e6 / (i.worker_ms * r)),
            (
                "API process",
                "min(u / (r a / 1e6), 10,000)",
                min(u * 1e6 / (i.api_ms * r), i.api_max_streams),
            ),
        ]
    stores = [
        ("Redis primary, by CPU (cluster)", "u / (r d c / 1e6)", primary_cpu),
        (
            "Redis primary, by memory",
            "M m / (bytes per stream)",
            i.shard_gb * GB * i.shard_memory_use / per_stream_b,
        ),
        (
            "Postgres primary (assumed commits/s)",
            "T L / r",
            i.postgres_tx_per_s * i.answer_tokens / r,
        ),
        (
            "one Redis Cluster (max primaries, by CPU)",
            "N x primary by CPU",
            i.cluster_max_primaries * primary_cpu,
        ),
    ]
    return [
        Line("unit", name, formula, value, "streams") for name, formula, value in front + stores
    ]


def plan(i: Inputs, streams: float) -> list[Line]:
    """Every line of the model for ``streams`` concurrent streams."""
    cpu = _cpu(i, streams)
    procs = next(int(x.value) for x in cpu if x.name in ("API processes", "node processes"))
    return _load(i, streams) + cpu + _redis(i, streams) + _rest(i, streams, procs)


def first_out(i: Inputs, streams: float) -> list[str]:
    """What binds at ``streams``: Redis's shard count, and the one-of-a-kind stores."""
    lines = {x.name: x.value for x in plan(i, streams)}
    by_cpu, by_mem = lines["shards by CPU"], lines["shards by memory"]
    redis = "memory (retention)" if by_mem >= by_cpu else "CPU"
    out = [f"Redis primaries are set by {redis}: {by_cpu:,.0f} by CPU, {by_mem:,.0f} by memory"]
    if lines["primaries"] > i.cluster_max_primaries:
        out.append(
            f"{lines['primaries']:,.0f} primaries: more than one Redis Cluster "
            f"({i.cluster_max_primaries:,}) holds"
        )
    tx = lines["transactions (one per request)"]
    if tx > i.postgres_tx_per_s:
        out.append(
            f"{tx:,.0f} ledger commits/s: over the assumed {i.postgres_tx_per_s:,.0f} "
            "of the one ledger database"
        )
    return out


def _fmt(v: float) -> str:
    if v >= 100 or v == int(v):
        return f"{v:,.0f}"
    return f"{v:,.2f}" if v < 10 else f"{v:,.1f}"


def table(i: Inputs, sizes: list[float]) -> str:
    plans = [plan(i, s) for s in sizes]
    head = "| group | quantity | formula | " + " | ".join(f"S = {s:,.0f}" for s in sizes)
    rows = [head + " | unit |", "|" + " --- |" * (4 + len(sizes))]
    for n, line in enumerate(plans[0]):
        cells = " | ".join(_fmt(p[n].value) for p in plans)
        rows.append(f"| {line.group} | {line.name} | {line.formula} | {cells} | {line.unit} |")
    return "\n".join(rows)


def _args() -> tuple[Inputs, list[float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=float, nargs="+", default=[10_000, 1_000_000])
    for f in dataclasses.fields(Inputs):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"] + " (default: %(default)s)"
        if f.name == "mode":
            parser.add_argument(flag, choices=["split", "node"], default=f.default, help=help_text)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, help=help_text)
    ns = vars(parser.parse_args())
    sizes = ns.pop("streams")
    return Inputs(**ns), sizes


def main() -> None:
    inputs, sizes = _args()
    print(table(inputs, sizes))
    print()
    print("| one unit | formula | carries at u | |")
    print("| --- | --- | --- | --- |")
    for line in sorted(per_unit(inputs), key=lambda x: x.value):
        print(f"| {line.name} | {line.formula} | {_fmt(line.value)} | {line.unit} |")
    print()
    for s in sizes:
        for finding in first_out(inputs, s):
            print(f"S = {s:,.0f}: {finding}")


if __name__ == "__main__":
    main()
