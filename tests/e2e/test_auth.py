"""API keys and tenants: 401, 403, and another tenant's request is indistinguishable
from one that never existed."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from sqlalchemy.ext.asyncio import create_async_engine

from service.ledger.api_keys import ApiKeys
from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import chat_body, content_of, read_all


def make_key(database_url: str, tenant: str, **kw: object) -> str:
    async def create() -> str:
        engine = create_async_engine(database_url)
        try:
            return await ApiKeys(engine).create(tenant, **kw)  # type: ignore[arg-type]
        finally:
            await engine.dispose()

    return asyncio.run(create())


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("auth"), redis_url, database_url, model_dir, auth="required"
    ) as st:
        yield st


@pytest.fixture(scope="module")
def keys(stack: Stack, database_url: str) -> dict[str, str]:
    return {
        "acme": make_key(database_url, "acme"),
        "globex": make_key(database_url, "globex"),
        "other-model": make_key(database_url, "acme", models=["some-other-model"]),
        "operator": make_key(database_url, "ops", role="operator"),
    }


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_missing_and_invalid_keys_are_401(stack: Stack, keys: dict[str, str]) -> None:
    body = chat_body(stack.model, "hi")
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        missing = c.post("/v1/chat/completions", json=body)
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["code"] == "missing_api_key"
        for bad in ["nonsense", "sk-le-nokey-0123456789abcdef", keys["acme"][:-1] + "x"]:
            resp = c.post("/v1/chat/completions", json=body, headers=auth(bad))
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/healthz").status_code == 200  # health, readiness and metrics stay open
    with pytest.raises(openai.AuthenticationError):
        OpenAI(
            base_url=stack.url + "/v1", api_key="sk-le-bad-000000000000", max_retries=0
        ).chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "x"}])


def test_model_and_route_permissions_are_403(stack: Stack, keys: dict[str, str]) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        resp = c.post(
            "/v1/chat/completions",
            json=chat_body(stack.model, "hi"),
            headers=auth(keys["other-model"]),
        )
        assert resp.status_code == 403
        assert resp.json()["error"]["code"] == "model_not_allowed"
        rid = c.post(
            "/v1/chat/completions", json=chat_body(stack.model, "mine"), headers=auth(keys["acme"])
        ).json()["id"]
        # replay: the operator any tenant's, a tenant its own; reconcile is the operators'
        replay = c.get(f"/v1/admin/requests/{rid}/replay", headers=auth(keys["operator"]))
        assert replay.status_code == 200 and b"mine" in replay.content
        own = c.get(f"/v1/admin/requests/{rid}/replay", headers=auth(keys["acme"]))
        assert own.status_code == 200 and own.content == replay.content
        theirs = c.get(f"/v1/admin/requests/{rid}/replay", headers=auth(keys["globex"]))
        assert theirs.status_code == 404
        span = {"since": "2020-01-01", "until": "2100-01-01"}
        reconcile = c.get("/v1/admin/billing/reconcile", params=span, headers=auth(keys["acme"]))
        assert reconcile.status_code == 403 and reconcile.json()["error"]["code"] == "forbidden"


def test_other_tenants_requests_are_404_everywhere(stack: Stack, keys: dict[str, str]) -> None:
    secret = "acme's confidential answer"
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        _, events = read_all(
            c,
            "POST",
            "/v1/chat/completions",
            headers=auth(keys["acme"]),
            json=chat_body(stack.model, secret, stream=True),
        )
        rid = events[0].data.split('"id":"')[1].split('"')[0]
        assert content_of(events) == secret
        never = "chatcmpl-" + "0" * 32
        for target in (rid, never):
            for method, path in (
                ("GET", f"/v1/requests/{target}"),
                ("GET", f"/v1/requests/{target}/events"),
                ("POST", f"/v1/requests/{target}/cancel"),
            ):
                resp = c.request(method, path, headers=auth(keys["globex"]))
                assert resp.status_code == 404, (method, path, resp.text)
                assert resp.json()["error"]["code"] == "not_found"
                assert "confidential" not in resp.text
        # same answer for "yours, hidden" and "never existed": nothing to tell them apart
        a = c.get(f"/v1/requests/{rid}", headers=auth(keys["globex"])).json()
        b = c.get(f"/v1/requests/{never}", headers=auth(keys["globex"])).json()
        assert a["error"]["message"].replace(rid, "X") == b["error"]["message"].replace(never, "X")
        # the owner still sees it, and the ledger row carries the tenant and key id
        mine = c.get(f"/v1/requests/{rid}", headers=auth(keys["acme"]))
        assert mine.status_code == 200 and mine.json()["state"] == "finished"


def test_other_tenants_responses_are_404_everywhere(stack: Stack, keys: dict[str, str]) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        made = c.post(
            "/v1/responses",
            headers=auth(keys["acme"]),
            json={"model": stack.model, "input": "acme's confidential answer"},
        )
        assert made.status_code == 200, made.text
        rid = made.json()["id"]
        for method, path, body in (
            ("GET", f"/v1/responses/{rid}", None),
            ("GET", f"/v1/responses/{rid}?stream=true", None),
            ("GET", f"/v1/responses/{rid}/input_items", None),
            ("POST", f"/v1/responses/{rid}/cancel", None),
            ("DELETE", f"/v1/responses/{rid}", None),
            (
                "POST",
                "/v1/responses",
                {"model": stack.model, "input": "go on", "previous_response_id": rid},
            ),
        ):
            resp = c.request(method, path, headers=auth(keys["globex"]), json=body)
            assert resp.status_code == 404, (method, path, resp.text)
            assert "confidential" not in resp.text
        mine = c.get(f"/v1/responses/{rid}", headers=auth(keys["acme"]))
        assert mine.status_code == 200 and mine.json()["status"] == "completed"


def test_tenant_and_key_reach_the_ledger(
    stack: Stack, keys: dict[str, str], database_url: str
) -> None:
    from tests.e2e.helpers import ledger_row

    sdk = OpenAI(base_url=stack.url + "/v1", api_key=keys["globex"], max_retries=0)
    resp = sdk.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "bill me"}]
    )
    row = ledger_row(database_url, resp.id)
    assert row is not None
    assert row["tenant"] == "globex"
    assert row["api_key_id"] == keys["globex"].split("-")[2]
