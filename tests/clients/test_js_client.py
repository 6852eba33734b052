"""The JS client (service/api/static/lastevent.js) in Node, against a real stack through a
CuttingProxy (every connection cut after 300-3000 bytes): tests/clients/js/client.mjs
does the streaming and prints what it saw; these tests judge it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.clients.conftest import HERE, QUESTION, ClientStack, RecordingProxy, api_target
from tests.clients.proxy import CuttingProxy
from tests.e2e.conftest import Stack, make_stack

pytestmark = pytest.mark.clients


def run_client(
    node: Any, mode: str, url: str, stack: Stack, api_key: str | None, question: str = QUESTION
) -> dict[str, Any]:
    env = {
        "LASTEVENT_URL": url,
        "LASTEVENT_DIRECT_URL": stack.url,
        "LASTEVENT_API_KEY": api_key or "",
        "LASTEVENT_MODEL": stack.model,
        "QUESTION": question,
    }
    out: dict[str, Any] = node("js/client.mjs", mode, env=env).result()
    return out


def test_parser_follows_the_sse_spec(node: Any) -> None:
    """The client's own SSE parser (node --test): fields, line ends, cut events."""
    proc = subprocess.run(
        ["node", "--test", str(HERE / "js" / "sse_parser.test.mjs")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout


def test_whole_answer_through_cuts(
    node: Any, clients_stack: ClientStack, api_key: str, proxy: RecordingProxy
) -> None:
    out = run_client(node, "resume", proxy.url, clients_stack, api_key)
    reqs = out["requests"]
    assert out["text"] == QUESTION
    assert out["joined"] == QUESTION  # the yielded strings, joined
    assert out["state"] == "done"
    assert out["finishReason"] == "stop"
    assert out["reconnects"] > 0 and proxy.cuts > 0
    assert out["streamToken"]
    # one request id, learnt from the first POST that got its headers
    assert {r["requestId"] for r in reqs if r["requestId"]} == {out["requestId"]}
    posts = [r for r in reqs if r["method"] == "POST"]
    # POSTs are only those sent before any headers came back, all with the same key
    assert all(r["status"] is None for r in posts[:-1]), posts
    assert len({r["idempotencyKey"] for r in posts}) == 1 and posts[0]["idempotencyKey"]
    gets = reqs[len(posts) :]
    assert all(r["method"] == "GET" and r["authorization"] for r in gets)
    assert all(r["path"] == f"/v1/requests/{out['requestId']}/events" for r in gets)
    assert all(r["lastEventId"] for r in gets if r is not gets[0])
    # it stops after the end: the request that ended it is the last one, and the node
    # process exited by itself (no timer, no socket left); every connection the proxy
    # saw is one of these requests (each cut connection carries one, the last one ended)
    assert out["requestsAtEnd"] == len(reqs)
    last = reqs[-1]
    assert last["status"] in (200, 204), last
    sent = sorted(f"{r['method']} {r['path']}" for r in reqs)
    at_proxy = sorted(
        line.split(" ")[0] + " " + line.split(" ")[1].split("?")[0] for line in proxy.requests
    )
    assert at_proxy == sent, (proxy.request_lines, reqs)
    # every reconnection but the last brought nothing more than it could (no loop)
    assert out["reconnects"] == len(reqs) - 1


def test_post_cut_before_its_headers_is_sent_again(
    node: Any, clients_stack: ClientStack, api_key: str
) -> None:
    """The first connection is cut 200 bytes into the POST's response (inside its
    headers): the client sends the POST again with the same Idempotency-Key, and the
    server answers the same request, streamed from the start."""
    question = QUESTION[:200]
    proxy = RecordingProxy(api_target(clients_stack), budgets=(200,))
    proxy.start()
    try:
        out = run_client(node, "resume", proxy.url, clients_stack, api_key, question)
    finally:
        proxy.close()
    assert out["text"] == question and out["state"] == "done"
    posts = [r for r in out["requests"] if r["method"] == "POST"]
    assert len(posts) >= 2 and posts[0]["status"] is None and posts[0]["error"], posts
    assert len({r["idempotencyKey"] for r in posts}) == 1
    assert proxy.exchanges[0].request.startswith("POST ") and proxy.exchanges[0].cut
    # the server had made the request before the cut: the POST that got its headers is
    # the same request again, not a second one
    answered = [r for r in posts if r["status"] is not None]
    assert answered and answered[0]["status"] == 200 and answered[0]["replayed"] == "true"
    # one request: every answer that came back names it
    assert {r["requestId"] for r in out["requests"] if r["requestId"]} == {out["requestId"]}


def test_idempotent_post_is_the_same_request(
    node: Any, clients_stack: ClientStack, api_key: str, proxy: RecordingProxy
) -> None:
    question = QUESTION[:160]
    out = run_client(node, "idempotent", proxy.url, clients_stack, api_key, question)
    first, again = out["first"], out["again"]
    assert first["text"] == question and first["state"] == "done"
    assert again["requestId"] == first["requestId"]
    assert again["text"] == question  # the same request, streamed from the start
    assert out["reused"] is not None, "the same key with another body was accepted"
    assert out["reused"]["status"] == 422 and out["reused"]["code"] == "idempotency_key_reused"
    resumed = out["resumedPost"]
    assert resumed["status"] == 200 and resumed["requestId"] == first["requestId"]
    assert resumed["before"] + resumed["rest"] == question  # resumed after Last-Event-ID


def test_stream_token_without_api_key(
    node: Any, clients_stack: ClientStack, api_key: str, proxy: RecordingProxy
) -> None:
    out = run_client(node, "token", proxy.url, clients_stack, api_key)
    rest = out["rest"]
    assert out["before"] + rest["text"] == QUESTION
    assert rest["state"] == "done" and rest["finishReason"] == "stop"
    keyless = [r for r in out["requests"] if not r["authorization"]]
    # every keyless read carries the token, but the last: no token at all -- sent again
    # only when the proxy cut its 401 (a cut of 300-3,000 bytes can fall inside it)
    tokenless = [i for i, r in enumerate(keyless) if not r["token"]]
    assert tokenless and tokenless == list(range(tokenless[0], len(keyless)))
    assert tokenless[0] > 0 and (len(tokenless) == 1 or proxy.cuts > 0)
    assert out["status"]["state"] == "finished", out["status"]  # GET /v1/requests/{id}?token=
    assert out["noToken"] is not None and out["noToken"]["status"] == 401


def test_cancel(node: Any, clients_stack: ClientStack, api_key: str, proxy: RecordingProxy) -> None:
    out = run_client(node, "cancel", proxy.url, clients_stack, api_key)
    assert out["cancelled"] is not None
    assert out["finishReason"] == "cancelled" and out["state"] == "cancelled"
    assert QUESTION.startswith(out["text"]) and out["text"] != QUESTION
    cancels = [r for r in out["requests"] if r["path"].endswith("/cancel")]
    # the proxy cuts each connection after a random 300-3,000 bytes, a cancel's response
    # too: the client sends the (idempotent) cancel again then, and only then
    assert cancels and cancels[-1]["status"] in (200, 202)
    assert len(cancels) == 1 or proxy.cuts > 0


def test_drop_resumes(node: Any, clients_stack: ClientStack, api_key: str) -> None:
    """drop() breaks the connection (a plain proxy: only the drops break it)."""
    plain = CuttingProxy(api_target(clients_stack))
    plain.cutting = False
    plain.start()
    try:
        out = run_client(node, "drop", plain.url, clients_stack, api_key)
    finally:
        plain.close()
    assert out["text"] == QUESTION and out["state"] == "done"
    assert out["drops"] == 3 and out["reconnects"] == 3


def test_http_error_is_a_last_event_error(
    node: Any, clients_stack: ClientStack, api_key: str
) -> None:
    out = run_client(node, "rejected", clients_stack.url, clients_stack, api_key)
    assert out["error"]["status"] in (400, 404), out
    assert out["error"]["name"] == "LastEventError" and out["error"]["message"]


@pytest.fixture(scope="module")
def failing_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    st = make_stack(
        tmp_path_factory.mktemp("failing"),
        redis_url,
        database_url,
        model_dir,
        scripted_fail_after=40,
        scripted_tokens_per_s=100.0,
    )
    try:
        st.start_worker()
        st.start_api()
        yield st
    finally:
        st.stop()


def test_in_band_error_is_thrown(node: Any, failing_stack: Stack) -> None:
    p = CuttingProxy(api_target(failing_stack)).start()
    try:
        out = run_client(node, "inband", p.url, failing_stack, None)
    finally:
        p.close()
    assert out["error"] is not None, out
    assert out["error"]["name"] == "LastEventError" and out["error"]["status"] is None
    assert out["error"]["code"] and out["error"]["message"]
    assert out["state"] == "error"
    assert QUESTION.startswith(out["text"]) and 0 < len(out["text"]) < len(QUESTION)
