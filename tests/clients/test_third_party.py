"""Third-party clients, unmodified, against a real stack: npm ``eventsource`` and
``@microsoft/fetch-event-source`` through the CuttingProxy (every connection cut after
300-3000 bytes), the ``openai`` Node SDK through a plain proxy (it cannot resume) and,
to say what it does, through the cutting one. The Node scripts (tests/clients/node/)
report every event they dispatched with its id; these tests compare them with the
uninterrupted stream read straight from the API: lost, duplicated, exact text, and no
connection after the end."""

from __future__ import annotations

import collections
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from httpx_sse import EventSource
from lastevent_client import Client

from tests.clients.conftest import QUESTION, ClientStack, RecordingProxy, api_target
from tests.clients.proxy import CuttingProxy

pytestmark = pytest.mark.clients
USER = [{"role": "user", "content": QUESTION}]


def run(node: Any, script: str, url: str, stack: ClientStack, api_key: str, mode: str = "") -> Any:
    env = {
        "LASTEVENT_URL": url,
        "LASTEVENT_API_KEY": api_key,
        "LASTEVENT_MODEL": stack.model,
        "QUESTION": QUESTION,
        "MODE": mode,
    }
    return node(f"node/{script}", env=env, timeout=150).result()


def uninterrupted(stack: ClientStack, api_key: str, request_id: str) -> list[tuple[str, str]]:
    """``(id, data)`` of every event of the request, read from the start, no proxy."""
    with (
        httpx.Client(base_url=stack.url, timeout=60) as c,
        c.stream(
            "GET",
            f"/v1/requests/{request_id}/events",
            headers={"Authorization": f"Bearer {api_key}"},
        ) as r,
    ):
        assert r.status_code == 200
        return [(e.id, e.data) for e in EventSource(r).iter_sse() if e.data]


def raw_stream(stack: ClientStack, api_key: str, request_id: str) -> bytes:
    """The bytes of the whole stream, from the start, no proxy."""
    with httpx.Client(base_url=stack.url, timeout=60) as c:
        r = c.get(
            f"/v1/requests/{request_id}/events", headers={"Authorization": f"Bearer {api_key}"}
        )
        assert r.status_code == 200
        return r.content


def text_of(events: list[tuple[str, str]]) -> str:
    out = []
    for _, data in events:
        if data != "[DONE]":
            for choice in json.loads(data).get("choices", []):
                out.append((choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def tally(got: list[list[str]], whole: list[tuple[str, str]]) -> dict[str, int]:
    """Events of the uninterrupted stream the client never dispatched (lost), dispatched
    more than once (duplicated), or dispatched with other data under the same id."""
    data = dict(whole)
    seen = collections.Counter(eid for eid, _ in got)
    return {
        "lost": sum(1 for eid, _ in whole if eid not in seen),
        "duplicated": sum(n - 1 for n in seen.values() if n > 1),
        "altered": sum(1 for eid, d in got if data.get(eid) != d),
    }


def report(name: str, **figures: object) -> None:
    print(f"CLIENT-STATS {json.dumps({'client': name, **figures})}")


def stream_connections(out: dict[str, Any]) -> list[dict[str, Any]]:
    """The connections that read the stream (not the POST that created the request)."""
    return list(out["connections"][out["posts"] :])


# ------------------------------------------------------------------------- eventsource


@pytest.mark.parametrize("mode", ["close", "until-204"])
def test_eventsource(
    node: Any, clients_stack: ClientStack, api_key: str, proxy: CuttingProxy, mode: str
) -> None:
    out = run(node, "eventsource.mjs", proxy.url, clients_stack, api_key, mode)
    whole = uninterrupted(clients_stack, api_key, out["requestId"])
    events = [(eid, d) for eid, d in out["events"]]
    assert text_of(events) == QUESTION
    figures = tally(out["events"], whole)
    assert figures == {"lost": 0, "duplicated": 0, "altered": 0}
    reading = stream_connections(out)
    assert all(c["token"] and c["method"] == "GET" for c in reading)  # ?token=, no header
    reconnects = len(reading) - 1
    assert reconnects > 0
    after_end = out["connections"][out["doneAt"] :]
    if mode == "close":
        assert after_end == []
    else:  # it reconnects after the end until it gets a 204 (a reconnect can break before
        # its response too: on a pooled connection the proxy closed), then is closed for good
        assert [c["status"] for c in after_end][-1] == 204
        assert all(c["status"] is None and c["error"] for c in after_end[:-1]), after_end
        assert {c["lastEventId"] for c in after_end} == {whole[-1][0]}
        assert out["readyState"] == 2
    # the process exited by itself: no timer, no connection left; the proxy saw no more
    # (Node's fetch opens an idle connection that sends nothing after an aborted body:
    # the proxy's ``requests`` are the connections that sent one)
    assert len(proxy.requests) <= len(out["connections"])
    report(f"eventsource ({mode})", reconnects=reconnects, after_end=len(after_end), **figures)


# --------------------------------------------------------------- fetch-event-source


def early_ids(out: dict[str, Any]) -> set[str]:
    """Last-Event-IDs the client sent that are not the id of an event it dispatched:
    it took the id of an event whose blank line never came (the cut fell between the
    event's ``id:`` line and its blank line)."""
    dispatched = {eid for eid, _ in out["events"]}
    sent = {c["lastEventId"] for c in stream_connections(out) if c["lastEventId"]}
    return sent - dispatched


@pytest.mark.parametrize("mode", ["post", "events", "post/dispatched", "events/dispatched"])
def test_fetch_event_source(
    node: Any, clients_stack: ClientStack, api_key: str, proxy: CuttingProxy, mode: str
) -> None:
    """Every event arrives once, except one that the library itself skips: it takes an
    event's id at its ``id:`` line, so a cut between that line and the event's blank line
    (one byte per event, the server writing data before id) resumes after an event it
    never dispatched. Resuming from the last dispatched id (``/dispatched``: a ``fetch``
    option that sets Last-Event-ID) loses nothing."""
    out = run(node, "fetch_event_source.mjs", proxy.url, clients_stack, api_key, mode)
    whole = uninterrupted(clients_stack, api_key, out["requestId"])
    figures = tally(out["events"], whole)
    early = early_ids(out)
    reading = stream_connections(out)
    report(
        f"fetch-event-source ({mode})",
        reconnects=len(reading) - 1,
        after_end=len(out["connections"]) - out["doneAt"],
        early_ids=len(early),
        **figures,
    )
    assert figures["duplicated"] == 0 and figures["altered"] == 0
    # what it lost is exactly the events whose id it took early, nothing else
    lost = {eid for eid, _ in whole} - {eid for eid, _ in out["events"]}
    assert lost == early
    assert [tuple(e) for e in out["events"]] == [e for e in whole if e[0] not in lost]
    if mode.endswith("/dispatched"):
        assert lost == set()
        assert text_of([(e, d) for e, d in out["events"]]) == QUESTION
    assert len(reading) > 1
    if mode.startswith("post"):  # every reconnect is the same POST, same key, Last-Event-ID
        assert {c["method"] for c in reading} == {"POST"}
        assert len({c["idempotencyKey"] for c in reading}) == 1
    assert len(out["connections"]) == out["doneAt"]  # none after [DONE]
    assert len(proxy.requests) <= len(out["connections"])


def test_fetch_event_source_loses_an_event_only_at_one_byte_of_each(
    node: Any, clients_stack: ClientStack, api_key: str, tmp_path: Path
) -> None:
    """Its parser, fed a real stream byte by byte: with the server's data-before-id
    framing exactly one cut position per event loses that event (after its ``id:`` line,
    before its blank line); with id before data, every position inside the data line
    would."""
    with Client(clients_stack.url, api_key) as c:
        stream = c.chat.stream(model=clients_stack.model, messages=USER)
        assert stream.text() == QUESTION
    assert stream.request_id is not None
    raw = raw_stream(clients_stack, api_key, stream.request_id)
    frames = re.findall(rb"data: ([^\n]*)\nid: ([^\n]*)\n\n", raw)
    assert frames and raw.count(b"\nid: ") == len(frames)  # every event: data, then id
    id_first = re.sub(rb"data: ([^\n]*)\nid: ([^\n]*)\n", rb"id: \2\ndata: \1\n", raw)
    paths = [tmp_path / "data-first.sse", tmp_path / "id-first.sse"]
    for path, body in zip(paths, [raw, id_first], strict=True):
        path.write_bytes(body)
    data_first_cuts, id_first_cuts = node(
        "node/fetch_event_source_cuts.mjs", env={"RAW_FILES": json.dumps([str(p) for p in paths])}
    ).result()
    assert data_first_cuts["lossy"] == len(frames)
    assert id_first_cuts["lossy"] == sum(len(b"data: " + d + b"\n") + 1 for d, _ in frames)
    report(
        "fetch-event-source parser",
        events=len(frames),
        bytes=len(raw),
        lossy_cuts_data_first=data_first_cuts["lossy"],
        lossy_cuts_id_first=id_first_cuts["lossy"],
    )


# ------------------------------------------------------------------------- openai SDK


@pytest.fixture
def plain_proxy(clients_stack: ClientStack) -> Iterator[RecordingProxy]:
    p = RecordingProxy(api_target(clients_stack))
    p.cutting = False
    p.start()
    try:
        yield p
    finally:
        p.close()


def test_openai_node_sdk_whole_answer(
    node: Any, clients_stack: ClientStack, api_key: str, plain_proxy: RecordingProxy
) -> None:
    out = run(node, "openai.mjs", plain_proxy.url, clients_stack, api_key, "whole")
    assert out["error"] is None
    assert out["text"] == QUESTION
    assert out["finishReason"] == "stop"
    # one fetch, one POST on the wire: no retry, no second connection for it (a client of
    # an earlier test still reconnecting to a port this proxy got again is not counted)
    posts = [r for r in plain_proxy.requests if r.startswith("POST /v1/chat/completions")]
    assert len(out["connections"]) == 1 and len(posts) == 1, plain_proxy.requests
    assert plain_proxy.cuts == 0
    report("openai Node SDK (plain proxy)", reconnects=0, lost=0, duplicated=0)


def test_openai_node_sdk_cannot_resume(
    node: Any, clients_stack: ClientStack, api_key: str, proxy: CuttingProxy
) -> None:
    """Through the cutting proxy the SDK gets the head of the answer and then an error:
    it has no notion of Last-Event-ID. (What it does is in docs/clients.md.)"""
    out = run(node, "openai.mjs", proxy.url, clients_stack, api_key, "cut")
    report(
        "openai Node SDK (cutting proxy)",
        connections=len(out["connections"]),
        text_chars=len(out["text"]),
        error=out["error"],
    )
    assert out["text"] != QUESTION
    assert QUESTION.startswith(out["text"])
    assert out["error"] is not None


def test_openai_node_sdk_resumes_a_background_response(
    node: Any, clients_stack: ClientStack, api_key: str, proxy: CuttingProxy
) -> None:
    """The Responses API's own resume, in the SDK: every cut connection is followed by
    ``responses.retrieve(id, {stream: true, starting_after})``; the events, numbered
    from the log's start, come once each and the text is whole."""
    out = run(node, "openai_responses.mjs", proxy.url, clients_stack, api_key)
    report(
        "openai Node SDK, Responses API (cutting proxy)",
        resumes=out["resumes"],
        events=len(out["sequence"]),
        cuts=proxy.cuts,
    )
    assert out["status"] == "completed", out
    assert out["text"] == QUESTION
    assert out["sequence"] == list(range(len(out["sequence"])))
    assert out["resumes"] >= 1 and proxy.cuts >= 1


def test_openai_python_sdk_resumes_a_background_response(
    clients_stack: ClientStack, api_key: str, proxy: CuttingProxy
) -> None:
    """The same with the Python SDK: ``responses.retrieve(id, stream=True,
    starting_after=n)`` after every cut."""
    sdk = openai.OpenAI(base_url=proxy.url + "/v1", api_key=api_key, max_retries=0)
    sequence: list[int] = []
    text, status, rid, resumes = "", None, None, 0
    for _ in range(200):
        try:
            if rid is None:
                made = sdk.responses.with_raw_response.create(
                    model=clients_stack.model, input=QUESTION, background=True, stream=True
                )
                rid = made.headers["x-request-id"]
                stream = made.parse()
            else:
                after = {"starting_after": sequence[-1]} if sequence else {}
                stream = sdk.responses.retrieve(rid, stream=True, **after)
                resumes += 1
            for event in stream:
                sequence.append(event.sequence_number)
                if event.type == "response.output_text.delta":
                    text += event.delta
                if event.type in ("response.completed", "response.incomplete", "response.failed"):
                    status = event.response.status
        except (openai.APIError, httpx.HTTPError):
            pass  # cut: resume (or, before the headers, make it again)
        if status is not None:
            break
    report("openai Python SDK, Responses API (cutting proxy)", resumes=resumes, cuts=proxy.cuts)
    assert status == "completed"
    assert text == QUESTION
    assert sequence == list(range(len(sequence)))
    assert resumes >= 1


class FirstCut:
    """Proxy budgets: the first response cut after ``first`` bytes (inside its status
    line and headers), no cut after that."""

    def __init__(self, first: int) -> None:
        self.first: int | None = first

    def randint(self, a: int, b: int) -> int:
        budget, self.first = self.first, None
        return budget if budget is not None else 1 << 40


@pytest.fixture
def first_cut(clients_stack: ClientStack) -> Iterator[CuttingProxy]:
    p = CuttingProxy(api_target(clients_stack))
    p._random = FirstCut(40)  # type: ignore[assignment]
    p.start()
    try:
        yield p
    finally:
        p.close()


@pytest.mark.parametrize("mode", ["whole", "keyed"])
def test_openai_node_sdk_sends_a_cut_post_again(
    node: Any, clients_stack: ClientStack, api_key: str, first_cut: CuttingProxy, mode: str
) -> None:
    """A POST cut before its response headers: the SDK sends it again (its own retry),
    without an Idempotency-Key -- a second request, the first one left running until
    its resume grace ends -- unless the caller adds the header (``keyed``): then it is
    the same request."""
    out = run(node, "openai.mjs", first_cut.url, clients_stack, api_key, mode)
    assert out["error"] is None and out["text"] == QUESTION
    posts = out["connections"]
    assert [c["method"] for c in posts] == ["POST", "POST"] and first_cut.cuts == 1
    assert posts[0]["status"] is None  # the cut one: no response
    keys = [c["idempotencyKey"] for c in posts]
    if mode == "whole":
        assert keys == [None, None]
    else:
        assert keys == [out["key"], out["key"]]
        with httpx.Client(base_url=clients_stack.url, timeout=60) as c:
            again = c.post(
                "/v1/chat/completions",
                json={"model": clients_stack.model, "messages": USER, "stream": True},
                headers={"Authorization": f"Bearer {api_key}", "Idempotency-Key": out["key"]},
            )
        assert again.headers["x-request-id"] == out["requestId"]
    report(f"openai Node SDK (POST cut before headers, {mode})", posts=len(posts), keys=keys)
