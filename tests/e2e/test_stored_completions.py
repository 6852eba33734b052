"""OpenAI's stored chat completions through the official Python SDK's own methods:
``store: true`` keeps the input with the answer; list (filters, paging), retrieve,
messages, update, delete; another tenant sees none of it (404s, never 403s)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import Stack, running
from tests.e2e.test_auth import make_key
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("stored"), redis_url, database_url, model_dir, auth="required"
    ) as st:
        yield st


@pytest.fixture(scope="module")
def tenants(stack: Stack, database_url: str) -> dict[str, str]:
    """Keys of two fresh tenants (the database is shared by the tier's modules)."""
    tag = uuid.uuid4().hex[:8]
    return {
        "a": make_key(database_url, f"stored-a-{tag}"),
        "b": make_key(database_url, f"stored-b-{tag}"),
        "operator": make_key(database_url, f"ops-{tag}", role="operator"),
    }


def sdk(stack: Stack, key: str) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)


def listed(client: OpenAI, **kw: object) -> list[str]:
    return [c.id for c in client.chat.completions.list(**kw)]  # type: ignore[arg-type]


def recorded(client: OpenAI, rid: str) -> None:
    """The list reads the ledger: wait until the recorder wrote the request's row."""
    wait_until(lambda: rid in listed(client, order="desc", limit=100), f"{rid} listed")


def test_store_list_retrieve_messages_update_delete(stack: Stack, tenants: dict[str, str]) -> None:
    a = sdk(stack, tenants["a"])
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "Answer as an echo."},
        {"role": "user", "content": "Stored <b>question</b> ☕"},
    ]
    made = a.chat.completions.create(
        model=stack.model,
        messages=messages,  # type: ignore[arg-type]
        store=True,
        metadata={"team": "audit", "run": "1"},
        temperature=0.5,
    )
    unstored = a.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "not kept"}]
    )
    recorded(a, made.id)

    got = a.chat.completions.retrieve(made.id)
    assert got.id == made.id and got.model == stack.model
    assert got.choices[0].message.content == made.choices[0].message.content
    assert got.metadata == {"team": "audit", "run": "1"}
    assert got.usage is not None and made.usage is not None
    assert got.usage.total_tokens == made.usage.total_tokens
    kept = list(a.chat.completions.messages.list(made.id))
    assert [(m.role, m.content) for m in kept] == [(m["role"], m["content"]) for m in messages]
    assert len({m.id for m in kept}) == 2

    everything = listed(a, order="desc", limit=100)
    assert made.id in everything and unstored.id not in everything
    assert listed(a, metadata={"team": "audit"}) == [made.id]
    assert listed(a, metadata={"team": "other"}) == []
    assert listed(a, model="some-other-model") == []

    updated = a.chat.completions.update(made.id, metadata={"team": "reviewed"})
    assert updated.metadata == {"team": "reviewed"}
    assert listed(a, metadata={"team": "reviewed"}) == [made.id]
    assert listed(a, metadata={"team": "audit"}) == []

    deleted = a.chat.completions.delete(made.id)
    assert deleted.deleted and deleted.id == made.id
    for call in (
        lambda: a.chat.completions.retrieve(made.id),
        lambda: a.chat.completions.messages.list(made.id),
        lambda: a.chat.completions.update(made.id, metadata={"x": "y"}),
        lambda: a.chat.completions.delete(made.id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert made.id not in listed(a, order="desc", limit=100)
    # the billing row stays, unlisted and untagged
    status = httpx.get(
        f"{stack.url}/v1/requests/{made.id}",
        headers={"Authorization": f"Bearer {tenants['a']}"},
    ).json()
    assert status["state"] == "finished"


def test_pages_follow_on_in_both_orders(stack: Stack, tenants: dict[str, str]) -> None:
    a = sdk(stack, tenants["a"])
    tag = {"page": uuid.uuid4().hex[:8]}
    ids = [
        a.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": f"page item {i}"}],
            store=True,
            metadata=tag,
        ).id
        for i in range(5)
    ]
    for rid in ids:
        recorded(a, rid)
    first = a.chat.completions.list(metadata=tag, limit=2, order="asc")
    assert [c.id for c in first.data] == ids[:2] and first.has_more
    # the SDK's own paging (``after`` = the last id of each page)
    assert [c.id for c in a.chat.completions.list(metadata=tag, limit=2)] == ids
    newest = [c.id for c in a.chat.completions.list(metadata=tag, limit=2, order="desc")]
    assert newest == ids[::-1]
    with pytest.raises(openai.BadRequestError):
        a.chat.completions.list(after="chatcmpl-" + "0" * 32)


def test_another_tenant_sees_nothing(stack: Stack, tenants: dict[str, str]) -> None:
    a, b = sdk(stack, tenants["a"]), sdk(stack, tenants["b"])
    made = a.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "tenant a's secret"}],
        store=True,
        metadata={"owner": "a"},
    )
    recorded(a, made.id)
    assert made.id not in listed(b, order="desc", limit=100)
    assert listed(b, metadata={"owner": "a"}) == []
    for call in (
        lambda: b.chat.completions.retrieve(made.id),
        lambda: b.chat.completions.messages.list(made.id),
        lambda: b.chat.completions.update(made.id, metadata={"owner": "b"}),
        lambda: b.chat.completions.delete(made.id),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        unknown = "chatcmpl-" + "0" * 32
        with pytest.raises(openai.NotFoundError) as never:
            b.chat.completions.retrieve(unknown)
        # nothing tells "another tenant's" from "never existed" but the id itself
        assert caught.value.body["code"] == never.value.body["code"]  # type: ignore[index]
    assert a.chat.completions.retrieve(made.id).metadata == {"owner": "a"}


@pytest.mark.parametrize(
    ("metadata", "why"),
    [
        ({f"k{i}": "v" for i in range(17)}, "17 pairs"),
        ({"k" * 65: "v"}, "a 65-character key"),
        ({"k": "v" * 513}, "a 513-character value"),
        ({"k": 1}, "a number"),
        ({"k": "a\x00b"}, "a NUL (Postgres' JSONB cannot hold it: the recorder would fail)"),
        ({"a\x00": "b"}, "a NUL in a key"),
    ],
)
def test_metadata_out_of_bounds_is_a_400_naming_it(
    stack: Stack, tenants: dict[str, str], metadata: dict[str, object], why: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        sdk(stack, tenants["a"]).chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": "x"}],
            store=True,
            metadata=metadata,  # type: ignore[arg-type]
        )
    assert "metadata" in str(caught.value.body), why


def test_a_nul_in_user_or_a_filter_is_a_400_not_a_stuck_recorder(
    stack: Stack, tenants: dict[str, str]
) -> None:
    """Postgres takes no NUL in text: the ``user`` the billing row keeps, and every filter
    the ledger is asked with, are refused at the door (a 500, or an entry the recorder
    retries for ever, otherwise)."""
    a = sdk(stack, tenants["a"])
    with pytest.raises(openai.BadRequestError) as caught:
        a.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "x"}], user="a\x00b"
        )
    assert caught.value.body["param"] == "user"  # type: ignore[index]
    for params in ({"model": "m\x00"}, {"metadata[k]": "v\x00"}, {"after": "\x00"}):
        answer = httpx.get(
            f"{stack.url}/v1/chat/completions",
            params=params,
            headers={"Authorization": f"Bearer {tenants['a']}"},
        )
        assert answer.status_code == 400, (params, answer.text)


def test_purging_a_tenants_archives_takes_its_stored_completions(
    stack: Stack, database_url: str
) -> None:
    """Retention applies to inputs as to answers: ``lastevent archive purge --tenant``
    deletes both, and the stored completions among them are no longer listed."""
    tenant = f"purged-{uuid.uuid4().hex[:8]}"
    key = make_key(database_url, tenant)
    client = sdk(stack, key)
    made = client.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "soon purged"}],
        store=True,
    )
    recorded(client, made.id)
    env = {**os.environ, **stack.settings.to_env()}
    purge = [sys.executable, "-m", "service.cli", "archive", "purge", "--tenant", tenant]
    done = subprocess.run(purge, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "deleted 1 archived logs" in done.stdout, done
    assert listed(client, order="desc", limit=100) == []
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.retrieve(made.id)
