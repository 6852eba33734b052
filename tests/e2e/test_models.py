"""Many models behind one front end: workers declare a model and its adapters, each request
waits in its model's queues and only workers serving that model take it, ``/v1/models``
lists what a live worker serves, and a takeover continues on a worker of the same model.

Real processes: scripted workers of two models (one with an adapter: the scripted engine
starts an adapter's answer with ``[name]``), a CPU worker of a third model (SmolLM2 for
real), and one killed with ``kill -9`` for the takeover.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from service.settings import MODEL_NAME
from tests.e2e.conftest import Stack, make_stack
from tests.e2e.helpers import chat_body, ledger_row
from tests.e2e.test_takeover import (
    SAFETY_S,
    Stream,
    assert_whole,
    claims,
    owner_of,
    proc_named,
    questions,
    seen_connected,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(300)

OTHER = "tiny-beta"  # a second model (the same tokenizer, under another name)
ADAPTER = "tone"  # an adapter on the first
CPU = "smol-cpu"  # a third model, on the CPU engine
IDLE = "tiny-idle"  # a model the API knows, that no worker serves


def listed(url: str) -> dict[str, dict[str, Any]]:
    data = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    return {m["id"]: m for m in data}


def chat(url: str, model: str, content: str, **extra: Any) -> httpx.Response:
    body = chat_body(model, content, **extra)
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=SAFETY_S)


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    models = ",".join(f"{m}={model_dir}" for m in (OTHER, CPU, IDLE))
    st = make_stack(
        tmp_path_factory.mktemp("fleet"), redis_url, database_url, model_dir, models=models
    )
    try:
        st.start_worker("a", scripted_text="alpha answers", lora_modules=f"{ADAPTER}=/none")
        st.start_worker("b", model_name=OTHER, scripted_text="beta answers")
        st.start_worker("c", model_name=CPU, engine="cpu")
        st.start_api()
        wanted = {MODEL_NAME, OTHER, ADAPTER, CPU}
        wait_until(lambda: set(listed(st.url)) == wanted, "every model listed")
        yield st
    finally:
        st.stop()


def test_models_lists_each_model_and_adapter_with_its_parent(fleet: Stack) -> None:
    sdk = OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)
    found = {m.id: m for m in sdk.models.list()}
    assert set(found) == {MODEL_NAME, OTHER, ADAPTER, CPU}  # not IDLE: nobody serves it
    models = listed(fleet.url)
    assert models[ADAPTER]["parent"] == MODEL_NAME and models[ADAPTER]["root"] == MODEL_NAME
    assert all(models[m]["parent"] is None for m in (MODEL_NAME, OTHER, CPU))
    one = httpx.get(f"{fleet.url}/v1/models/{ADAPTER}", timeout=30)
    assert one.status_code == 200 and one.json() == models[ADAPTER]
    missing = httpx.get(f"{fleet.url}/v1/models/{IDLE}", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_each_request_lands_on_a_worker_of_its_model(fleet: Stack) -> None:
    wanted = {
        MODEL_NAME: "alpha answers",
        OTHER: "beta answers",
        ADAPTER: f"[{ADAPTER}] alpha answers",
    }
    jobs = [(m, i) for m in wanted for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(lambda j: chat(fleet.url, j[0], f"q{j[1]}"), jobs))
    for (model, _), r in zip(jobs, answers, strict=True):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == model
        assert body["choices"][0]["message"]["content"] == wanted[model]
    # the billing row names the model asked for; the log, the worker that ran it
    for (model, _), r in zip(jobs, answers, strict=True):
        rid = r.json()["id"]
        row = ledger_row(fleet.settings.database_url or "", rid, timeout_s=60)
        assert row is not None and row["model"] == model, row
        worker = "b-" if model == OTHER else "a-"
        assert [by[:2] for by, _ in claims(fleet, rid)] == [worker], claims(fleet, rid)


def test_a_cpu_worker_serves_its_model_beside_scripted_ones(fleet: Stack) -> None:
    r = chat(fleet.url, CPU, "What is the capital of France?", temperature=0, max_tokens=24)
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]
    [(by, _)] = claims(fleet, r.json()["id"])
    assert by.startswith("c-")


def test_unknown_and_unserved_models_are_refused_before_the_first_byte(fleet: Stack) -> None:
    for stream in (False, True):
        unknown = chat(fleet.url, "gpt-nope", "x", stream=stream)
        assert unknown.status_code == 404, unknown.text
        assert unknown.json()["error"]["code"] == "model_not_found"
        # known (the API has its tokenizer) but no live worker serves it: come back later
        idle = chat(fleet.url, IDLE, "x", stream=stream)
        assert idle.status_code == 503, idle.text
        assert idle.json()["error"]["code"] == "no_worker"
        assert int(idle.headers["retry-after"]) >= 1


def test_a_model_whose_workers_stopped_is_no_longer_listed(
    tmp_path: Path, redis_url: str, database_url: str, model_dir: Path
) -> None:
    st = make_stack(tmp_path, redis_url, database_url, model_dir, models=f"{OTHER}={model_dir}")
    try:
        st.start_worker("a")
        b = st.start_worker("b", model_name=OTHER)
        st.start_api()
        wait_until(lambda: set(listed(st.url)) == {MODEL_NAME, OTHER}, "both listed")
        assert chat(st.url, OTHER, "still here").json()["choices"][0]["message"]["content"]
        b.send_signal(signal.SIGTERM)
        b.wait(timeout=60)
        wait_until(lambda: set(listed(st.url)) == {MODEL_NAME}, "the stopped model unlisted")
        gone = chat(st.url, OTHER, "anyone?")
        assert gone.status_code == 503 and gone.json()["error"]["code"] == "no_worker"
        assert chat(st.url, MODEL_NAME, "hello").status_code == 200
    finally:
        st.stop()


def test_a_takeover_continues_on_a_worker_of_the_same_model(
    tmp_path: Path, redis_url: str, database_url: str, model_dir: Path
) -> None:
    """Two workers of the model and one of another, with free slots: the killed worker's
    requests continue on the other worker of their model, never on the other model's."""
    st = make_stack(
        tmp_path,
        redis_url,
        database_url,
        model_dir,
        scripted_tokens_per_s=40.0,
        worker_concurrency=32,
        worker_stale_s=600.0,  # only the killed connection can tell
        models=f"{OTHER}={model_dir}",
    )
    try:
        procs = {"a1": st.start_worker("a1"), "a2": st.start_worker("a2")}
        st.start_worker("b", model_name=OTHER)
        st.start_api()
        seen_connected(st, 3)
        streams = [Stream(q) for q in questions(6)]
        with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
            futures = [pool.submit(s.run, st.url, MODEL_NAME) for s in streams]
            for s in streams:
                assert s.started.wait(SAFETY_S), "a stream never started"
            owners = {s.request_id: owner_of(st, s.request_id) for s in streams}
            victim = proc_named(st, procs, owners[streams[0].request_id])
            os.kill(procs[victim].pid, signal.SIGKILL)
            procs[victim].wait()
            for f in futures:
                f.result(timeout=SAFETY_S)
        for s in streams:
            lost = owners[s.request_id].startswith(f"{victim}-")
            assert_whole(st, s, s.question, takeovers=int(lost))
            # every worker that wrote to it served its model: never b
            assert all(by.startswith("a") for by, _ in claims(st, s.request_id)), claims(
                st, s.request_id
            )
    finally:
        st.stop()
