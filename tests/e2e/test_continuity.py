"""A reader never sends a gap or a repeat: every delta must start where the previous one
of its choice ended. A log that does not follow on (entries a failover took back, a
continuation spliced after a shortened log) ends the stream with an in-band ``log_lost``
instead of text that was never one answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from httpx_sse import EventSource

from service.store.keys import EVENT_FIELD, Keys
from service.stream import events as ev
from tests.e2e.conftest import NODE, Stack, running
from tests.e2e.helpers import LONG, chat_body, content_of


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("continuity"),
        redis_url,
        database_url,
        model_dir,
        scripted_tokens_per_s=20.0,
    ) as st:
        yield st


@pytest.mark.skipif(
    NODE,
    reason="a node's reader is fed its worker's own appends; an entry written into the log "
    "behind the append script (this raw XADD) reaches only readers that read Redis (DESIGN "
    "amendment 41)",
)
def test_a_spliced_log_ends_the_stream_in_band(stack: Stack) -> None:
    keys = Keys(stack.settings.key_prefix, stack.settings.partitions)
    spliced = ev.Delta(text="SPLICED", token_ids=[5], n=999)  # not where the answer was
    events = []
    with (
        httpx.Client(timeout=60) as client,
        client.stream(
            "POST",
            stack.url + "/v1/chat/completions",
            json=chat_body(stack.model, LONG, stream=True),
        ) as r,
    ):
        rid = r.headers["x-request-id"]
        for event in EventSource(r).iter_sse():
            events.append(event)
            if len(events) == 3:  # (written as another continuation would have it)
                stack.store().xadd(keys.log(rid), {EVENT_FIELD: ev.encode(spliced)})
    assert "SPLICED" not in content_of(events)
    errors = [json.loads(e.data)["error"] for e in events if e.data and '"error"' in e.data[:10]]
    assert [e["code"] for e in errors] == ["log_lost"]
    assert LONG.startswith(content_of(events))  # what it got was the answer, as far as it went
