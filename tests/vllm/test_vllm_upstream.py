"""The upstream engine (``LASTEVENT_ENGINE=upstream``, token mode) in front of a real
``vllm serve`` (tests/vllm/vllm_serve.py; one per module, ~30-60 s to start).

- The engine contract (tests/engine_contract.py) on ``UpstreamEngine`` pointed at it;
  ``held`` is vLLM's own gauges (``vllm:num_requests_running`` + ``_waiting``), so an
  abort or a consumer that walks away must reach vLLM's engine.
- Through lastevent (API and upstream workers as processes): a greedy chat stream is
  vLLM's own greedy answer to the same request; a parked request leaves vLLM and a reader
  back with ``Last-Event-ID`` gets the whole answer; a cancel aborts the request in vLLM;
  a worker killed (kill -9) mid-answer is continued by another, greedy-exact; vLLM itself
  killed (kill -9) mid-answer and started again on the same port: the answer goes on,
  greedy-exact.

Greedy answers are known beforehand (vLLM's own, or the same stack's undisturbed run),
so every assertion is on texts, ids and states; the timeouts are safety nets only.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import httpx
import pytest
import pytest_asyncio
import redis
from httpx_sse import EventSource

from service.settings import MODEL_NAME, Settings
from service.store.heartbeats import Heartbeat
from service.store.keys import Keys
from service.stream import events as ev
from service.stream.lifecycle import Meta
from service.stream.params import SamplingParams
from service.tokenize import ModelInfo
from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import (
    assert_ids_increase,
    chat_body,
    content_of,
    finish_reason,
    read_all,
    read_some,
    wait_state,
)
from tests.e2e.test_cpu_takeover import (
    interrupt_mid_answer,
    logged_ids,
    run_calm,
    state_of,
)
from tests.e2e.test_park import meta
from tests.e2e.test_takeover import (
    Stream,
    now,
    reconcile_clean,
    takeover_db,  # noqa: F401 - a fixture: a database of this module's own
)
from tests.e2e.test_upstream_stack import in_front_of, upstream_stack
from tests.engine_contract import (
    JSON_MAX_TOKENS,
    JSON_QUESTION,
    LONG,
    STRUCTURED,
    EngineContract,
    chat_ids,
    collect,
    ids_of,
)
from tests.vllm.vllm_serve import VllmServe, held
from tests.waiting import wait_until
from workers.engines.base import EngineError
from workers.engines.upstream import UpstreamConfig, UpstreamEngine

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(600)]

STORY = "Write a long story about a lighthouse keeper and the sea."
RESTART_S = 600.0  # a safety net: vLLM started again on a loaded machine, then the rest


def config(vllm_serve: VllmServe, model: ModelInfo) -> UpstreamConfig:
    defaults = Settings()
    return UpstreamConfig(
        urls=(vllm_serve.url,),
        model=MODEL_NAME,
        eos_token_ids=tuple(model.eos_token_ids),
        idle_timeout_s=defaults.upstream_idle_timeout_s,
        first_token_timeout_s=defaults.upstream_first_token_timeout_s,
        retry_s=defaults.upstream_retry_s,
    )


# -- the engine contract ---------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def upstream_engine(vllm_serve: VllmServe, model: ModelInfo) -> AsyncIterator[UpstreamEngine]:
    engine = UpstreamEngine(config(vllm_serve, model))
    await engine.start()
    assert engine.available
    yield engine
    await engine.close()


@pytest.mark.asyncio(loop_scope="module")
class TestVllmUpstreamContract(EngineContract):
    skips: ClassVar[Mapping[str, str]] = {
        "a_continuation_under_structured_output_or_penalties_is_the_rest": (
            "vLLM's server sees the ids handed over as prompt, so its presence and frequency "
            "penalties and its grammar would start again: the upstream engine refuses such a "
            "continuation by design (EngineError unsupported_continuation, asserted by "
            "test_a_continuation_vllm_cannot_make_exactly_is_refused below)"
        ),
    }

    def held(self, engine: Any) -> int | None:
        return held(engine.config.urls[0])

    @pytest.fixture
    def contract_engine(self, upstream_engine: UpstreamEngine) -> UpstreamEngine:
        return upstream_engine

    @pytest.fixture
    def contract_cold_engine(self, vllm_serve: VllmServe, model: ModelInfo) -> UpstreamEngine:
        return UpstreamEngine(config(vllm_serve, model))  # built, never started


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("under", ["structured", "presence_penalty", "frequency_penalty"])
async def test_a_continuation_vllm_cannot_make_exactly_is_refused(
    upstream_engine: UpstreamEngine, vllm_serve: VllmServe, model: ModelInfo, under: str
) -> None:
    """A continuation (ids handed over) under what counts output ids: refused before vLLM
    is asked, with the code the runner reads; from the start it runs."""
    if under == "structured":
        prompt = chat_ids(model, JSON_QUESTION)
        params = SamplingParams(
            max_tokens=JSON_MAX_TOKENS, temperature=0.0, structured=STRUCTURED["json_schema"]
        )
    else:
        prompt = chat_ids(model, LONG)
        penalty: dict[str, Any] = {under: 1.0}
        params = SamplingParams(max_tokens=8, temperature=0.0, **penalty)
    whole = ids_of(await collect(upstream_engine, prompt, params, "whole"))
    assert whole
    with pytest.raises(EngineError) as refused:
        await collect(upstream_engine, prompt, params, "rest", whole[:2])
    assert refused.value.code == "unsupported_continuation"
    assert vllm_serve.held() == 0


# -- through lastevent -----------------------------------------------------------------


def logged(want_ids: list[int], model: ModelInfo) -> list[int]:
    """vLLM's ids of an answer as lastevent's log has them: without the EOS (it ends the
    answer, and is counted, but is no text)."""
    return want_ids[:-1] if want_ids and want_ids[-1] in model.eos_token_ids else want_ids


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    takeover_db: str,  # noqa: F811
    model_dir: Path,
    vllm_serve: VllmServe,
) -> Iterator[Stack]:
    """One upstream worker and one API; a reader-less request parks after 0.5 s."""
    with running(
        tmp_path_factory.mktemp("upstream"),
        redis_url,
        takeover_db,
        model_dir,
        **in_front_of(vllm_serve),
        park_after_s=0.5,
        presence_check_s=0.2,
        lease_refresh_s=0.5,
        lease_ttl_s=2.0,
        sweep_interval_s=0.5,
        cancel_wait_s=10.0,
    ) as st:
        yield st


@pytest.mark.parametrize(
    ("question", "max_tokens"),
    [("What is the capital of France?", 64), ("Explain, step by step, how a bicycle works.", 60)],
)
def test_a_greedy_stream_is_vllms_own_answer(
    stack: Stack, vllm_serve: VllmServe, model: ModelInfo, question: str, max_tokens: int
) -> None:
    """The same chat sent to vLLM's /v1/chat/completions and through lastevent: the same
    text, ids, finish and token counts (lastevent's template, vLLM's ids)."""
    want, want_ids, want_finish = vllm_serve.greedy_chat(question, max_tokens)
    body = chat_body(
        stack.model,
        question,
        stream=True,
        temperature=0,
        max_tokens=max_tokens,
        stream_options={"include_usage": True},
    )
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        headers, events = read_all(client, "POST", "/v1/chat/completions", json=body)
    rid = headers["x-request-id"]
    assert content_of(events) == want
    assert finish_reason(events) == want_finish
    assert logged_ids(stack, rid) == logged(want_ids, model)
    usage = json.loads(next(e.data for e in reversed(events) if '"usage"' in e.data))["usage"]
    assert usage["completion_tokens"] == len(want_ids)


def test_a_parked_answer_leaves_vllm_and_a_returning_reader_gets_it_whole(
    stack: Stack, vllm_serve: VllmServe, model: ModelInfo
) -> None:
    """No reader past park_after_s: the request leaves vLLM (its stream closed, vLLM's
    engine aborts it: not counted as finished); a reader back with Last-Event-ID gets the
    rest, and the whole is vLLM's own greedy answer."""
    want, want_ids, want_finish = vllm_serve.greedy_chat(STORY, 160)
    finished = vllm_serve.finished()
    body = chat_body(stack.model, STORY, stream=True, temperature=0, max_tokens=160)
    rid, seen, _ = read_some(stack.url, body, 6)
    status = wait_state(stack.url, rid, {"parked", "finished"})
    assert status["state"] == "parked", status
    wait_until(lambda: vllm_serve.held() == 0, "vLLM to let the parked request go")
    assert vllm_serve.finished() == finished  # aborted in vLLM, not run to its end
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        _, rest = read_all(
            client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": seen[-1].id}
        )
    assert content_of(seen + rest) == want
    assert_ids_increase(seen + rest)
    assert finish_reason(rest) == want_finish and rest[-1].data == "[DONE]"
    assert logged_ids(stack, rid) == logged(want_ids, model)
    assert int(meta(stack, rid)[Meta.PARKS]) == 1


def test_a_cancel_aborts_the_request_in_vllm(stack: Stack, vllm_serve: VllmServe) -> None:
    """POST .../cancel mid-answer: the request ends cancelled, and vLLM's own gauge of
    running requests falls to 0 with nothing counted finished (it was aborted there)."""
    finished = vllm_serve.finished()
    body = chat_body(
        stack.model, STORY, stream=True, temperature=0, max_tokens=1500, ignore_eos=True
    )
    events = []
    with (
        httpx.Client(base_url=stack.url, timeout=120) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        rid = r.headers["x-request-id"]
        for event in EventSource(r).iter_sse():
            events.append(event)
            if len(events) == 5:
                assert vllm_serve.running() == 1
                cancelled = client.post(f"/v1/requests/{rid}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    assert finish_reason(events) == "cancelled" and events[-1].data == "[DONE]"
    wait_until(lambda: vllm_serve.running() == 0, "vLLM to abort the cancelled request")
    assert vllm_serve.held() == 0
    assert vllm_serve.finished() == finished


def test_a_killed_upstream_workers_answers_continue_on_another(
    tmp_path: Path,
    redis_url: str,
    takeover_db: str,  # noqa: F811
    model_dir: Path,
    vllm_serve: VllmServe,
) -> None:
    """Two upstream workers; the owner of a greedy answer is killed (kill -9) mid-answer:
    the other continues it (prompt + logged ids to vLLM), and the answer equals the
    undisturbed run's, text and ids -- which is vLLM's own answer. One answer at a time:
    vLLM's own is of one request alone, and a batch's float32 sums on CPU may differ from
    it in a near tie (the vLLM worker's takeover test runs three in a batch)."""
    st, since = upstream_stack(tmp_path, vllm_serve, redis_url, takeover_db, model_dir), now()
    try:
        procs = {"a": st.start_worker("a"), "b": st.start_worker("b")}
        st.start_api()

        def make() -> list[Stream]:
            return [Stream(STORY, {"temperature": 0, "max_tokens": 80})]

        calm = run_calm(st, make)
        [s] = calm.streams
        own = vllm_serve.greedy_chat(s.question, 80)[0]
        assert s.text == own, f"{s.text!r} != {own!r}"
        interrupt_mid_answer(st, procs, make, calm, signal.SIGKILL)
        wait_until(lambda: vllm_serve.held() == 0, "vLLM to let the killed worker's call go")
        reconcile_clean(st, since)
    finally:
        st.stop()


@dataclasses.dataclass
class Interrupted:
    """A stack with one upstream worker, and a greedy stream through it whose answer is
    known (vLLM's own): what a test of a fault of vLLM's starts from."""

    st: Stack
    stream: Stream
    reading: concurrent.futures.Future[None]
    want: tuple[str, list[int], str]  # vLLM's own text, ids and finish

    def assert_whole(self, model: ModelInfo) -> None:
        """The reader, connected all along, got vLLM's own answer, text and ids."""
        st, stream, (text, ids, finish) = self.st, self.stream, self.want
        self.reading.result(timeout=RESTART_S)
        assert stream.text == text
        assert logged_ids(st, stream.request_id) == logged(ids, model)
        assert finish_reason(stream.events) == finish
        assert stream.events[-1].data == "[DONE]" and "\ufffd" not in stream.text
        assert_ids_increase(stream.events)
        status = httpx.get(f"{st.url}/v1/requests/{stream.request_id}").json()
        assert status["state"] == "finished", status


@contextlib.contextmanager
def frozen_mid_answer(
    tmp_path: Path, redis_url: str, db: str, model_dir: Path, vllm_serve: VllmServe, **settings: Any
) -> Iterator[Interrupted]:
    """One upstream worker (``settings``), a greedy answer through it, and vLLM frozen
    (SIGSTOP of its process group) with a third or more of that answer in the log; vLLM
    goes on (SIGCONT) at the end if it is still there."""
    want = vllm_serve.greedy_chat(STORY, 120)
    since = now()
    st = upstream_stack(tmp_path, vllm_serve, redis_url, db, model_dir, **settings)
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        st.start_worker("w")
        st.start_api()
        stream = Stream(STORY, {"temperature": 0, "max_tokens": 120})
        reading = pool.submit(stream.run, st.url, st.model)
        assert stream.started.wait(RESTART_S), "the stream never started"
        text = want[0]
        freeze_vllm_when(vllm_serve, st, stream, lambda t: len(text) // 3 < len(t) < len(text))
        assert state_of(st, stream.request_id) == "running"
        yield Interrupted(st, stream, reading, want)
        reconcile_clean(st, since)
    finally:
        if vllm_serve.proc is not None and vllm_serve.proc.poll() is None:
            vllm_serve.send(signal.SIGCONT)
        pool.shutdown(wait=False, cancel_futures=True)
        st.stop()


def test_vllm_hung_mid_answer_past_the_idle_timeout_the_answer_goes_on(
    tmp_path: Path,
    redis_url: str,
    takeover_db: str,  # noqa: F811
    model_dir: Path,
    vllm_serve: VllmServe,
    model: ModelInfo,
) -> None:
    """vllm serve frozen mid-answer (a hung server: its port still takes connections, and
    nothing answers) for longer than LASTEVENT_UPSTREAM_IDLE_TIMEOUT_S, more than once:
    the worker gives up the silent stream and asks again; once vLLM goes on, the answer
    completes greedy-exact, and vLLM holds none of the calls given up."""
    with frozen_mid_answer(
        tmp_path, redis_url, takeover_db, model_dir, vllm_serve, upstream_idle_timeout_s=2.0
    ) as run:
        wait_until(
            lambda: run.st.tail("w", 10**7).count("sent nothing for a while") >= 2,
            "the worker to give up a silent stream twice",
            timeout=120,
        )
        assert not run.reading.done()
        vllm_serve.send(signal.SIGCONT)
        run.assert_whole(model)
        wait_until(lambda: vllm_serve.held() == 0, "vLLM to drop the calls given up")


def test_vllm_killed_and_started_again_mid_answer_the_answer_goes_on(
    tmp_path: Path,
    redis_url: str,
    takeover_db: str,  # noqa: F811
    model_dir: Path,
    vllm_serve: VllmServe,
    model: ModelInfo,
) -> None:
    """vllm serve killed (kill -9, its engine core too) with a third or more of a greedy
    answer in the log, then started again on the same port: the worker offers no slots
    meanwhile, tries again until it answers, asks for the rest (prompt + logged ids), and
    the reader, connected all along, gets vLLM's own greedy answer, text and ids."""
    with frozen_mid_answer(
        tmp_path, redis_url, takeover_db, model_dir, vllm_serve, upstream_retry_s=180.0
    ) as run:
        assert slots_offered(run.st) > 0
        vllm_serve.kill()
        assert not run.reading.done()
        # its upstream refuses connections: the worker offers no slots (it claims nothing)
        wait_until(lambda: slots_offered(run.st) == 0, "the worker to offer no slots")
        vllm_serve.start()
        run.assert_whole(model)
        wait_until(lambda: slots_offered(run.st) > 0, "the worker to offer its slots again")
        worker_log = run.st.tail("w", 10**7)
        assert "refuses connections" in worker_log and "answers again" in worker_log


def slots_offered(st: Stack) -> int:
    """The slots the stack's workers offer in their heartbeats."""
    keys = Keys(st.settings.key_prefix, st.settings.partitions)
    return sum(Heartbeat.decode(raw).slots for raw in st.store().hgetall(keys.workers).values())


STEP_S = 0.05  # vLLM runs this long between two looks at the log (about a token here)
QUIET_S = 0.2  # the log still this long with vLLM frozen: the worker logged what it sent


def freeze_vllm_when(
    vllm_serve: VllmServe, st: Stack, stream: Stream, ready: Callable[[str], bool]
) -> str:
    """Step vLLM until the stream's logged text satisfies ``ready``; returns that text,
    vLLM left frozen (SIGSTOP of its process group). vLLM is frozen whenever the log is
    looked at, and runs ``STEP_S`` at a time in between: a test process that is slow to
    look (a loaded machine) cannot let the answer run past the cut, as it could when vLLM
    ran free and the test raced it (CI failed twice so, the answer ended at 'Once upon').
    Fails at once, showing the whole log, if the request ends before the cut."""
    client, key = (
        st.store(),
        Keys(st.settings.key_prefix, st.settings.partitions).log(stream.request_id),
    )
    last, seen, steps = b"0-0", "", 0
    vllm_serve.send(signal.SIGSTOP)
    deadline = time.monotonic() + RESTART_S
    while time.monotonic() < deadline:
        # vLLM is frozen: what it sent reaches the log, which then stays as it is
        while found := client.xread({key: last}, block=int(QUIET_S * 1000)):
            for _, entries in found:
                for entry_id, fields in entries:
                    last, event = entry_id, ev.decode(fields[b"e"])
                    seen += event.text if isinstance(event, ev.Delta) else ""
        if ready(seen):
            return seen
        state = state_of(st, stream.request_id)
        assert state in ("queued", "running"), (
            f"the request ended ({state}) before the cut, after {steps} steps of vLLM:\n"
            + log_story(client, key)
            + "\nthe worker's log:\n"
            + st.tail("w", 4000)
        )
        vllm_serve.send(signal.SIGCONT)
        time.sleep(STEP_S)
        vllm_serve.send(signal.SIGSTOP)
        steps += 1
    raise AssertionError(f"the log never reached the wanted cut: {seen!r}")


def log_story(client: redis.Redis, key: str) -> str:
    """The log, one line per entry: when it was appended (its id's milliseconds) and
    its event, shortened."""
    lines = []
    for entry_id, fields in client.xrange(key):
        event = ev.decode(fields[b"e"])
        lines.append(f"{entry_id.decode()} {str(event)[:200]}")
    return "\n".join(lines)


# -- text mode in front of the same vllm serve: the conversation in, text out ----------


@pytest.fixture(scope="module")
def text_stack(
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    takeover_db: str,  # noqa: F811
    model_dir: Path,
    vllm_serve: VllmServe,
) -> Iterator[Stack]:
    """One upstream worker in text mode (vLLM's chat route, as any OpenAI-compatible
    server is asked) and one API; a reader-less request would park after 0.5 s."""
    with running(
        tmp_path_factory.mktemp("text"),
        redis_url,
        takeover_db,
        model_dir,
        **in_front_of(vllm_serve),
        upstream_mode="text",
        park_after_s=0.5,
        presence_check_s=0.2,
        cancel_wait_s=10.0,
    ) as st:
        yield st


def test_text_mode_streams_vllms_own_answer_with_its_usage(
    text_stack: Stack, vllm_serve: VllmServe
) -> None:
    """The conversation goes to vLLM's /v1/chat/completions as it came: the text, the
    finish and the completion tokens are vLLM's own (its template, its count)."""
    question = "What is the capital of France?"
    want, want_ids, want_finish = vllm_serve.greedy_chat(question, 64)
    body = chat_body(
        text_stack.model,
        question,
        stream=True,
        temperature=0,
        max_tokens=64,
        stream_options={"include_usage": True},
    )
    with httpx.Client(base_url=text_stack.url, timeout=120) as client:
        _, events = read_all(client, "POST", "/v1/chat/completions", json=body)
    assert content_of(events) == want
    assert finish_reason(events) == want_finish
    usage = json.loads(next(e.data for e in reversed(events) if '"usage"' in e.data))["usage"]
    assert usage["completion_tokens"] == len(want_ids)


def test_text_mode_a_gone_reader_does_not_park_and_a_cancel_reaches_vllm(
    text_stack: Stack, vllm_serve: VllmServe
) -> None:
    """The reader leaves: past park_after_s the request is still running in vLLM (text
    mode cannot continue a prefix, so it never parks); a cancel then closes the stream
    and vLLM's running gauge falls to 0 with nothing counted finished."""
    finished = vllm_serve.finished()
    body = chat_body(text_stack.model, STORY, stream=True, temperature=0, max_tokens=1500)
    rid, _, _ = read_some(text_stack.url, body, 4)
    wait_until(lambda: vllm_serve.running() == 1, "vLLM to be running it")
    # the owner's check saw the reader gone (a token-mode worker parks 0.5 s after this);
    # then well past the park delay, the request must still be running
    wait_until(lambda: Meta.GONE_MS in meta(text_stack, rid), "the reader seen gone")
    time.sleep(2.0)  # (room for a wrong park to happen: no assertion on time)
    assert state_of(text_stack, rid) == "running"
    assert Meta.PARKS not in meta(text_stack, rid)
    assert vllm_serve.running() == 1
    cancelled = httpx.post(f"{text_stack.url}/v1/requests/{rid}/cancel", timeout=30)
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    wait_until(lambda: vllm_serve.running() == 0, "vLLM to abort the cancelled request")
    assert vllm_serve.finished() == finished
