"""The soak's nemesis: a schedule of faults drawn from the seed alone (``plan``: the same
seed, the same schedule), then carried out against the running stack (``Nemesis``).

Faults of one group never overlap (one worker, one API process, one Redis-level fault,
Postgres): so one worker and one API process are always up, and Redis is never hit twice
at once. Each fault heals itself (a restart, SIGCONT) before the run ends; a fault whose
group is still busy when its time comes (a slow restart) waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence

from tests.chaos.conftest import Client
from tests.chaos.soak_env import Env, wait_cluster_ok
from tests.waiting import wait_until


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str
    group: str | None  # faults of a group never overlap (None: any time)
    weight: float
    hold: tuple[float, float]  # how long the fault lasts, drawn uniformly (s)
    settle_s: float  # what the plan allows after it for the heal itself (a restart)
    topologies: tuple[str, ...] = ("single", "cluster")


KINDS = {
    k.name: k
    for k in (
        Kind("worker-kill", "worker", 2.0, (1.0, 6.0), 8.0),  # variant 1: replaced at once
        Kind("worker-stop", "worker", 2.0, (1.0, 8.0), 1.0),
        Kind("api-kill", "api", 1.5, (0.0, 3.0), 4.0),
        Kind("api-stop", "api", 1.5, (1.0, 6.0), 1.0),
        Kind("redis-kill", "redis", 1.5, (1.0, 4.0), 3.0, ("single",)),
        Kind("redis-stop", "redis", 1.5, (1.0, 5.0), 2.0, ("single",)),
        Kind("node-stop", "redis", 1.5, (0.5, 4.0), 6.0, ("cluster",)),
        Kind("primary-takeover", "redis", 1.5, (0.0, 0.0), 8.0, ("cluster",)),
        Kind("postgres-restart", "postgres", 1.0, (1.0, 8.0), 4.0),
        Kind("client-cut", None, 2.0, (0.0, 0.0), 0.0),
    )
}
SHARDS = 3  # LocalCluster's primaries: a primary-takeover each at most (nodes stay dead)


@dataclasses.dataclass(frozen=True)
class Op:
    """One planned fault: when (s after the faults begin), what, for how long, and on
    what (``target``: a slot, a node or a shard, modulo what is there; the clients cut)."""

    at: float
    kind: str
    hold_s: float
    target: int
    variant: int = 0

    def describe(self) -> str:
        if self.kind == "client-cut":
            return f"client-cut of {self.target}"
        how = {"worker-kill": " (replaced at once)" if self.variant else " (restarted)"}
        return f"{self.kind}{how.get(self.kind, '')}, {self.hold_s:g} s, #{self.target}"


def plan(seed: int, duration_s: float, topology: str) -> list[Op]:
    """The schedule of a run: a fault every 2-5 s while ``duration_s`` lasts, each one
    healed (planned) before it ends. Nothing here depends on timing: only on the seed."""
    rng = random.Random(seed)
    kinds = [k for k in KINDS.values() if topology in k.topologies]
    busy: dict[str | None, float] = {}
    shards = list(range(SHARDS))
    ops: list[Op] = []
    t = rng.uniform(3.0, 6.0)
    while t < duration_s:
        free = [
            k
            for k in kinds
            if (k.group is None or busy.get(k.group, 0.0) <= t)
            and (k.name != "primary-takeover" or shards)
        ]
        kind = rng.choices(free, weights=[k.weight for k in free])[0]
        hold = round(rng.uniform(*kind.hold), 1)
        target, variant = rng.randrange(1000), rng.randrange(2)
        if kind.name == "worker-kill" and variant:
            hold = 0.0
        if kind.name == "client-cut":
            target = 1 + target % 3  # how many clients
        if kind.name == "primary-takeover":
            target = shards.pop(rng.randrange(len(shards)))
        if t + hold + kind.settle_s <= duration_s:
            ops.append(Op(round(t, 1), kind.name, hold, target, variant))
            busy[kind.group] = t + hold + kind.settle_s
        t += rng.uniform(2.0, 5.0)
    return ops


@dataclasses.dataclass
class Done:
    """A fault as it happened (monotonic times), or why it could not be carried out."""

    op: Op
    began: float
    healed: float
    detail: str
    failed: str | None = None


class Nemesis:
    """Carries out a plan against ``env`` (clients to cut: ``clients``)."""

    def __init__(self, env: Env, clients: Sequence[Client], t0: float) -> None:
        self.env = env
        self.clients = clients
        self.t0 = t0
        self.locks: dict[str, asyncio.Lock] = {}
        self.done: list[Done] = []
        self.faulted_workers: set[str] = set()  # killed or frozen: may be taken over
        self.actions: dict[str, Callable[[Op], Awaitable[str]]] = {
            "worker-kill": self.worker_kill,
            "worker-stop": self.worker_stop,
            "api-kill": self.api_kill,
            "api-stop": self.api_stop,
            "redis-kill": self.redis_kill,
            "redis-stop": self.redis_stop,
            "node-stop": self.node_stop,
            "primary-takeover": self.primary_takeover,
            "postgres-restart": self.postgres_restart,
            "client-cut": self.client_cut,
        }

    def say(self, what: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f} s] {what}", flush=True)

    async def run(self, ops: list[Op]) -> None:
        tasks = []
        for op in ops:
            await asyncio.sleep(max(0.0, self.t0 + op.at - time.monotonic()))
            tasks.append(asyncio.create_task(self._one(op)))
        await asyncio.gather(*tasks)

    async def _one(self, op: Op) -> None:
        group = KINDS[op.kind].group
        lock = self.locks.setdefault(group, asyncio.Lock()) if group else None
        async with lock if lock is not None else contextlib.nullcontext():
            began = time.monotonic()
            self.say(f"fault  {op.describe()} (planned at {op.at:g} s)")
            try:
                detail, failed = await self.actions[op.kind](op), None
            except Exception as exc:  # noqa: BLE001 - reported as a finding of the run
                detail, failed = f"failed: {exc!r}", repr(exc)
            self.done.append(Done(op, began, time.monotonic(), detail, failed))
            self.say(f"healed {op.kind}: {detail}")

    def counts(self) -> Counter[str]:
        return Counter(d.op.kind for d in self.done if d.failed is None)

    # -- the faults --------------------------------------------------------------------

    async def worker_kill(self, op: Op) -> str:
        slot = op.target % len(self.env.workers)
        victim = self.env.workers[slot]
        self.faulted_workers.add(victim.name)
        victim.kill()
        await asyncio.sleep(op.hold_s)
        new = await asyncio.to_thread(self.env.start_worker)
        self.env.workers[slot] = new
        return f"{victim.name} killed (-9), {new.name} started"

    async def worker_stop(self, op: Op) -> str:
        victim = self.env.workers[op.target % len(self.env.workers)]
        self.faulted_workers.add(victim.name)
        victim.signal(signal.SIGSTOP)
        await asyncio.sleep(op.hold_s)
        victim.signal(signal.SIGCONT)
        return f"{victim.name} SIGSTOP {op.hold_s:g} s, SIGCONT"

    async def api_kill(self, op: Op) -> str:
        slot = op.target % len(self.env.apis)
        victim = self.env.apis[slot]
        self.env.forget_url(victim.url)
        victim.kill()
        await asyncio.sleep(op.hold_s)
        new = await asyncio.to_thread(self.env.start_api)
        self.env.apis[slot] = new
        self.env.urls.append(new.url)
        return f"{victim.name} killed (-9), {new.name} started"

    async def api_stop(self, op: Op) -> str:
        victim = self.env.apis[op.target % len(self.env.apis)]
        self.env.forget_url(victim.url)  # (its clients' watchdogs move them off it)
        victim.signal(signal.SIGSTOP)
        await asyncio.sleep(op.hold_s)
        victim.signal(signal.SIGCONT)
        self.env.urls.append(victim.url)
        self.env.stack.api_urls.append(victim.url)
        return f"{victim.name} SIGSTOP {op.hold_s:g} s, SIGCONT"

    async def redis_kill(self, op: Op) -> str:
        server = self.env.redis
        assert server is not None
        server.kill()
        await asyncio.sleep(op.hold_s)
        await asyncio.to_thread(server.start)  # same port, its AOF
        return f"Redis :{server.port} killed (-9), {op.hold_s:g} s down, restarted"

    async def redis_stop(self, op: Op) -> str:
        server = self.env.redis
        assert server is not None
        server.pause()
        await asyncio.sleep(op.hold_s)
        server.resume()
        return f"Redis :{server.port} SIGSTOP {op.hold_s:g} s, SIGCONT"

    async def node_stop(self, op: Op) -> str:
        assert self.env.cluster is not None
        nodes = self.env.nodes()
        node = nodes[op.target % len(nodes)]
        role = await asyncio.to_thread(node.role)
        node.pause()
        await asyncio.sleep(op.hold_s)
        node.resume()
        await asyncio.to_thread(wait_cluster_ok, self.env.cluster)
        return f"node :{node.port} ({role}) SIGSTOP {op.hold_s:g} s, SIGCONT"

    async def primary_takeover(self, op: Op) -> str:
        return await asyncio.to_thread(self._takeover, op)

    def _takeover(self, op: Op) -> str:
        """kill -9 of shard ``op.target``'s primary, for good; ``CLUSTER FAILOVER
        TAKEOVER`` on the replica that received the most of it (what the cluster's own
        election prefers). Only a shard with all three nodes left: the promoted primary
        keeps a replica (``replica`` durability needs one)."""
        cluster = self.env.cluster
        assert cluster is not None
        first = cluster.primaries[op.target]
        shard = [n for n in [first, *cluster.replicas_of(first)] if n in cluster.live()]
        if len(shard) < 3:
            return f"skipped: shard {op.target} has {len(shard)} nodes left"
        primary = next(n for n in shard if n.role() == "master")
        primary.kill()
        offsets = {n.port: n.offset() for n in shard if n is not primary}
        chosen = next(n for n in shard if n.port == max(offsets, key=lambda p: (offsets[p], -p)))
        chosen.client().execute_command("CLUSTER", "FAILOVER", "TAKEOVER")  # type: ignore[no-untyped-call]
        wait_cluster_ok(cluster)
        wait_until(
            lambda: int(chosen.client().info("replication").get("connected_slaves", 0)) >= 1,
            f"a replica following :{chosen.port}",
            timeout=60,
            interval=0.2,
        )
        return (
            f"primary :{primary.port} killed (-9) for good; :{chosen.port} took over "
            f"(replication offsets {offsets})"
        )

    async def postgres_restart(self, op: Op) -> str:
        pg = self.env.postgres
        await asyncio.to_thread(pg.stop)
        await asyncio.sleep(op.hold_s)
        url = await asyncio.to_thread(pg.start)
        if url != self.env.database_url:
            raise RuntimeError(f"Postgres came back at another URL: {url}")
        return f"Postgres stopped, {op.hold_s:g} s down, started"

    async def client_cut(self, op: Op) -> str:
        streaming = [c for c in self.clients if c.rid is not None and not c.ended]
        if not streaming:
            return "no client streaming"
        cut = {
            (c := streaming[(op.target * 7 + k) % len(streaming)]).index: c
            for k in range(op.target)
        }
        for c in cut.values():
            c.cut()
        return f"cut clients {sorted(cut)}"
