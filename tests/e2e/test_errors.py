"""Errors a client can act on, decided before the first byte."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Stack
from tests.e2e.helpers import chat_body


@pytest.fixture
def client(stack: Stack) -> httpx.Client:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        yield c


def error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert body["message"]
    return body


def test_validation_errors_name_the_parameter(stack: Stack, client: httpx.Client) -> None:
    m = stack.model
    # a model this server does not know: OpenAI's (and vLLM's) 404
    err = error(client.post("/v1/chat/completions", json=chat_body("nope", "hi")), 404)
    assert (err["param"], err["code"], err["type"]) == (
        "model",
        "model_not_found",
        "invalid_request_error",
    )
    assert "nope" in err["message"]
    cases = [
        (chat_body(m, "hi", n=9), "n", "<= 8"),
        (chat_body(m, "hi", max_tokens=10_000_000), "max_tokens", "10000000"),
        (chat_body(m, "hi", stop=["a", "b", "c", "d", "e"]), "stop", "5"),
        (chat_body(m, "hi", stop=[""]), "stop", "empty"),
        ({"model": m, "messages": []}, "messages", "empty"),
    ]
    for body, param, observed in cases:
        err = error(client.post("/v1/chat/completions", json=body), 400)
        assert err["param"] == param, err
        assert observed in err["message"], err
        assert err["type"] == "invalid_request_error"


def test_malformed_json_and_wrong_types(stack: Stack, client: httpx.Client) -> None:
    err = error(
        client.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        ),
        400,
    )
    assert err["type"] == "invalid_request_error"
    err = error(
        client.post("/v1/chat/completions", json=chat_body(stack.model, "hi", max_tokens="many")),
        400,
    )
    assert "max_tokens" in (err["param"] or "") + err["message"]


def test_body_over_the_size_limit(stack: Stack, client: httpx.Client) -> None:
    big = "x" * (stack.settings.max_body_bytes + 10)
    resp = client.post("/v1/chat/completions", json=chat_body(stack.model, big))
    assert resp.status_code == 413


def test_unknown_request_and_bad_cursor(stack: Stack, client: httpx.Client) -> None:
    err = error(client.get("/v1/requests/chatcmpl-doesnotexist/events"), 404)
    assert err["code"] == "not_found"
    error(client.get("/v1/requests/chatcmpl-doesnotexist"), 404)
    done = client.post("/v1/chat/completions", json=chat_body(stack.model, "cursor test"))
    rid = done.json()["id"]
    for bad in ["garbage", "1-2:x", "99999999999999-0", "0-1"]:
        err = error(client.get(f"/v1/requests/{rid}/events", headers={"Last-Event-ID": bad}), 400)
        assert err["code"] == "invalid_event_id" and err["param"] == "Last-Event-ID"
    err = error(client.get(f"/v1/requests/{rid}/events", params={"after": "x"}), 400)
    assert err["param"] == "after"


def test_health_and_schema(stack: Stack, client: httpx.Client) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["checks"] == {"redis": "ok", "durability": "ok", "postgres": "ok"}
    assert ready["durability"]["level"] == stack.settings.durability
    schema = client.get("/schema/openapi.json").json()
    assert "/v1/chat/completions" in schema["paths"]
    assert "/v1/requests/{request_id}/events" in schema["paths"]
    assert client.get("/metrics").status_code == 200
