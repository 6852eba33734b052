"""Takeover on vLLM: three greedy answers in flight, the owner of the first killed
(kill -9) mid-answer, then another one stopped (SIGTERM) mid-answer; another worker
prefills prompt + the logged ids and continues. Every answer (text and ids) must equal the
same request's uninterrupted run on the same stack; the scenario is
``tests/e2e/test_cpu_takeover.py``'s.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, make_stack
from tests.e2e.test_cpu_takeover import STALE_S, interrupt_mid_answer, run_calm
from tests.e2e.test_takeover import (
    Stream,
    now,
    reconcile_clean,
    takeover_db,  # noqa: F401 - a fixture: a database of this module's own
)
from tests.vllm.conftest import VLLM_SETTINGS
from tests.waiting import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(600)]


QUESTIONS = [
    "Write a long story about a lighthouse keeper and the sea.",
    "Explain, step by step, how a bicycle works.",
    "Describe a walk through a busy city market in the morning.",
]


@pytest.fixture
def vllm_stack(
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
        worker_stale_s=STALE_S,
        recorder_claim_idle_ms=1000,  # a killed worker's recorder entries are taken soon
    )
    try:
        yield st
    finally:
        st.stop()


def start_workers(st: Stack, *names: str) -> dict[str, subprocess.Popen[bytes]]:
    """Start vLLM workers side by side (each takes ~30-60 s), then wait for all of them."""
    procs = {
        name: st.start_worker(name, wait=False, worker_drain_s=0, **VLLM_SETTINGS) for name in names
    }
    for name, proc in procs.items():
        wait_until(
            lambda name=name, proc=proc: (
                proc.poll() is not None or "ready (engine" in st.tail(name, 10**7)
            ),
            f"vLLM worker {name} to start",
            timeout=400,
            interval=0.5,
        )
        assert proc.poll() is None, st.tail(name)
    return procs


def test_a_killed_then_a_stopped_vllm_workers_answers_continue_elsewhere(vllm_stack: Stack) -> None:
    """Three workers: one is killed (kill -9) under the answers, then one of the other two
    is stopped (SIGTERM, no drain time) under them: its answers are handed over."""
    st, since = vllm_stack, now()
    procs = start_workers(st, "a", "b", "c")
    st.start_api()

    def make() -> list[Stream]:
        return [Stream(q, {"temperature": 0, "max_tokens": 80}) for q in QUESTIONS]

    calm = run_calm(st, make)
    killed = interrupt_mid_answer(st, procs, make, calm, signal.SIGKILL)
    alive = {name: proc for name, proc in procs.items() if name != killed}
    interrupt_mid_answer(st, alive, make, calm, signal.SIGTERM)
    reconcile_clean(st, since)
