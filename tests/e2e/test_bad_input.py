"""Bad input gets a clear 4xx, never a 5xx: random JSON for every field of both request
bodies, random bytes as bodies, random path ids, ``Last-Event-ID`` headers, ``after``
values and replay parameters, against the real stack (API + scripted worker).

Every answer is 2xx or 4xx, and a 4xx is OpenAI's ``{"error": {...}}``. A path id that
is not a request id answers exactly what an id that never existed answers.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context
from sqlalchemy.ext.asyncio import create_async_engine

from service.ledger.api_keys import ApiKeys
from service.settings import MODEL_NAME
from tests.e2e.conftest import Stack

BOUNDED = settings(
    max_examples=70,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
NEVER = "chatcmpl-" + "0" * 32
VOCAB = 49152  # SmolLM2's; an id beyond it is a 400 like any other
PER_REQUEST = [
    ("GET", "/v1/requests/{}"),
    ("GET", "/v1/requests/{}/events"),
    ("POST", "/v1/requests/{}/cancel"),
    ("GET", "/v1/admin/requests/{}/replay"),
]
# h11 (the client) sends a header value only in this shape: no NUL, CR, LF, DEL, no
# whitespace at either end
_HEADER_OK = re.compile(rb"[\x21-\x7e\x80-\xff]([\x20-\x7e\x80-\xff\t]*[\x21-\x7e\x80-\xff])?")


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def operator(stack: Stack, database_url: str) -> dict[str, str]:
    """An operator key (with auth off, a real key still counts, with its role)."""

    async def create() -> str:
        engine = create_async_engine(database_url)
        try:
            return await ApiKeys(engine).create("ops", role="operator")
        finally:
            await engine.dispose()

    return {"Authorization": f"Bearer {asyncio.run(create())}"}


@pytest.fixture(scope="module")
def finished(client: httpx.Client) -> dict[str, Any]:
    """A finished request: its id and its event ids (for well-formed cursors)."""
    resp = client.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": "bad input", "max_tokens": 3}
    )
    assert resp.status_code == 200, resp.text
    rid = resp.json()["id"]
    with client.stream("GET", f"/v1/requests/{rid}/events") as r:
        ids = [line[4:] for line in r.iter_lines() if line.startswith("id: ")]
    assert ids
    return {"id": rid, "event_ids": ids}


def check(resp: httpx.Response) -> None:
    """2xx, or 4xx with OpenAI's error object; never 5xx."""
    assert resp.status_code < 500, (resp.request.method, resp.request.url, resp.text[:500])
    assert resp.status_code >= 200
    if currently_in_test_context():
        event(f"status {resp.status_code}")
    if resp.status_code >= 400:
        body = resp.json()
        assert set(body) == {"error"}, body
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"], body
        assert isinstance(err["type"], str) and err["type"], body
        assert "param" in err and "code" in err, body


def check_not_found(resp: httpx.Response) -> None:
    """The answer for an id that never existed."""
    check(resp)
    assert resp.status_code == 404, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["code"], err["param"]) == (
        "not_found_error",
        "not_found",
        "request_id",
    )


def post_raw(client: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return client.post(path, content=content, headers={"content-type": "application/json"})


def post_json(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    return post_raw(client, path, json.dumps(body).encode())


def raw_get(stack: Stack, target: bytes, headers: bytes = b"") -> tuple[int, bytes]:
    """A GET that sends header bytes no client library would (status, body)."""
    host, port = stack.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"GET " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + headers + b"\r\n"
        )
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


# -- strategies ----------------------------------------------------------------------

EDGE_INTS = st.sampled_from(
    [0, -1, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, -(2**63) - 1, 2**64, 10**30, -(10**30)]
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | EDGE_INTS
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
SHORT_TEXT = st.text(max_size=16)
NUMBER_JUNK = EDGE_INTS | st.floats() | JSON  # st.floats(): NaN and inf (not JSON: a 400)


def mostly(good: st.SearchStrategy[Any], junk: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` three times in four, ``junk`` otherwise."""
    return st.integers(0, 3).flatmap(lambda i: junk if i == 0 else good)


# valid values, field by field: an accepted request must stay small and fast
PART = st.fixed_dictionaries({"type": st.just("text"), "text": SHORT_TEXT})
MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": SHORT_TEXT | st.none() | st.lists(PART, max_size=2),
    },
    optional={"name": SHORT_TEXT},
)
STOP = st.text(min_size=1, max_size=8)
SAMPLING: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL_NAME),
    "stream": st.just(False),  # an accepted request answers as one JSON body
    "stream_options": st.fixed_dictionaries(
        {},
        optional={
            "include_usage": st.booleans(),
            "resume_grace_s": st.floats(min_value=0, max_value=60),
            "detached": st.booleans(),
        },
    ),
    "max_tokens": st.integers(1, 4),
    "stop": STOP | st.lists(STOP, max_size=4),
    "n": st.just(1),
    "user": SHORT_TEXT,
    "temperature": st.floats(min_value=0, max_value=2),
    "top_p": st.floats(min_value=0.01, max_value=1),
    "seed": st.integers(min_value=-(2**63), max_value=2**63 - 1),
}
CHAT = {
    **SAMPLING,
    "messages": st.lists(MESSAGE, min_size=1, max_size=3),
    "max_completion_tokens": st.integers(1, 4),
}
COMPLETION = {
    **SAMPLING,
    "prompt": (
        st.text(min_size=1, max_size=16)
        | st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6)
        | st.lists(st.text(min_size=1, max_size=16), min_size=1, max_size=1)
    ),
}
REQUIRED = {"model", "messages", "prompt", "max_tokens"}

# what a corrupted field gets: any JSON value, or a near miss of its own shape
JUNK_MESSAGE = st.fixed_dictionaries(
    {
        "role": mostly(st.sampled_from(["user", "tool", "wizard", ""]), JSON),
        "content": mostly(
            SHORT_TEXT | st.lists(mostly(PART, JSON), max_size=2),
            JSON | st.lists(st.fixed_dictionaries({"type": JSON, "text": JSON}), max_size=2),
        ),
    },
    optional={"name": JSON},
)
JUNK: dict[str, st.SearchStrategy[Any]] = {
    "model": JSON | st.just(MODEL_NAME + "-nope") | st.just(MODEL_NAME.upper()),
    "stream": JSON,
    "stream_options": JSON
    | st.fixed_dictionaries(
        {},
        optional={
            "include_usage": JSON,
            "resume_grace_s": NUMBER_JUNK | st.floats(min_value=3599, max_value=1e308),
            "detached": JSON,
        },
    ),
    "max_tokens": NUMBER_JUNK,
    "max_completion_tokens": NUMBER_JUNK,
    "stop": JSON | st.lists(JSON, max_size=6) | st.just([""]) | st.text(min_size=65),
    "n": NUMBER_JUNK,
    "user": JSON,
    "temperature": NUMBER_JUNK | st.floats(min_value=2, exclude_min=True),
    "top_p": NUMBER_JUNK,
    "seed": NUMBER_JUNK,
    "messages": JSON | st.just([]) | st.lists(mostly(JUNK_MESSAGE, JSON), min_size=1, max_size=3),
    "prompt": JSON
    | st.just("")
    | st.just([])
    | st.lists(st.integers() | EDGE_INTS | JSON, min_size=1, max_size=6)
    | st.lists(st.text(max_size=8) | st.integers(0, 9), min_size=2, max_size=3),
}


def body(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """A valid body with up to three fields corrupted (left out, or a random JSON value
    or a near miss) and maybe unknown fields; now and then not an object at all."""

    @st.composite
    def build(draw: st.DrawFn) -> Any:
        if draw(st.integers(0, 19)) == 0:
            return draw(JSON)
        out = {
            name: draw(good)
            for name, good in fields.items()
            if name in REQUIRED or draw(st.integers(0, 3)) == 0
        }
        for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
            if draw(st.integers(0, 4)) == 0:
                out.pop(name, None)
            else:
                out[name] = draw(JUNK[name])
        extra = draw(st.dictionaries(st.text(max_size=6), JSON, max_size=2))
        return {**{k: v for k, v in extra.items() if k not in fields}, **out}

    return build()


def raw_body(fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[bytes]:
    """Bytes that are barely JSON: a body with one byte changed, inserted or cut off,
    deep nesting, huge numbers, JSON's missing NaN, bad escapes, random bytes."""

    def mutate(data: Any, where: int, byte: int, how: int) -> bytes:
        raw = json.dumps(data).encode()
        i = where % (len(raw) + 1)
        if how == 0:
            return raw[:i] + bytes([byte]) + raw[i + 1 :]
        if how == 1:
            return raw[:i] + bytes([byte]) + raw[i:]
        return raw[:i]

    mutated = st.builds(
        mutate, body(fields), st.integers(0, 10_000), st.integers(0, 255), st.integers(0, 2)
    )
    special = st.builds(
        lambda name, token: (
            b'{"model": "%s", "prompt": "x", "messages": [{"role": "user", "content": "x"}], '
            b'"max_tokens": 2, "%s": %s}' % (MODEL_NAME.encode(), name.encode(), token)
        ),
        st.sampled_from(sorted(fields)),
        st.sampled_from(
            [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"1" * 400, b"1.5e-400"]
            + [b"[" * n + b"]" * n for n in (100, 1000, 100_000)]
            + [b'"\\u0000"', b'"\xff"', b'"\\ud800"', b"null", b"{}", b"[]", b"[null]"]
        ),
    )
    return mutated | special | st.binary(max_size=64)


def path_ids() -> st.SearchStrategy[str]:
    """Strings that are not request ids, and ids that are well-formed but never existed."""
    hexes = st.text("0123456789abcdefABCDEF", min_size=0, max_size=40)
    return st.one_of(
        st.text(min_size=1, max_size=40),
        st.builds(lambda p, h: p + h, st.sampled_from(["chatcmpl-", "cmpl-", "", "x-"]), hexes),
        st.builds(
            lambda p, h, tail: p + h + tail,
            st.sampled_from(["chatcmpl-", "cmpl-"]),
            st.text("0123456789abcdef", min_size=32, max_size=32),
            st.sampled_from(["", "\x00", "\n", " ", "%", "é", "0"]),
        ),
        st.just(NEVER),
    ).filter(lambda s: s not in {"", ".", ".."})


# -- the routes that take a body -----------------------------------------------------


@given(data=body(CHAT))
@BOUNDED
def test_chat_bodies_never_5xx(client: httpx.Client, data: Any) -> None:
    check(post_json(client, "/v1/chat/completions", data))


@given(data=body(COMPLETION))
@BOUNDED
def test_completion_bodies_never_5xx(client: httpx.Client, data: Any) -> None:
    check(post_json(client, "/v1/completions", data))


@given(raw=raw_body(CHAT), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
@settings(BOUNDED, max_examples=60)
def test_raw_bodies_never_5xx(client: httpx.Client, raw: bytes, path: str) -> None:
    check(post_raw(client, path, raw))


# -- the per-request routes ----------------------------------------------------------


@given(rid=path_ids())
@BOUNDED
def test_path_ids_are_unknown_ids(
    client: httpx.Client, operator: dict[str, str], finished: dict[str, Any], rid: str
) -> None:
    """Anything that is not an id this server issued is the unknown id's 404, on every
    per-request route (a decoded "/" in it is another path: any 4xx)."""
    if rid == finished["id"]:
        return
    for method, template in PER_REQUEST:
        resp = client.request(method, template.format(quote(rid, safe="")), headers=operator)
        note(f"{method} {resp.request.url.raw_path!r} -> {resp.status_code} {resp.text}")
        if "/" in rid:
            check(resp)
        else:
            check_not_found(resp)


CURSORS = st.one_of(
    st.builds(
        lambda ms, seq, frame: f"{ms}-{seq}" + ("" if frame is None else f":{frame}"),
        st.integers() | EDGE_INTS,
        st.integers() | EDGE_INTS,
        st.none() | st.integers() | EDGE_INTS,
    ),
    st.text(max_size=30),
    st.text("0123456789-: ", max_size=30),
)


@given(cursor=CURSORS, real=st.booleans(), which=st.integers(0, 100))
@BOUNDED
def test_after_values(
    client: httpx.Client, finished: dict[str, Any], cursor: str, real: bool, which: int
) -> None:
    ids = finished["event_ids"]
    value = ids[which % len(ids)] if real else cursor
    check(client.get(f"/v1/requests/{finished['id']}/events", params={"after": value}))


@given(
    value=st.one_of(
        st.binary(min_size=1, max_size=40).filter(lambda b: _HEADER_OK.fullmatch(b) is not None),
        CURSORS.map(lambda s: s.encode("utf-8")).filter(
            lambda b: _HEADER_OK.fullmatch(b) is not None
        ),
    ),
    known=st.booleans(),
)
@BOUNDED
def test_last_event_id_headers(
    client: httpx.Client, finished: dict[str, Any], value: bytes, known: bool
) -> None:
    rid = finished["id"] if known else NEVER
    check(client.get(f"/v1/requests/{rid}/events", headers=[(b"Last-Event-ID", value)]))


@given(
    rid=st.one_of(path_ids(), st.just("")),
    speed=st.one_of(
        st.sampled_from(["max", "1000", "nan", "inf", "-inf", "0", "-1", "1e-300", "1e309", ""]),
        st.text(max_size=10),
    ),
    fmt=st.one_of(st.sampled_from(["sse", "text", "json"]), st.text(max_size=6)),
)
@settings(BOUNDED, max_examples=60)
def test_replay_parameters(
    client: httpx.Client,
    operator: dict[str, str],
    finished: dict[str, Any],
    rid: str,
    speed: str,
    fmt: str,
) -> None:
    target = rid or finished["id"]
    check(
        client.get(
            f"/v1/admin/requests/{quote(target, safe='')}/replay",
            params={"speed": speed, "format": fmt},
            headers=operator,
        )
    )


# -- the cases found, as plain regression tests ---------------------------------------


def test_nul_and_odd_bytes_in_path_ids_are_unknown_ids(
    client: httpx.Client, operator: dict[str, str]
) -> None:
    """A NUL reached Postgres (status, events, replay lookups): 500."""
    never = client.get(f"/v1/requests/{NEVER}").json()["error"]
    for raw in ["x%00y", "%00", "chatcmpl-%00", "%FF%FE", "%0D%0Aset-cookie:%20x", "a" * 2000]:
        for method, template in PER_REQUEST:
            resp = client.request(method, template.format(raw), headers=operator)
            check_not_found(resp)
            err = resp.json()["error"]
            assert err["message"].startswith("no request '")
            assert {**err, "message": ""} == {**never, "message": ""}


def test_deep_nesting_and_unrepresentable_numbers_are_400(client: httpx.Client) -> None:
    """Nesting beyond msgspec's depth was an unhandled RecursionError (500); a number
    too large for a float was a 400 that named no field."""
    for path in ("/v1/chat/completions", "/v1/completions"):
        resp = post_raw(client, path, b"[" * 5000 + b"]" * 5000)
        check(resp)
        assert resp.status_code == 400 and "nested" in resp.json()["error"]["message"]
    base = b'{"model": "%s", "prompt": "x", "max_tokens": 2, ' % MODEL_NAME.encode()
    for extra, param in [
        (b'"stream_options": {"resume_grace_s": 1e400}}', "stream_options.resume_grace_s"),
        (b'"temperature": -1e400}', "temperature"),
        (b'"seed": 1e400}', "seed"),
        (b'"seed": %d}' % 10**30, "seed"),
        (b'"max_tokens": %d}' % 10**30, "max_tokens"),
        (b'"n": %d}' % 10**30, "n"),
    ]:
        resp = post_raw(client, "/v1/completions", base + extra)
        check(resp)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    resp = post_raw(client, "/v1/completions", base + b'"temperature": NaN}')
    assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]


MALFORMED = [
    b"[" * 100_000,
    b"[" * 5000 + b"]" * 5000,
    b"{" * 5000,
    b'{"metadata": {"k": "' + b"x" * 500_000,
    b"\xff\xfe" * 1000,
    b'{"metadata": NaN}',
]


def body_routes(client: httpx.Client) -> list[str]:
    """Every route of the OpenAPI schema that takes a body, path ids filled in."""
    schema = client.get("/schema/openapi.json").json()
    return [
        re.sub(r"\{[^}]+\}", NEVER, path)
        for path, item in schema["paths"].items()
        if "requestBody" in item.get("post", {})
    ]


def test_malformed_bodies_are_400_on_every_route_with_a_body(client: httpx.Client) -> None:
    """100,000 ``[`` POSTed to a stored completion (``/v1/chat/completions/{id}``: read
    by Litestar, not by the JSON reader the other routes had) was a 500."""
    routes = body_routes(client)
    assert f"/v1/chat/completions/{NEVER}" in routes and len(routes) >= 6, routes
    for path in routes:
        for raw in MALFORMED:
            resp = post_raw(client, path, raw)
            check(resp)
            assert resp.status_code == 400, (path, raw[:20], resp.text)


def test_instants_beyond_the_calendar_in_utc(
    client: httpx.Client, operator: dict[str, str]
) -> None:
    """An offset that carries an instant past year 1 or 9999 in UTC reached Postgres'
    driver (500); an instant before 1970 made reconcile ask Redis for a negative stream
    id (500)."""
    early, late = "0001-01-01T00:00:00+23:59", "9999-12-31T23:59:59-23:59"
    for path, params, param in [
        ("/v1/admin/billing/spend", {"since": early, "until": "2020-01-01"}, "since"),
        ("/v1/admin/billing/spend", {"since": "2020-01-01", "until": late}, "until"),
        ("/v1/admin/requests", {"since": early}, "since"),
        ("/v1/admin/requests", {"until": late}, "until"),
        ("/v1/admin/billing/reconcile", {"since": early, "until": "2020-01-01"}, "since"),
    ]:
        resp = client.get(path, params=params, headers=operator)
        check(resp)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    for since in ("0001-01-01T00:00:00Z", "-1"):
        resp = client.get(
            "/v1/admin/billing/reconcile",
            params={"since": since, "until": "1970-01-02"},
            headers=operator,
        )
        check(resp)
        assert resp.status_code == 200 and resp.json()["checked"] == 0, resp.text


def test_json_replay_of_kept_inputs_and_responses(
    client: httpx.Client, operator: dict[str, str]
) -> None:
    """The NDJSON replay (``format=json``) of a request whose input was kept, or of a
    response, broke off after its 200 (its first event holds JSON as bytes); a CSV
    spend said its charset twice. (Found by schemathesis with more cases.)"""
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    made = [
        post_json(client, "/v1/chat/completions", {**chat, "store": True, "max_tokens": 2}),
        post_json(client, "/v1/responses", {"model": MODEL_NAME, "input": "hi"}),
    ]
    for answer in made:
        assert answer.status_code == 200, answer.text
        path = f"/v1/admin/requests/{answer.json()['id']}/replay"
        resp = client.get(path, params={"format": "json"}, headers=operator)
        check(resp)
        lines = [json.loads(line) for line in resp.text.splitlines()]
        assert lines[0]["type"] == "created" and lines[-1]["type"] == "end", lines
        kept = lines[0]["input"] or lines[0]["response"]
        assert isinstance(kept, dict), lines[0]
    spend = client.get(
        "/v1/admin/billing/spend",
        params={"since": "2020-01-01", "until": "2100-01-01", "format": "csv"},
        headers=operator,
    )
    assert spend.headers["content-type"] == "text/csv; charset=utf-8"


def test_limits_name_the_field_the_client_sent(client: httpx.Client) -> None:
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}]}
    err = post_json(
        client, "/v1/chat/completions", {**chat, "max_completion_tokens": 10**30}
    ).json()["error"]
    assert err["param"] == "max_completion_tokens", err
    long_prompt = {"model": MODEL_NAME, "prompt": [1] * 9000}
    err = post_json(client, "/v1/completions", long_prompt).json()["error"]
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded", err


def test_replay_speed_must_be_a_usable_number(
    client: httpx.Client, operator: dict[str, str], finished: dict[str, Any]
) -> None:
    path = f"/v1/admin/requests/{finished['id']}/replay"
    # (a slow replay holds a connection: half the original pace at the slowest)
    for speed in ["nan", "inf", "-1", "0", "1e-300", "fast", "0.01", "0.49"]:
        resp = client.get(path, params={"speed": speed}, headers=operator)
        check(resp)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "speed"
    assert client.get(path, params={"speed": "1000"}, headers=operator).status_code == 200


def test_odd_cursor_bytes(stack: Stack, client: httpx.Client, finished: dict[str, Any]) -> None:
    """Bytes a client library would refuse to send in a header (NUL, DEL, control bytes,
    Latin-1), and percent-escapes in ``after`` that decode to no text or to a NUL."""
    target = f"/v1/requests/{finished['id']}/events"
    for value in [b"\xff\xfe", b"\x01", b"\x7f", b"1-0\x00", b"\xc3\xa9", b"1-0\t", b"9" * 5000]:
        status, _ = raw_get(stack, target.encode(), b"Last-Event-ID: " + value + b"\r\n")
        assert status == 400, value
    for after in ["%00", "%FF", "1-0%00", "%C3%28", "1-0:%FF", "%2F", "1-0&after=2-0"]:
        resp = client.get(f"{target}?after={after}")
        check(resp)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "after", resp.text
