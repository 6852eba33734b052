"""A short seeded soak (``make soak``'s code, in process): 75 s of faults drawn from a
fixed seed on one Redis node at ``disk`` -- workers, API processes and Redis killed and
frozen, Postgres restarted, connections cut -- under clients streaming all along; then
every invariant of ``tests/chaos/soak_check.py`` over the whole history."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.soak import Config, run_soak
from tests.chaos.soak_nemesis import KINDS, plan

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(900)]

SEED = 42  # its 75 s plan holds every fault a single node has (checked below)


def test_a_short_seeded_soak_holds_every_invariant(tmp_path: Path, model_dir: Path) -> None:
    cfg = Config(seed=SEED, minutes=1.25, clients=6, work=tmp_path, model_dir=model_dir)
    kinds = {op.kind for op in plan(cfg.seed, cfg.duration_s, cfg.topology)}
    single = {"worker-kill", "worker-stop", "api-kill", "api-stop", "redis-kill", "redis-stop"}
    assert single | {"postgres-restart", "client-cut"} <= kinds, kinds  # else it tests less
    report = run_soak(cfg)
    assert not report.findings, "\n".join([report.table, *report.findings])
    assert "requests accepted" in report.table


@pytest.mark.parametrize("topology", ["single", "cluster"])
def test_the_schedule_is_the_seeds_alone(topology: str) -> None:
    """The same seed, the same faults at the same offsets (``--seed`` repeats a run);
    faults of one group never overlap as planned, each heals before the end, and a
    cluster loses at most one primary per shard."""
    ops = plan(7, 180.0, topology)
    assert ops == plan(7, 180.0, topology) and ops != plan(8, 180.0, topology)
    busy: dict[str, float] = {}
    for op in ops:
        kind = KINDS[op.kind]
        assert topology in kind.topologies
        assert op.at + op.hold_s + kind.settle_s <= 180.0
        if kind.group is not None:
            assert busy.get(kind.group, 0.0) <= op.at, op
            busy[kind.group] = op.at + op.hold_s + kind.settle_s
    takeovers = [op.target for op in ops if op.kind == "primary-takeover"]
    assert len(takeovers) == len(set(takeovers))
