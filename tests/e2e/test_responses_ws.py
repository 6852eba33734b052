"""The Responses WebSocket mode through the unmodified openai SDK's own
``client.responses.connect()``: every event is the ``data`` of its HTTP twin's SSE event
(``stream_id`` appended on a lane), lanes multiplex, a ``store: false`` chain continues on
another socket on another replica, errors come as OpenAI's ``error`` events, and a socket
dropped mid-answer is resumed on the other replica with exactly the rest (``?resume=``).
The scripted engine echoes the last user message."""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from openai.resources.responses.responses import ResponsesConnection
from openai.types.websocket_reconnection import ReconnectingEvent, ReconnectingOverrides
from websockets.exceptions import InvalidStatus

from service.store.keys import Keys
from tests.clients.proxy import CuttingProxy
from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import LONG
from tests.e2e.test_auth import make_key
from tests.e2e.test_responses import _archived
from tests.waiting import wait_until

# openai 3.60 calls websockets 17's connect() without a ``with``: websockets warns (a
# DeprecationWarning, an error under this suite's filters); the connection is the same
pytestmark = pytest.mark.filterwarnings(
    "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"
)

TERMINAL = {"response.completed", "response.failed", "response.incomplete"}


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("responses-ws"),
        redis_url,
        database_url,
        model_dir,
        apis=2,  # a chain and a resume on the other replica
        scripted_tokens_per_s=100.0,
    ) as st:
        yield st


def sdk(url: str, key: str = "unused") -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def until_ended(conn: ResponsesConnection, responses: int = 1) -> list[bytes]:
    """Every message until ``responses`` responses ended (errors and steer answers too)."""
    out: list[bytes] = []
    ended = 0
    while ended < responses:
        out.append(conn.recv_bytes())
        if json.loads(out[-1])["type"] in TERMINAL:
            ended += 1
    return out


def twin(url: str, rid: str) -> list[bytes]:
    """The response's HTTP stream: the ``data`` of each SSE event, as bytes."""
    got = httpx.get(f"{url}/v1/responses/{rid}", params={"stream": "true"}, timeout=60)
    assert got.status_code == 200, got.text
    return [line[6:] for line in got.content.split(b"\n") if line.startswith(b"data: ")]


def on_lane(data: bytes, lane: str) -> bytes:
    return data[:-1] + b',"stream_id":' + json.dumps(lane).encode() + b"}"


def text_of(messages: list[bytes]) -> str:
    events = [json.loads(m) for m in messages]
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def test_a_response_streams_as_its_http_twin(stack: Stack) -> None:
    with sdk(stack.url).responses.connect() as conn:
        conn.response.create(model=stack.model, input="Hello, €uro 🤖 東京")
        got = until_ended(conn)
    first = json.loads(got[0])
    assert first["type"] == "response.created" and first["sequence_number"] == 0
    rid = first["response"]["id"]
    assert json.loads(got[-1])["type"] == "response.completed"
    assert text_of(got) == "Hello, €uro 🤖 東京"
    assert got == twin(stack.url, rid)  # byte for byte
    assert got == twin(stack.api_urls[1], rid)


def test_two_lanes_multiplex_on_one_socket(stack: Stack) -> None:
    with sdk(stack.url).responses.connect() as conn:
        conn.response.create(model=stack.model, input=LONG[:200], stream_id="a")
        conn.response.create(model=stack.model, input="the other lane", stream_id="b")
        got = until_ended(conn, 2)
    lanes: dict[str, list[bytes]] = {"a": [], "b": []}
    for m in got:
        lanes[json.loads(m)["stream_id"]].append(m)
    assert text_of(lanes["a"]) == LONG[:200] and text_of(lanes["b"]) == "the other lane"
    for lane, messages in lanes.items():
        rid = json.loads(messages[0])["response"]["id"]
        assert messages == [on_lane(d, lane) for d in twin(stack.url, rid)]
    # "b" did not wait for "a" (lanes run side by side): it ended before "a" did
    ends = [json.loads(m)["stream_id"] for m in got if json.loads(m)["type"] in TERMINAL]
    assert ends == ["b", "a"]


def test_a_lane_runs_its_responses_in_order(stack: Stack) -> None:
    with sdk(stack.url).responses.connect() as conn:
        conn.response.create(model=stack.model, input=LONG[:120], stream_id="x")
        conn.response.create(model=stack.model, input="second", stream_id="x")
        got = until_ended(conn, 2)
    types = [json.loads(m)["type"] for m in got]
    first_end = next(i for i, t in enumerate(types) if t in TERMINAL)
    assert types[first_end + 1] == "response.created"  # the second began after the first
    assert text_of(got[: first_end + 1]) == LONG[:120] and text_of(got[first_end + 1 :]) == "second"


def test_a_store_false_chain_continues_on_another_socket_and_replica(stack: Stack) -> None:
    with sdk(stack.api_urls[0]).responses.connect() as conn:
        conn.response.create(model=stack.model, input="first turn", store=False)
        first = until_ended(conn)
    rid = json.loads(first[0])["response"]["id"]
    with sdk(stack.api_urls[1]).responses.connect() as conn:
        conn.response.create(
            model=stack.model, input="second turn", store=False, previous_response_id=rid
        )
        second = until_ended(conn)
    done = json.loads(second[-1])["response"]
    assert done["status"] == "completed" and done["previous_response_id"] == rid
    assert text_of(second) == "second turn"
    items = httpx.get(
        f"{stack.url}/v1/responses/{done['id']}/input_items", params={"order": "asc"}
    ).json()["data"]
    texts = [part["text"] for item in items for part in item["content"]]
    assert texts == ["first turn", "first turn", "second turn"]  # asked, answered, asked


def test_errors_come_as_openai_error_events(stack: Stack) -> None:
    with sdk(stack.url).responses.connect() as conn:
        conn.send_raw("{not json")
        bad = json.loads(conn.recv_bytes())
        conn.send_raw(json.dumps({"type": "session.update"}))
        unknown_type = json.loads(conn.recv_bytes())
        conn.response.create(model="no-such-model", input="hi", stream_id="m")
        no_model = json.loads(conn.recv_bytes())
        conn.response.create(model=stack.model, input="hi", previous_response_id="resp_" + "0" * 32)
        no_previous = json.loads(conn.recv_bytes())
        conn.send_raw(json.dumps({"type": "response.create", "model": stack.model, "bogus": 1}))
        unknown_field = json.loads(conn.recv_bytes())
        conn.response.steer(input="faster", previous_response_id="resp_" + "0" * 32)
        steer = json.loads(conn.recv_bytes())
        conn.response.create(model=stack.model, input="still here")
        after = until_ended(conn)
    assert bad["type"] == "error" and bad["status"] == 400
    assert (
        bad["error"]["code"] == "invalid_json" and bad["error"]["type"] == "invalid_request_error"
    )
    assert unknown_type["error"]["param"] == "type"
    assert no_model["status"] == 404 and no_model["stream_id"] == "m"
    assert no_model["error"]["code"] == "model_not_found"
    assert no_previous["status"] == 400
    assert no_previous["error"]["code"] == "previous_response_not_found"
    assert no_previous["error"]["param"] == "previous_response_id"
    assert unknown_field["status"] == 400 and unknown_field["error"]["param"] == "bogus"
    assert steer["type"] == "response.steer.failed"
    assert steer["error"]["code"] == "steering_not_supported"
    assert steer["steer"]["input"] == "faster"
    assert text_of(after) == "still here"  # the socket goes on after errors


def test_keys_are_checked_at_the_handshake(stack: Stack, database_url: str) -> None:
    url = stack.start_api(auth="required")
    for key in ("sk-le-nosuchkey-abcdefghijkl", "not a key"):
        with pytest.raises(InvalidStatus) as refused, sdk(url, key).responses.connect():
            pass
        assert refused.value.response.status_code == 401
        assert json.loads(refused.value.response.body)["error"]["type"] == "authentication_error"
    acme, globex = make_key(database_url, "acme"), make_key(database_url, "globex")
    with sdk(url, acme).responses.connect() as conn:
        conn.response.create(model=stack.model, input="mine")
        mine = until_ended(conn)
    rid = json.loads(mine[0])["response"]["id"]
    # another tenant cannot resume it: the same 404 as over HTTP, as an error event
    with sdk(url, globex).responses.connect(extra_query={"resume": f"{rid}:3"}) as conn:
        other = json.loads(conn.recv_bytes())
    assert other["type"] == "error" and other["status"] == 404
    resume = {"resume": f"{rid}:x"}
    with (
        pytest.raises(InvalidStatus) as malformed,
        sdk(url, acme).responses.connect(extra_query=resume),
    ):
        pass
    assert malformed.value.response.status_code == 400


def _drop(conn: ResponsesConnection) -> None:
    """The network goes: the TCP connection is cut, no close handshake."""
    raw: socket.socket = conn._connection.socket
    raw.shutdown(socket.SHUT_RDWR)
    conn.close()


@pytest.mark.parametrize("cut", [1, 9, 40])
def test_a_dropped_socket_resumes_on_the_other_replica_with_exactly_the_rest(
    stack: Stack, cut: int
) -> None:
    text = LONG * 2  # ~6 s of answer: parked while nobody reads
    conn = sdk(stack.api_urls[0]).responses.connect().enter()
    conn.response.create(model=stack.model, input=text, stream_id="lane", max_output_tokens=2000)
    seen = [conn.recv_bytes() for _ in range(cut)]
    _drop(conn)
    rid = json.loads(seen[0])["response"]["id"]
    last = json.loads(seen[-1])["sequence_number"]

    def state() -> str:
        return str(httpx.get(f"{stack.url}/v1/requests/{rid}", timeout=10).json()["state"])

    wait_until(lambda: state() == "parked", "the answer nobody reads to park")
    resume = {"resume": f"{rid}:{last}:lane"}
    with sdk(stack.api_urls[1]).responses.connect(extra_query=resume) as conn:
        rest = until_ended(conn)
    assert seen + rest == [on_lane(d, "lane") for d in twin(stack.url, rid)]
    events = [json.loads(m) for m in seen + rest]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed" and text_of(seen + rest) == text


def test_a_draining_replica_hands_the_socket_over_and_the_sdk_resumes_elsewhere(
    stack: Stack,
) -> None:
    """SIGTERM to the API a socket streams from: it closes the socket with 1012 (service
    restart), the SDK's own reconnect -- the proxy now leads to another replica -- names
    its cursor in ``on_reconnecting`` and gets the rest."""
    leaving = stack.start_api()
    host, port = leaving.removeprefix("http://").split(":")
    proxy = CuttingProxy((host, int(port)))
    proxy.cutting = False
    proxy.start()
    cursor: dict[str, int] = {}
    closes: list[int] = []

    def on_reconnecting(event: ReconnectingEvent) -> ReconnectingOverrides:
        closes.append(event.close_code)
        return {"extra_query": {"resume": ",".join(f"{r}:{n}" for r, n in cursor.items())}}

    got: list[dict[str, Any]] = []
    try:
        with sdk(proxy.url).responses.connect(
            on_reconnecting=on_reconnecting, initial_delay=0.05, max_delay=0.2
        ) as conn:
            conn.response.create(model=stack.model, input=LONG * 2, max_output_tokens=2000)
            for parsed in conn:
                event = parsed.to_dict()
                got.append(event)
                if event["type"] == "response.created":
                    rid = event["response"]["id"]
                cursor[rid] = event["sequence_number"]
                if len(got) == 20:  # mid-answer: the replica goes, the proxy leads on
                    proxy.target = (host, int(stack.api_urls[0].rsplit(":", 1)[1]))
                    stack.api_procs[leaving].send_signal(signal.SIGTERM)
                if event["type"] in TERMINAL:
                    break
    finally:
        proxy.close()
    assert closes and closes[0] == 1012
    assert got == [json.loads(d) for d in twin(stack.url, rid)]
    assert text_of([json.dumps(e).encode() for e in got]) == LONG * 2


def test_admission_refuses_a_create_as_it_refuses_a_post(stack: Stack) -> None:
    """One request in flight per key on this replica: of two lanes' creates, one runs and
    the other is OpenAI's 429 error event (Retry-After among its headers), on its lane."""
    url = stack.start_api(max_concurrent_per_key=1)
    with sdk(url).responses.connect() as conn:
        conn.response.create(model=stack.model, input=LONG[:300], stream_id="a")
        conn.response.create(model=stack.model, input=LONG[:300], stream_id="b")
        got = [json.loads(m) for m in until_ended(conn)]  # the one that runs
        while not any(e["type"] == "error" for e in got):  # (if it did not come first)
            got.append(json.loads(conn.recv_bytes()))
    refused = next(e for e in got if e["type"] == "error")
    ran = [e for e in got if e["type"] != "error"]
    assert {e["stream_id"] for e in ran} == {"a", "b"} - {refused["stream_id"]}
    assert ran[-1]["type"] == "response.completed"
    assert refused["status"] == 429 and refused["error"]["code"] == "too_many_concurrent_requests"
    assert refused["error"]["headers"]["retry-after"] == "1"


def test_a_create_sent_again_with_its_idempotency_key_is_the_same_response(stack: Stack) -> None:
    """A socket dropped before its ``response.created`` arrived: the client cannot name
    the response, so it sends the message again -- with lastevent's ``idempotency_key``
    the other replica streams the same response from its start, and no second one runs."""
    message = {
        "type": "response.create",
        "model": stack.model,
        "input": LONG[:200],
        "stream_id": "k",
        "idempotency_key": "ws-retry-1",
    }
    conn = sdk(stack.api_urls[0]).responses.connect().enter()
    conn.send_raw(json.dumps(message))
    first = conn.recv_bytes()  # (the first event shows it arrived; the client never saw it)
    _drop(conn)
    with sdk(stack.api_urls[1]).responses.connect() as conn:
        conn.send_raw(json.dumps(message))
        again = until_ended(conn)
        conn.send_raw(json.dumps({**message, "input": "another body"}))
        reused = json.loads(conn.recv_bytes())
    rid = json.loads(first)["response"]["id"]
    assert json.loads(again[0])["response"]["id"] == rid and again[0] == first
    assert again == [on_lane(d, "k") for d in twin(stack.url, rid)]
    assert text_of(again) == LONG[:200]
    assert reused["status"] == 422 and reused["error"]["code"] == "idempotency_key_reused"


def test_a_lane_lasts_as_long_as_its_requests(stack: Stack) -> None:
    """A socket holds at most 64 lanes at once, but a lane with nothing left goes: a
    long-lived socket may name a new stream_id per conversation."""
    with sdk(stack.url).responses.connect() as conn:
        for i in range(70):
            conn.response.create(
                model=stack.model, input=f"turn {i}", stream_id=f"conversation-{i}"
            )
            got = until_ended(conn)
            assert json.loads(got[-1])["type"] == "response.completed", got[-1]
            assert text_of(got) == f"turn {i}"


@pytest.mark.parametrize("http", ["httptools", "h11"])
def test_a_socket_outlives_the_request_read_timeout(stack: Stack, http: str) -> None:
    """The slowloris guard times a request until it is all in; an upgraded socket is the
    WebSocket protocol's from then on and is never cut by it (an answer of ~300 tokens at
    100 tokens/s outlasts a 1 s read timeout)."""
    url = stack.start_api(http=http, request_read_timeout_s=1.0)
    with sdk(url).responses.connect() as conn:
        conn.response.create(model=stack.model, input=LONG[:400])
        got = until_ended(conn)
    assert json.loads(got[-1])["type"] == "response.completed" and text_of(got) == LONG[:400]


def test_a_response_whose_hot_log_expired_resumes_from_the_archive(stack: Stack) -> None:
    """The cursor works hot to cold: once the log is archived and its hot keys are gone,
    the rest comes from Postgres, the same bytes."""
    with sdk(stack.url).responses.connect() as conn:
        conn.response.create(model=stack.model, input="Zürich 東京 🤖, archived", stream_id="c")
        hot = until_ended(conn)
    rid = json.loads(hot[0])["response"]["id"]
    db = stack.settings.database_url or ""
    wait_until(lambda: _archived(db, rid), "the archive")
    keys = Keys(stack.settings.key_prefix, stack.settings.partitions)
    stack.store().delete(keys.log(rid), keys.meta(rid))  # the hot log's TTL, now
    with sdk(stack.api_urls[1]).responses.connect(extra_query={"resume": f"{rid}:4:c"}) as conn:
        cold = until_ended(conn)
    assert cold == hot[5:]


def test_a_resume_takes_a_reader_seat_as_a_get_does(stack: Stack) -> None:
    """One reader per request on this replica: a second socket resuming the same running
    response is refused on its lane (429, too_many_readers) while the first streams it."""
    url = stack.start_api(max_readers_per_request=1)
    with sdk(stack.url).responses.connect() as maker:
        maker.response.create(model=stack.model, input=LONG * 2, max_output_tokens=2000)
        rid = json.loads(maker.recv_bytes())["response"]["id"]
        resume = {"resume": f"{rid}:0:r"}
        with sdk(url).responses.connect(extra_query=resume) as first:
            seated = json.loads(first.recv_bytes())  # the first holds its seat
            with sdk(url).responses.connect(extra_query=resume) as second:
                refused = json.loads(second.recv_bytes())
            rest = until_ended(first)
        until_ended(maker)
    assert seated["sequence_number"] == 1 and seated["stream_id"] == "r"
    assert refused["type"] == "error" and refused["status"] == 429
    assert refused["error"]["code"] == "too_many_readers" and refused["stream_id"] == "r"
    assert json.loads(rest[-1])["type"] == "response.completed"


def test_a_cursor_past_the_end_sends_nothing_and_the_socket_goes_on(stack: Stack) -> None:
    with sdk(stack.url).responses.connect() as conn:
        conn.response.create(model=stack.model, input="all of it")
        whole = until_ended(conn)
    rid = json.loads(whole[0])["response"]["id"]
    last = json.loads(whole[-1])["sequence_number"]
    with sdk(stack.api_urls[1]).responses.connect(extra_query={"resume": f"{rid}:{last}"}) as conn:
        conn.response.create(model=stack.model, input="and then")
        after = until_ended(conn)
    assert json.loads(after[0])["type"] == "response.created"  # nothing of the first again
    assert json.loads(after[0])["response"]["id"] != rid and text_of(after) == "and then"
