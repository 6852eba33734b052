"""The soak's checker: once the faults have healed and every client has finished, the
whole history is judged -- each client's transcript against its request's log (read
again from the start), the ledger, the API processes' logs -- and the pauses clients saw.

A *stall* is the longest time a client waited between two consecutive events of its
stream (from the answer's headers to its first event, then event to event), over all
its connections, as the client saw it: nothing is left out. A client connected to an
API process the nemesis froze hears no `: ping` either; its watchdog (the soak's read
timeout, a few missed pings: ``soak.WATCHDOG_S``) takes the connection for dead and it
resumes on another process, so that wait counts like any other (worker and Redis
faults, cuts, reconnects).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import re

import redis

from tests.chaos.conftest import Client, Outcome, Verdict, server_errors, verdicts, wait_rows
from tests.chaos.soak_env import Env
from tests.chaos.soak_nemesis import KINDS, Nemesis
from tests.chaos.test_stack_outages import billing_findings, client_findings, request_findings


@dataclasses.dataclass(frozen=True)
class Stall:
    client: int
    rid: str | None
    seconds: float  # the longest wait between two events
    at: float  # when it began (s after the faults began)


def longest_stall(c: Client, t0: float) -> Stall | None:
    times = ([c.accepted_at] if c.accepted_at is not None else []) + [e.at for e in c.events]
    waits = [(t2 - t1, t1) for t1, t2 in itertools.pairwise(times)]
    if not waits:
        return None
    wait, at = max(waits)
    return Stall(c.index, c.rid, wait, at - t0)


_LOST = re.compile(r"worker (\S+)(?:: its connection is gone| is lost \()")


def false_takeovers(env: Env, faulted: set[str]) -> list[str]:
    """Workers the API processes took for lost although the nemesis never killed or
    froze them (an outage of Redis or Postgres is not a worker's death)."""
    out = []
    for path in sorted(env.stack.logs.glob("api-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            m = _LOST.search(line)
            if m and not any(m[1].startswith(f"{name}-") for name in faulted):
                out.append(f"{path.stem}: a live worker taken for lost: {line}")
    return out


def leaks(env: Env) -> list[str]:
    """Per-request keys that never expire (one Redis node only)."""
    if env.redis is None:
        return []
    client = env.redis.client()
    try:
        found = client.scan_iter(match=f"{env.stack.settings.key_prefix}:{{*}}:r:*", count=1000)
        return [f"a key that never expires: {k.decode()}" for k in found if client.ttl(k) == -1]
    except redis.RedisError as exc:
        return [f"the leak scan failed: {exc!r}"]
    finally:
        client.close()


def read_logs(urls: list[str], rids: list[str], batch: int = 40) -> dict[str, Verdict]:
    """Each request's terminal state and whole log (a few dozen at a time)."""

    async def all_of() -> dict[str, Verdict]:
        found: dict[str, Verdict] = {}
        for i in range(0, len(rids), batch):
            found.update(await verdicts(urls, rids[i : i + batch]))
        return found

    return asyncio.run(all_of())


def request_checks(env: Env, clients: list[Client], found: dict[str, Verdict]) -> list[str]:
    cluster = env.topology == "cluster"
    out = []
    for c in clients:
        if c.rid is None:
            continue
        # at disk (one node) and replica (two replicas each) nothing a client was sent
        # may be taken back: a failover may end a request log_lost in band (cluster),
        # but after exactly what its log kept; and no id a client saw may vanish from
        # the log (a 400 invalid_event_id made the client read it again from the start)
        out += request_findings(c, found[c.rid], lost_ok=cluster, committed=True)
        if c.from_start:
            out.append(f"{c.rid}: an event the client was sent left the log ({c.from_start}x)")
        if len(set(c.ids)) != len(c.ids):
            out.append(f"{c.rid}: the client was sent an event twice")
    return out


@dataclasses.dataclass
class Report:
    findings: list[str]
    table: str


def judge(
    env: Env,
    nemesis: Nemesis,
    clients: list[Client],
    span: tuple[float, float],
    since: str,
    stall_bound_s: float,
) -> Report:
    """Every invariant over the whole history (``span``: the faults' first and last
    moments, monotonic)."""
    accepted = [c for c in clients if c.rid is not None]
    rids = [c.rid for c in accepted if c.rid is not None]
    findings = client_findings(Outcome(list(clients), *span))
    found = read_logs(list(env.urls), rids)
    findings += request_checks(env, clients, found)
    wait_rows(env.database_url, rids, safety_s=120)  # (a dead recorder's: claimed at 30 s)
    findings += billing_findings(env.stack, env.database_url, rids, since)
    findings += [f"nemesis: {d.op.describe()}: {d.failed}" for d in nemesis.done if d.failed]
    findings += server_errors(env.stack)
    findings += false_takeovers(env, nemesis.faulted_workers)
    findings += leaks(env)
    stalls = [s for c in clients if (s := longest_stall(c, span[0]))]
    worst = max(stalls, key=lambda s: s.seconds, default=None)
    over = [s for s in stalls if s.seconds > stall_bound_s]
    findings += [
        f"client {s.client} ({s.rid}): stalled {s.seconds:.1f} s at +{s.at:.1f} s, over the "
        f"bound of {stall_bound_s:g} s"
        for s in over
    ]
    table = summary(nemesis, clients, found, worst, stall_bound_s, len(findings))
    return Report(findings, table)


def summary(
    nemesis: Nemesis,
    clients: list[Client],
    found: dict[str, Verdict],
    worst: Stall | None,
    bound_s: float,
    n_findings: int,
) -> str:
    counts = nemesis.counts()
    rows = [("fault", "count")] + [(k, str(counts.get(k, 0))) for k in KINDS if counts.get(k)]
    failed = sum(1 for d in nemesis.done if d.failed)
    rows += [("(faults that failed)", str(failed))] if failed else []
    outcomes = collections.Counter(
        f"{v.state or 'no terminal state'}{f' ({v.log_error})' if v.log_error else ''}"
        for v in found.values()
    )
    accepted = [c for c in clients if c.rid is not None]
    rows += [("", ""), ("clients launched", str(len(clients)))]
    rows += [("requests accepted", str(len(accepted)))]
    rows += [(f"  ended {k}", str(n)) for k, n in sorted(outcomes.items())]
    rows += [
        ("clients that gave up / hung", str(sum(1 for c in clients if c.gave_up))),
        ("connections cut", str(sum(c.cuts for c in clients))),
        ("resumes (Last-Event-ID)", str(sum(c.resumes for c in clients))),
        ("503s retried", str(sum(c.unavailable for c in clients))),
        ("reads again from the start", str(sum(c.from_start for c in clients))),
        ("tokens received", str(sum(c.tokens for c in clients))),
    ]
    if worst is not None:
        where = f"client {worst.client}, {worst.rid}, at +{worst.at:.1f} s"
        rows += [("longest stall", f"{worst.seconds:.2f} s ({where})")]
    rows += [("stall bound", f"{bound_s:g} s"), ("findings", str(n_findings))]
    width = max(len(a) for a, _ in rows)
    return "\n".join(f"  {a:<{width}}  {b}" if a else "" for a, b in rows)
