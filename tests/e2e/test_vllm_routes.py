"""vLLM's auxiliary routes against the real API process: /health, /version, /tokenize,
/detokenize, and OpenAI's GET /v1/models/{id}; tokens counted as the completion routes
count them, and the API key where a /v1 route would want one."""

from __future__ import annotations

import importlib.metadata
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Stack, free_port, make_stack, running
from tests.e2e.helpers import LONG
from tests.e2e.test_auth import auth, make_key

CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Café, 日本語, 🤖: which is a drink?"},
    {"role": "assistant", "content": "Café."},
    {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "?"}]},
]


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("vllm-routes"),
        redis_url,
        database_url,
        model_dir,
        auth="required",
        default_max_tokens=4,
    ) as st:
        yield st


@pytest.fixture(scope="module")
def keys(stack: Stack, database_url: str) -> dict[str, str]:
    return {
        "acme": make_key(database_url, "acme"),
        "other-model": make_key(database_url, "acme", models=["some-other-model"]),
    }


@pytest.fixture(scope="module")
def client(stack: Stack, keys: dict[str, str]) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30, headers=auth(keys["acme"])) as c:
        yield c


def tokenize(client: httpx.Client, **body: Any) -> dict[str, Any]:
    resp = client.post("/tokenize", json=body)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    assert out["count"] == len(out["tokens"])
    return out


def detokenize(client: httpx.Client, tokens: list[int]) -> str:
    resp = client.post("/detokenize", json={"tokens": tokens})
    assert resp.status_code == 200, resp.text
    return str(resp.json()["prompt"])


def test_health_and_version_are_open(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as c:  # no key
        health = c.get("/health")
        assert health.status_code == 200 and health.content == b""
        version = c.get("/version")
        assert version.status_code == 200
        assert version.json() == {"version": importlib.metadata.version("lastevent")}


def test_health_is_503_while_redis_does_not_answer(
    tmp_path: Path, database_url: str, model_dir: Path
) -> None:
    """An API process whose Redis is not there: up (/healthz), not serving (/health)."""
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    st = make_stack(tmp_path, nowhere, database_url, model_dir)
    port = free_port()
    proc = st._spawn("api", "api", port=port)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, st.tail("api")
            assert time.monotonic() < deadline, st.tail("api")
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        health = httpx.get(url + "/health", timeout=30)
        assert health.status_code == 503 and health.content == b""
    finally:
        st.stop()


def test_tokenize_counts_the_chat_completions_prompt_tokens(
    stack: Stack, client: httpx.Client
) -> None:
    for messages in (CONVERSATION, [{"role": "user", "content": LONG}]):
        counted = tokenize(client, model=stack.model, messages=messages)
        answer = client.post(
            "/v1/chat/completions", json={"model": stack.model, "messages": messages}
        )
        assert answer.status_code == 200, answer.text
        assert counted["count"] == answer.json()["usage"]["prompt_tokens"]
        assert counted["token_strs"] is None


def test_tokenize_counts_the_completions_prompt_tokens(stack: Stack, client: httpx.Client) -> None:
    counted = tokenize(client, prompt=LONG)  # model is optional, as in vLLM
    answer = client.post("/v1/completions", json={"model": stack.model, "prompt": LONG})
    assert answer.status_code == 200, answer.text
    assert counted["count"] == answer.json()["usage"]["prompt_tokens"]
    models = client.get("/v1/models").json()["data"]
    assert counted["max_model_len"] == models[0]["max_model_len"]


def test_detokenize_inverts_tokenize_multibyte_included(client: httpx.Client) -> None:
    for text in (LONG, "Zürich 5€ 日本語 👩‍👩‍👧", " leading and trailing  "):
        assert detokenize(client, tokenize(client, prompt=text)["tokens"]) == text


def test_token_strs_and_the_generation_prompt(client: httpx.Client) -> None:
    full = tokenize(client, messages=CONVERSATION, return_token_strs=True)
    assert full["token_strs"] is not None and len(full["token_strs"]) == full["count"]
    assert "".join(full["token_strs"]).replace("Ġ", " ").startswith("<|im_start|>system")
    bare = tokenize(client, messages=CONVERSATION, add_generation_prompt=False)
    assert full["tokens"][: bare["count"]] == bare["tokens"] and full["count"] > bare["count"]
    # the generation prompt opens the assistant's turn; special tokens are kept
    assert detokenize(client, full["tokens"][bare["count"] :]).startswith("<|im_start|>assistant")


def test_bad_bodies_are_400_naming_the_field(stack: Stack, client: httpx.Client) -> None:
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/tokenize", {"prompt": "x", "temperature": 0}, "temperature"),
        ("/tokenize", {"messages": CONVERSATION, "continue_final_message": True}, "continue_final"),
        ("/tokenize", {"model": "gpt-4", "prompt": "x"}, "model"),
        ("/tokenize", {"prompt": "x", "messages": CONVERSATION}, "prompt"),
        ("/tokenize", {}, "messages"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
        ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
        ("/detokenize", {"tokens": [49152]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"model": "gpt-4", "tokens": [1]}, "model"),
    ]
    for path, body, field in cases:
        resp = client.post(path, json=body)
        # an unknown model is a 404 (OpenAI's and vLLM's), the rest 400s
        assert resp.status_code == (404 if field == "model" else 400), (path, body, resp.text)
        error = resp.json()["error"]
        assert field in f"{error['param']} {error['message']}", (path, body, error)
        if field == "model":
            assert error["code"] == "model_not_found"


def test_model_by_id(stack: Stack, client: httpx.Client, keys: dict[str, str]) -> None:
    one = client.get(f"/v1/models/{stack.model}")
    assert one.status_code == 200
    assert one.json() == client.get("/v1/models").json()["data"][0]
    assert one.json()["id"] == stack.model
    for model_id, key in (("gpt-4", keys["acme"]), (stack.model, keys["other-model"])):
        missing = client.get(f"/v1/models/{model_id}", headers=auth(key))
        assert missing.status_code == 404, missing.text
        error = missing.json()["error"]
        assert error["code"] == "model_not_found" and model_id in error["message"]
    # a key limited to other models may not count this one's tokens either
    refused = client.post("/tokenize", json={"prompt": "x"}, headers=auth(keys["other-model"]))
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"


def test_tokenize_detokenize_and_models_by_id_need_a_key(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as c:  # no key
        for method, path, body in (
            ("POST", "/tokenize", {"prompt": "x"}),
            ("POST", "/detokenize", {"tokens": [1]}),
            ("GET", f"/v1/models/{stack.model}", None),
        ):
            resp = c.request(method, path, json=body)
            assert resp.status_code == 401, (path, resp.text)
            assert resp.json()["error"]["code"] == "missing_api_key"
