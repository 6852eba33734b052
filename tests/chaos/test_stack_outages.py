"""Whole stacks ride through Redis outages: killed (AOF everysec / always), frozen, and
restarted without its data, under concurrent streaming clients that resume.

Each client streams a chat completion; when its connection is cut or it gets a 503 it
resumes from its last event id (``Retry-After`` honoured, a bounded budget of tries),
and when the server says that id is not an event of the request (Redis lost that part
of the log) it reads the log again from the start. Afterwards every accepted request
must have ended, each client's text must be the log's own, ids must increase, nothing
but a 503 may be a 5xx, and billing must have exactly one row per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from service.stream.ids import Cursor
from tests.chaos.conftest import (
    TERMINAL,
    ChaosRedis,
    Client,
    Fault,
    Outcome,
    Verdict,
    crash_and_restart,
    drive,
    false_takeovers,
    freeze,
    keys_without_ttl,
    kill_and_restart,
    logs_of,
    outage_stack,
    reconcile,
    server_errors,
    utc_now,
    verdicts,
    wait_rows,
)
from tests.e2e.conftest import Stack

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]


# the 503s a client may get while Redis is away or just back (the heartbeats it lost)
RETRYABLE = {"store_unavailable", "no_worker"}


def _increasing(ids: list[str]) -> bool:
    cursors = [Cursor.parse(i) for i in ids]
    return all(a < b for a, b in itertools.pairwise(cursors))


def client_findings(outcome: Outcome, *, hung_ok: bool = False) -> list[str]:
    """What no client may see, in any scenario: a 5xx but 503, an answer it could not
    handle, a budget run out, a hang, ids that do not increase."""
    early = [c for c in outcome.clients if c.cohort == "early"]
    hit = [c for c in early if c.ended_at is None or c.ended_at > outcome.fault_at]
    out = []
    if len(hit) < len(early) / 2:  # else this test tests nothing
        out.append(f"the fault hit only {len(hit)} of {len(early)} streams mid-stream")
    codes = set().union(*(c.unavailable_codes for c in outcome.clients))
    if codes - RETRYABLE:
        out.append(f"503s with codes {sorted(codes - RETRYABLE)}")
    for c in outcome.clients:
        bad = sorted({s for s in c.statuses if s >= 500 and s != 503})
        if bad:
            out.append(f"client {c.index} ({c.rid}): HTTP {bad}")
        out += [f"client {c.index} ({c.rid}): {p}" for p in c.problems if "submit cut" not in p]
        if c.gave_up and not (hung_ok and c.gave_up.startswith("hung")):
            out.append(f"client {c.index} ({c.rid}, {c.cohort}): gave up: {c.gave_up}; {_seen(c)}")
        if not _increasing(c.ids):
            out.append(f"client {c.index} ({c.rid}): ids do not increase: {c.ids}")
    return out


def _seen(c: Client) -> str:
    last = c.events[-1].data[:200] if c.events else None
    return (
        f"{len(c.events)} events, {c.tokens} tokens, cuts {c.cuts}, resumes {c.resumes}, "
        f"503s {c.unavailable}, statuses {sorted(set(c.statuses))}, last {last!r}"
    )


def request_findings(c: Client, v: Verdict, *, lost_ok: bool, committed: bool = False) -> list[str]:
    """One accepted request: ended in the log, and the client's text is the log's
    (``committed``: readers were sent only committed events)."""
    rid = c.rid
    out = []
    if v.state is None:
        out.append(
            f"{rid}: no terminal state (status answers {sorted(set(v.statuses))}); {_seen(c)}"
        )
        if not c.ended:
            out.append(f"{rid}: the client's stream did not end; {_seen(c)}")
        return out
    if v.state not in TERMINAL:
        out.append(f"{rid}: state {v.state}")
    if any(s >= 500 and s != 503 for s in v.statuses):
        out.append(f"{rid}: status / events answered {sorted(set(v.statuses))}")
    if v.log_text is None:
        out.append(f"{rid}: its log cannot be read from the start ({sorted(set(v.statuses))})")
        return out
    if not _increasing(v.log_ids):
        out.append(f"{rid}: the log's ids do not increase: {v.log_ids}")
    if v.state == "errored" and v.log_error == "log_lost" and lost_ok and not committed:
        # Redis lost the tail of this log, which says so in band: at ``memory`` a client
        # still connected saw that tail before it was lost (and [DONE], if the end was in
        # it), so the log's text is a prefix of its own; it sees the in-band error unless
        # it had ended. Never a splice: nothing after the prefix but the error.
        if not (c.error == "log_lost" or c.done) or not c.text.startswith(v.log_text):
            out.append(
                f"{rid}: errored log_lost, but the client saw error {c.error!r} and text "
                f"{c.text!r}, the log {v.log_text!r}"
            )
        return out
    if v.state == "errored" and v.log_error == "log_lost" and lost_ok:
        # Readers were sent only what was committed, which the fault kept: the log still
        # holds every event its client saw, and the client saw the in-band end.
        if c.error != "log_lost" or c.text != v.log_text or c.ids != v.log_ids:
            out.append(
                f"{rid}: errored log_lost, but the client saw error {c.error!r}, text "
                f"{c.text!r} and ids {c.ids}; the log {v.log_text!r}, {v.log_ids}"
            )
        return out
    if v.state != "finished":
        out.append(f"{rid}: ended {v.state} ({v.log_error}); {_seen(c)}")
    if c.text != v.log_text:
        out.append(f"{rid}: the client's text {c.text!r} is not the log's {v.log_text!r}")
    if c.ids != v.log_ids:
        out.append(f"{rid}: the client's ids {c.ids} are not the log's {v.log_ids}")
    if not c.done:
        out.append(f"{rid}: the client never saw [DONE]; {_seen(c)}")
    return out


def forgotten_findings(c: Client, v: Verdict) -> list[str]:
    """A request Redis forgot (restarted without its data) while its client streamed:
    the stream ends -- in-band ``log_lost``, a clean end, or, for a client that was
    between connections, a 404 on its resume (nobody knows the request any more) --
    and whatever is still known of it is consistent."""
    rid = c.rid
    out = []
    if not (c.done or c.error == "log_lost" or (c.gone and c.cuts)):
        out.append(f"{rid}: the open stream ended with error {c.error!r}; {_seen(c)}")
    if v.state is not None and v.state not in TERMINAL:
        out.append(f"{rid}: state {v.state} (status answers {sorted(set(v.statuses))})")
    if any(s >= 500 and s != 503 for s in v.statuses):
        out.append(f"{rid}: status / events answered {sorted(set(v.statuses))}")
    if v.state == "finished" and v.log_text is not None and c.text != v.log_text:
        out.append(f"{rid}: finished, but the client's text {c.text!r} is not {v.log_text!r}")
    return out


def billing_findings(stack: Stack, database_url: str, rids: list[str], since: str) -> list[str]:
    rows = wait_rows(database_url, rids)
    out = [f"{rid}: {rows.get(rid, 0)} billing rows" for rid in rids if rows.get(rid, 0) != 1]
    done = reconcile(stack, since)
    if done.returncode != 0 or "clean" not in done.stdout.splitlines()[-1:]:
        out.append(f"reconcile: rc {done.returncode}\n{done.stdout}{done.stderr[-2000:]}")
    return out


@dataclasses.dataclass
class Run:
    stack: Stack
    server: ChaosRedis
    since: str  # for reconcile: after the stack started, so only this test's rows
    outcome: Outcome
    found: dict[str, Verdict]

    @property
    def rids(self) -> list[str]:
        return [c.rid for c in self.outcome.accepted if c.rid is not None]

    def leaks(self) -> list[str]:
        stray = keys_without_ttl(self.server, self.stack.settings.key_prefix)
        return [f"a key that never expires: {key}" for key in stray]

    def check(self, findings: list[str], *, leaks: bool = True) -> None:
        findings = findings + server_errors(self.stack) + false_takeovers(self.stack)
        findings += self.leaks() if leaks else []
        assert not findings, "\n".join(findings) + "\n\n" + logs_of(self.stack)


@contextlib.contextmanager
def scenario(
    tmp_path: Path,
    database_url: str,
    model_dir: Path,
    fault: Callable[[ChaosRedis], Fault],
    *,
    appendfsync: str | None,
    apis: int,
    workers: int,
    early: int,
    during: int = 2,
    after: int = 2,
    tokens_before_fault: int = 30,
    **settings: object,
) -> Iterator[Run]:
    """A stack on a ChaosRedis; ``early`` clients streaming when ``fault`` hits; then
    each accepted request's state and log, read back. The stack runs until the end."""
    with outage_stack(
        tmp_path,
        database_url,
        model_dir,
        appendfsync=appendfsync,
        apis=apis,
        workers=workers,
        **settings,
    ) as (stack, server):
        since = utc_now(-1)
        outcome = asyncio.run(
            drive(
                stack.api_urls,
                fault(server),
                early=early,
                during=during,
                after=after,
                tokens_before_fault=tokens_before_fault,
            )
        )
        rids = [c.rid for c in outcome.accepted if c.rid is not None]
        found = asyncio.run(verdicts(stack.api_urls, rids))
        yield Run(stack, server, since, outcome, found)


def _killed(
    tmp_path: Path,
    database_url: str,
    model_dir: Path,
    fault: Callable[[ChaosRedis], Fault],
    appendfsync: str,
    *,
    lost_ok: bool,
    tokens_before_fault: int = 30,
    nodes: int = 0,
) -> None:
    """``nodes``: that many nodes instead of two API processes and two workers."""
    with scenario(
        tmp_path,
        database_url,
        model_dir,
        fault,
        appendfsync=appendfsync,
        apis=0 if nodes else 2,
        workers=0 if nodes else 2,
        nodes=nodes,
        early=16,
        tokens_before_fault=tokens_before_fault,
    ) as run:
        committed = run.stack.settings.durability != "memory"
        findings = client_findings(run.outcome)
        for c in run.outcome.accepted:
            found = run.found[c.rid or ""]
            findings += request_findings(c, found, lost_ok=lost_ok, committed=committed)
        findings += billing_findings(run.stack, database_url, run.rids, run.since)
        # the clients that submitted while Redis was down were told to come back
        during = [c for c in run.outcome.clients if c.cohort == "during"]
        if not all("store_unavailable" in c.unavailable_codes for c in during):
            findings.append(f"no 503 store_unavailable while Redis was down: {during}")
        run.check(findings)
        assert len(run.rids) == 20, [c.gave_up for c in run.outcome.clients]


def test_redis_killed_mid_stream_aof_everysec(
    tmp_path: Path, database_url: str, model_dir: Path
) -> None:
    """kill -9 mid-stream, back after 2 s on its AOF (everysec). Requests whose log lost
    its last second would end errored ``log_lost`` in band; the others go on and finish.
    (A kill of the process alone loses nothing on Linux: the kernel has every write.)"""
    _killed(tmp_path, database_url, model_dir, kill_and_restart, "everysec", lost_ok=True)


def test_redis_host_crash_loses_the_last_second_aof_everysec(
    tmp_path: Path, database_url: str, model_dir: Path
) -> None:
    """The same, but what the AOF had not fsynced at the crash instant never reached its
    disk (a crash of the host, which ``everysec`` allows), at ``memory`` (``disk`` needs
    ``always``): readers were sent events the crash took back. The requests whose log
    lost its tail end errored ``log_lost`` in band, never with another continuation
    spliced in; clients that resume from a lost event read the log again from the start;
    the others finish. The crash comes 2 s into the answers (80 tokens at 40/s): their
    ``created`` is older than the last fsync (``everysec``), so the crash takes a tail,
    not a whole log (at 30 tokens, 0.75 s, it could take every log whole: once in CI)."""
    _killed(
        tmp_path,
        database_url,
        model_dir,
        crash_and_restart,
        "everysec",
        lost_ok=True,
        tokens_before_fault=80,
    )


def test_redis_host_crash_mid_stream_aof_always(
    tmp_path: Path, database_url: str, model_dir: Path
) -> None:
    """A host crash under ``appendfsync always`` at ``disk`` (``make run``'s): readers were
    sent only what was fsynced, which the crash keeps. Nothing a client was sent is
    missing after the restart, the answers go on, and billing reconciles."""
    _killed(tmp_path, database_url, model_dir, crash_and_restart, "always", lost_ok=True)


def test_redis_host_crash_at_the_ends_of_answers_aof_always(
    tmp_path: Path, database_url: str, model_dir: Path
) -> None:
    """A host crash as the answers end, at ``disk``: an end a client saw (``[DONE]``) and
    billing recorded was fsynced, so the crash keeps it; an end it takes back was seen by
    nobody and billed by nobody. Each request ends once in its log, every client's text
    is the log's, and billing reconciles with the log."""
    _killed(
        tmp_path,
        database_url,
        model_dir,
        crash_and_restart,
        "always",
        lost_ok=True,
        tokens_before_fault=140,
    )


def test_redis_killed_mid_stream_aof_always(
    tmp_path: Path, database_url: str, model_dir: Path
) -> None:
    """The same with ``appendfsync always``: nothing is lost, every request finishes whole."""
    _killed(tmp_path, database_url, model_dir, kill_and_restart, "always", lost_ok=False)


def test_redis_killed_mid_stream_under_two_nodes_aof_always(
    tmp_path: Path, database_url: str, model_dir: Path
) -> None:
    """The same in front of two nodes (``lastevent node``): the clients spread over both,
    each request run by either, so a reader is fed from its node's memory or follows the
    log in Redis. Redis killed mid-stream and back on its AOF: the nodes ride through as
    the split deployment does -- nothing lost, every request whole, billing reconciles."""
    _killed(tmp_path, database_url, model_dir, kill_and_restart, "always", lost_ok=False, nodes=2)


def whole(run: Run, database_url: str) -> list[str]:
    """What a scenario that loses nothing may not show: client or request findings (every
    request whole), billing findings."""
    findings = client_findings(run.outcome)
    for c in run.outcome.accepted:
        findings += request_findings(c, run.found[c.rid or ""], lost_ok=False)
    return findings + billing_findings(run.stack, database_url, run.rids, run.since)


def test_redis_frozen_for_3_s(tmp_path: Path, database_url: str, model_dir: Path) -> None:
    """SIGSTOP for 3 s, then SIGCONT: connections hang rather than fail; all finish."""
    with scenario(
        tmp_path,
        database_url,
        model_dir,
        freeze,
        appendfsync="everysec",
        apis=2,
        workers=1,
        early=14,
        worker_concurrency=16,
    ) as run:
        run.check(whole(run, database_url))
        assert len(run.rids) == 18


@pytest.fixture(scope="module")
def forgotten(
    tmp_path_factory: pytest.TempPathFactory, database_url: str, model_dir: Path
) -> Iterator[Run]:
    """Redis restarted without persistence (it comes back empty) under 12 streams, then 6
    requests sent during and after the outage: run once, judged by the two tests below."""
    with scenario(
        tmp_path_factory.mktemp("forgotten"),
        database_url,
        model_dir,
        kill_and_restart,
        appendfsync=None,
        apis=1,
        workers=2,
        early=12,
        after=4,
    ) as run:
        yield run


def test_redis_restarted_without_its_data(forgotten: Run, database_url: str) -> None:
    """Open streams end (in-band ``log_lost``, or a clean end) instead of hanging;
    requests sent afterwards work (the workers make their consumer group again). Billing
    rows of what Redis forgot may be missing."""
    run = forgotten
    findings = client_findings(run.outcome)
    new = []
    for c in run.outcome.accepted:
        v = run.found[c.rid or ""]
        if c.cohort == "early":  # accepted before Redis went (it came back empty)
            findings += forgotten_findings(c, v)
        else:  # sent after the restart: must work as ever
            findings += request_findings(c, v, lost_ok=False)
            new.append(c.rid or "")
    # what Redis forgot may have no billing row; what came after has exactly one, and
    # the ledger agrees with what is left of the outbox
    findings += billing_findings(run.stack, database_url, new, run.since)
    run.check(findings, leaks=False)  # the next test's
    assert len(new) == 6, [(c.cohort, c.gave_up) for c in run.outcome.clients]


def test_redis_restarted_without_its_data_leaves_no_stray_keys(
    forgotten: Run, database_url: str
) -> None:
    """Nothing of what Redis forgot comes back as a key that never expires, and a forgotten
    request the ledger has a row for is answered from that row."""
    run = forgotten
    findings = run.leaks()
    rows = wait_rows(database_url, run.rids, safety_s=15)
    findings += [
        f"{c.rid}: billed, but its status answers {sorted(set(run.found[c.rid].statuses))}"
        for c in run.outcome.accepted
        if c.rid and c.cohort == "early" and rows.get(c.rid) and run.found[c.rid].state is None
    ]
    assert not findings, "\n".join(findings)


def cut_named_connections(server: ChaosRedis) -> Fault:
    """Every worker's named connection cut at once (a proxy or load balancer reset)."""

    def cut() -> None:
        client = server.client()
        named = [c for c in client.client_list() if c["name"].startswith("lastevent-worker-")]
        assert named, "no named connection to cut: the test tests nothing"
        for c in named:
            client.client_kill_filter(_id=c["id"])

    return Fault("CLIENT KILL of the workers' named connections", cut, lambda: None, 0.0)


def test_the_workers_connections_cut_at_once(
    tmp_path: Path, database_url: str, model_dir: Path
) -> None:
    """The workers' named connections killed under running streams, the processes alive:
    each comes back within the grace and announces itself again, so no worker is taken
    for lost (``Run.check``) and every answer finishes whole, without a takeover."""
    with scenario(
        tmp_path,
        database_url,
        model_dir,
        cut_named_connections,
        appendfsync="everysec",
        apis=2,
        workers=2,
        early=12,
    ) as run:
        findings = whole(run, database_url)
        for name in ("worker-1", "worker-2"):
            if "named connection is back" not in run.stack.tail(name, 10**7):
                findings.append(f"{name}: its named connection did not come back")
        run.check(findings)
