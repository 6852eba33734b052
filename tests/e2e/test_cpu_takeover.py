"""Takeover on a real model: SmolLM2-135M on the CPU engine (batched), its worker killed
(kill -9) mid-answer; the other worker prefills prompt + the logged ids and continues,
beside the requests it is already running.

Greedy decoding (temperature 0), so the answer is known: the same request run first on
the same stack with no kill. The client's text (and the ids in the log) must equal it
exactly. ``run_calm`` + ``interrupt_mid_answer`` are the scenario; ``tests/vllm`` runs
it on vLLM too (with a SIGTERM handover as well).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from service.store.keys import Keys
from service.stream import events as ev
from service.stream.lifecycle import Meta, State
from tests.e2e.conftest import Stack, make_stack
from tests.e2e.helpers import finish_reason
from tests.e2e.test_takeover import (
    SAFETY_S,
    Clients,
    Stream,
    assert_whole,
    freeze_when,
    now,
    owner_of,
    proc_named,
    reconcile_clean,
    start_streams,
    store,
    takeover_db,  # noqa: F401 - a fixture: a database of this module's own
)

pytestmark = pytest.mark.timeout(300)

# A worker beats every second: a stale limit of 3 s never takes over a live but busy one
# (these engines load the CPU), and still sees a killed one within a few seconds.
STALE_S = 3.0


def logged_ids(st: Stack, rid: str) -> list[int]:
    """The completion token ids in ``rid``'s log, in order, whoever wrote them."""
    entries = store(st).xrange(Keys(st.settings.key_prefix, st.settings.partitions).log(rid))
    found = (ev.decode(fields[b"e"]) for _, fields in entries)
    return [i for e in found if isinstance(e, ev.Delta) for i in e.token_ids]


def state_of(st: Stack, rid: str) -> str:
    raw = store(st).hget(Keys(st.settings.key_prefix, st.settings.partitions).meta(rid), Meta.STATE)
    return raw.decode() if raw else ""


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def run_calm(st: Stack, make: Callable[[], list[Stream]]) -> Clients:
    """``make()``'s streams, undisturbed: the answers an interrupted run must give."""
    calm = start_streams(st, make())
    calm.join()
    for s in calm.streams:
        assert_whole(st, s, s.text, takeovers=0, finish=finish_reason(s.events) or "")
    assert all(len(logged_ids(st, s.request_id)) > 8 for s in calm.streams), "too short"
    return calm


def interrupt_mid_answer(
    st: Stack,
    procs: dict[str, subprocess.Popen[bytes]],
    make: Callable[[], list[Stream]],
    calm: Clients,
    sig: signal.Signals = signal.SIGKILL,
) -> str:
    """Run ``make()``'s streams again and kill (SIGKILL) or stop (SIGTERM, to be started
    with ``worker_drain_s=0``) the owner of the first one mid-answer: every answer is the
    calm one, text and ids; that worker's unfinished ones were taken over (SIGKILL) or
    handed over (SIGTERM) once, the others never. Returns the name of that worker."""
    clients = start_streams(st, make())
    clients.wait_started()
    first, want = clients.streams[0], calm.streams[0].text
    victim = proc_named(st, procs, owner_of(st, first.request_id))
    # frozen for a moment with a third or more of the first answer in its log (not all of
    # it): the kill is mid-answer, and the next worker continues from well inside it
    freeze_when(st, procs[victim], first.request_id, lambda t: len(want) // 3 < len(t) < len(want))
    cut = {
        s.request_id: len(logged_ids(st, s.request_id))
        for s in clients.streams
        if owner_of(st, s.request_id).startswith(f"{victim}-")
        and state_of(st, s.request_id) == State.RUNNING
    }
    assert first.request_id in cut
    children = psutil.Process(procs[victim].pid).children(recursive=True)  # vLLM's engine
    try:
        procs[victim].send_signal(sig)
        os.kill(procs[victim].pid, signal.SIGCONT)  # a SIGTERM is handled once it runs again
        code = procs[victim].wait(timeout=SAFETY_S)
        if sig == signal.SIGTERM:
            assert code == 0, st.tail(victim)
            assert "handed over to another worker" in st.tail(victim, 10**7)
        clients.join()
        for before, s in zip(calm.streams, clients.streams, strict=True):
            was, got = logged_ids(st, before.request_id), logged_ids(st, s.request_id)
            at = first_difference(was, got)
            assert got == was, (
                f"{s.request_id}: ids differ from the uninterrupted run at index {at} "
                f"(cut after {cut.get(s.request_id)} ids): "
                f"{was[at : at + 8]} != {got[at : at + 8]}; whole runs: {was} / {got}"
            )
            moved = int(s.request_id in cut)
            lost, handed = (moved, 0) if sig == signal.SIGKILL else (0, moved)
            finish = finish_reason(before.events) or ""
            assert_whole(st, s, before.text, takeovers=lost, handovers=handed, finish=finish)
    finally:
        # the worker's own processes: vLLM's engine outlives a kill -9 of its worker
        for child in children:
            if child.is_running():
                os.kill(child.pid, signal.SIGKILL)
    return victim


def a_kill_mid_answer_changes_nothing(
    st: Stack, procs: dict[str, subprocess.Popen[bytes]], make: Callable[[], list[Stream]]
) -> None:
    since = now()
    interrupt_mid_answer(st, procs, make, run_calm(st, make))
    reconcile_clean(st, since)


@pytest.fixture
def cpu_stack(
    tmp_path: Path,
    redis_url: str,
    takeover_db: str,  # noqa: F811
    model_dir: Path,
) -> Iterator[Stack]:
    st = make_stack(
        tmp_path,
        redis_url,
        takeover_db,
        model_dir,
        engine="cpu",
        worker_stale_s=STALE_S,
        recorder_claim_idle_ms=1000,  # a killed worker's recorder entries are taken soon
    )
    try:
        yield st
    finally:
        st.stop()


def test_a_killed_cpu_workers_answer_continues_on_the_other(cpu_stack: Stack) -> None:
    st = cpu_stack
    procs = {"a": st.start_worker("a"), "b": st.start_worker("b")}
    st.start_api()

    def make() -> list[Stream]:
        """The answer to be interrupted, and three beside it: each worker's engine runs its
        requests as one batch, and the one that takes over continues the first inside its
        own batch -- every answer must still be the calm run's, id for id."""
        questions = [
            "Write a long story about a robot who learns to paint.",
            "Describe a walk through an old city at dawn.",
            "Explain how a bicycle stays upright.",
            "Tell the story of a lost umbrella.",
        ]
        return [Stream(q, {"temperature": 0, "max_tokens": 48}) for q in questions]

    a_kill_mid_answer_changes_nothing(st, procs, make)
