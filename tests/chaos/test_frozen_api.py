"""An API process frozen mid-stream (``SIGSTOP``: its sockets stay open, nothing is
answered -- a stalled VM, a partition between the clients' proxy and it): its clients hear
nothing, not even the `: ping` every ``keepalive_s``, take the connection for dead after a
few missed pings (a mobile client's watchdog: ``read_timeout_s``) and resume with
``Last-Event-ID`` on the other API process, which serves any request. When the frozen
process wakes, the readers it held find their sockets closed; nothing it sends is seen
twice, and the requests it was serving were never its to lose: the log is in Redis."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
from pathlib import Path

import pytest

from tests.chaos.conftest import (
    Fault,
    drive,
    false_takeovers,
    logs_of,
    outage_stack,
    server_errors,
    utc_now,
    verdicts,
)
from tests.chaos.test_stack_outages import billing_findings, client_findings, request_findings

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]

FROZEN_S = 8.0  # longer than a client's watchdog, shorter than a reader's lease
WATCHDOG_S = 3.0  # three missed pings (the tests' keepalive_s is 1 s)


def test_an_api_process_frozen_mid_stream_its_readers_move_to_the_other(
    tmp_path: Path, database_url: str, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """12 streams over two API processes, one of them frozen for 8 s: every client that
    was reading from it moves to the other and gets events while it is still frozen;
    every request ends with the client's text its log's, no 5xx, one billing row each,
    reconcile clean, and no worker is taken for lost."""
    with outage_stack(
        tmp_path, database_url, model_dir, appendfsync="always", apis=2, workers=2
    ) as (stack, _server):
        victim = stack.api_urls[0]
        pid = stack.api_procs[victim].pid

        def freeze() -> None:
            os.kill(pid, signal.SIGSTOP)

        def wake() -> None:
            os.kill(pid, signal.SIGCONT)

        since = utc_now(-1)
        outcome = asyncio.run(
            drive(
                stack.api_urls,
                Fault("SIGSTOP of an API process", freeze, wake, FROZEN_S),
                early=12,
                during=2,
                after=2,
                cut_every=0,
                read_timeout_s=WATCHDOG_S,
            )
        )
        rids = [c.rid for c in outcome.accepted if c.rid is not None]
        found = asyncio.run(verdicts(stack.api_urls, rids))
        findings = client_findings(outcome)
        for c in outcome.accepted:
            findings += request_findings(c, found[c.rid or ""], lost_ok=False, committed=True)
        findings += billing_findings(stack, database_url, rids, since)
        findings += server_errors(stack) + false_takeovers(stack)

        # the clients the freeze caught reading from the victim moved while it was frozen
        caught = moved = 0
        longest = 0.0
        for c in outcome.clients:
            reading = [url for at, url in c.served_by if at <= outcome.fault_at]
            if c.cohort != "early" or not reading or reading[-1] != victim or c.ended_at is None:
                continue
            if c.ended_at <= outcome.fault_at:
                continue  # (it had its whole answer before the freeze)
            caught += 1
            during = [e.at for e in c.events if outcome.fault_at < e.at < outcome.back_at]
            if during:
                moved += 1
            else:
                findings.append(f"client {c.index} got nothing while {victim} was frozen")
            times = [e.at for e in c.events]
            for before, after in itertools.pairwise(times):
                if after >= outcome.fault_at:
                    longest = max(longest, after - before)
        assert caught, "the freeze caught no client reading from the frozen process"
        assert not findings, "\n".join(findings) + "\n\n" + logs_of(stack)
        with capsys.disabled():
            print(
                f"\nfrozen API: {len(rids)} requests; {caught} clients were reading from the "
                f"frozen process, {moved} moved to the other while it was frozen; longest "
                f"stall {longest:.2f} s (a client's watchdog: {WATCHDOG_S:g} s)"
            )
