"""The embedded default: a real SmolLM2-135M worker on the CPU, through the API and the SDK."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from service.store.heartbeats import Heartbeat
from service.store.keys import Keys
from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import assert_ids_increase, content_of, read_all


@pytest.fixture(scope="module")
def cpu_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("cpu"), redis_url, database_url, model_dir, engine="cpu"
    ) as st:
        yield st


def test_real_model_streams_and_resumes(cpu_stack: Stack) -> None:
    sdk = OpenAI(base_url=cpu_stack.url + "/v1", api_key="unused", max_retries=0)
    chunks = list(
        sdk.chat.completions.create(
            model=cpu_stack.model,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=24,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    rid = chunks[0].id
    with httpx.Client(base_url=cpu_stack.url, timeout=60) as client:
        _, replay = read_all(client, "GET", f"/v1/requests/{rid}/events")
        assert content_of(replay) == text
        assert_ids_increase(replay)
        # greedy decoding is deterministic: a second run gives the same answer
        again = client.post(
            "/v1/chat/completions",
            json={
                "model": cpu_stack.model,
                "temperature": 0,
                "max_tokens": 24,
                "messages": [{"role": "user", "content": "What is the capital of France?"}],
            },
        ).json()
        assert again["choices"][0]["message"]["content"] == text


def test_the_batch_is_the_workers_slots_and_answers_stay_whole(
    tmp_path: Path, redis_url: str, database_url: str, model_dir: Path
) -> None:
    """``LASTEVENT_CPU_MAX_BATCH=2``: the worker's heartbeat offers 2 slots (what admission
    counts), and four greedy requests sent together -- two batched, two waiting in the
    queue -- each get the answer they get alone."""

    with running(tmp_path, redis_url, database_url, model_dir, engine="cpu", cpu_max_batch=2) as st:
        sdk = OpenAI(base_url=st.url + "/v1", api_key="unused", max_retries=0)
        questions = [
            "What is 2+2?",
            "Name a colour.",
            "Say hello.",
            "What is the capital of Italy?",
        ]

        def ask(q: str) -> str:
            answer = sdk.chat.completions.create(
                model=st.model,
                messages=[{"role": "user", "content": q}],
                temperature=0,
                max_tokens=16,
            )
            return answer.choices[0].message.content or ""

        alone = [ask(q) for q in questions]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(ask, questions))
        assert together == alone

        keys = Keys(st.settings.key_prefix, st.settings.partitions)
        beats = st.store().hgetall(keys.workers).values()
        assert [Heartbeat.decode(b).slots for b in beats] == [2]
