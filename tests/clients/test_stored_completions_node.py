"""OpenAI's stored chat completions through the official ``openai`` Node SDK, unmodified,
against a real stack: ``tests/clients/node/openai_stored.mjs`` creates completions with
``store: true`` and ``metadata`` (one streamed), and a few without ``store``; lists them
(metadata and model filters, ``after``, ``limit``, ``order``, the SDK's pages and
auto-pagination), retrieves one, lists its messages, updates its metadata and deletes it;
and asks for them with another tenant's key. The script reports what each method
returned; the checks are here. Each test run has tenants of its own, so the lists hold
nothing but what the script made."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from tests.clients.conftest import ClientStack, make_key

pytestmark = pytest.mark.clients
STORED = 5


def billing_rows(database_url: str, ids: list[str]) -> dict[str, dict[str, Any]]:
    """The requests rows of ``ids``: whether each is ``stored``, when it was recorded."""

    async def read() -> dict[str, dict[str, Any]]:
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as conn:
                rows = await conn.execute(
                    text("SELECT id, stored, recorded_ms FROM requests WHERE id = ANY(:ids)"),
                    {"ids": ids},
                )
                return {r.id: {"stored": r.stored, "recorded_ms": r.recorded_ms} for r in rows}
        finally:
            await engine.dispose()

    return asyncio.run(read())


def not_found(outcome: dict[str, Any]) -> bool:
    return (
        outcome["ok"] is False
        and outcome["status"] == 404
        and (outcome["error"] == "NotFoundError")
    )


@pytest.fixture(scope="module")
def seen(node: Any, clients_stack: ClientStack, database_url: str) -> dict[str, Any]:
    run = uuid.uuid4().hex[:12]
    env = {
        "LASTEVENT_URL": clients_stack.url,
        "LASTEVENT_API_KEY": make_key(database_url, f"stored-{run}"),
        "OTHER_API_KEY": make_key(database_url, f"stored-other-{run}"),
        "LASTEVENT_MODEL": clients_stack.model,
        "RUN": run,
        "STORED": str(STORED),
    }
    out: dict[str, Any] = node("node/openai_stored.mjs", env=env, timeout=240).result()
    out["run"] = run
    return out


def test_created_completions_are_listed_in_order(seen: dict[str, Any]) -> None:
    ids = [c["id"] for c in seen["created"]]
    assert len(set(ids)) == STORED and all(i.startswith("chatcmpl-") for i in ids)
    everything = [*ids, seen["streamed"]["id"]]
    # oldest first (OpenAI's default order); nothing else of the tenant, none unstored
    assert seen["listed"] == everything
    assert seen["filtered"]["auto"] == everything  # auto-pagination, 2 a page
    assert seen["filtered"]["desc"] == everything[::-1]  # order=desc, every page
    assert seen["filtered"]["afterSecond"] == ids[2:4]  # after=, limit=2


def test_pages_follow_after(seen: dict[str, Any]) -> None:
    everything = [*[c["id"] for c in seen["created"]], seen["streamed"]["id"]]
    pages = seen["pages"]
    assert [p["ids"] for p in pages] == [everything[i : i + 2] for i in range(0, 6, 2)]
    assert [p["hasMore"] for p in pages] == [True, True, False]


def test_unstored_requests_are_recorded_but_not_listed(
    seen: dict[str, Any], database_url: str
) -> None:
    rows = billing_rows(database_url, seen["unstored"])
    # their billing rows were written before the list was read: the list left them out
    assert set(rows) == set(seen["unstored"])
    assert all(r["stored"] is False for r in rows.values())
    assert all(r["recorded_ms"] <= seen["listedAt"] for r in rows.values())
    assert not set(seen["unstored"]) & set(seen["listed"])


def test_filters(seen: dict[str, Any]) -> None:
    ids = [c["id"] for c in seen["created"]]
    assert seen["filtered"]["even"] == ids[0::2]
    assert seen["filtered"]["model"] == [*ids, seen["streamed"]["id"]]
    assert seen["filtered"]["otherModel"] == []


def test_retrieve_and_messages(seen: dict[str, Any]) -> None:
    first, got = seen["created"][0], seen["retrieved"]
    assert got["id"] == first["id"] and got["object"] == "chat.completion"
    assert got["model"] == first["model"]
    assert got["choices"][0]["message"]["content"] == first["content"]
    assert first["content"]  # the scripted engine answered something
    assert got["usage"]["completion_tokens"] == first["usage"]["completion_tokens"]
    assert got["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"]
    assert got["metadata"] == seen["metadata"][0]
    sent = [seen["system"], {"role": "user", "content": seen["questions"][0]}]
    assert [{"role": m["role"], "content": m["content"]} for m in seen["messages"]] == sent
    message_ids = [m["id"] for m in seen["messages"]]
    assert len(set(message_ids)) == 2
    assert seen["messagesPaged"] == message_ids  # limit=1: two pages
    streamed = seen["streamed"]
    assert streamed["retrieved"]["choices"][0]["message"]["content"] == streamed["text"] != ""
    assert streamed["retrieved"]["metadata"] == {"run": seen["run"], "streamed": "yes"}


def test_update(seen: dict[str, Any]) -> None:
    first = seen["created"][0]["id"]
    want = {**seen["metadata"][0], "reviewed": "yes"}
    assert seen["updated"]["id"] == first and seen["updated"]["metadata"] == want
    assert seen["afterUpdate"]["retrieved"] == want
    assert seen["afterUpdate"]["reviewed"] == [first]


def test_delete(seen: dict[str, Any]) -> None:
    first = seen["created"][0]["id"]
    assert seen["deleted"] == {"id": first, "object": "chat.completion.deleted", "deleted": True}
    after = seen["afterDelete"]
    for method in ("retrieve", "messages", "update", "delete"):
        assert not_found(after[method]), (method, after[method])
    rest = [c["id"] for c in seen["created"][1:]]
    assert after["list"] == [*rest, seen["streamed"]["id"]]


def test_another_tenant_sees_nothing(seen: dict[str, Any]) -> None:
    foreign = seen["foreign"]
    for method in ("retrieve", "messages", "update", "delete"):
        assert not_found(foreign[method]), (method, foreign[method])
    assert foreign["list"] == []
    # its update and delete changed nothing
    second = seen["secondAfter"]
    assert second["id"] == seen["created"][1]["id"]
    assert second["metadata"] == seen["metadata"][1]
    assert second["choices"][0]["message"]["content"] == seen["created"][1]["content"]
