"""The console's JSON routes (``/v1/admin/...``): requests found by filters with keyset
paging, a request's page (row, kept input, output, events), replay, reconcile, spend --
an operator sees every tenant, a tenant key its own only (another tenant's request is the
unknown id's 404, its rows are not there)."""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import migrated_database
from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import chat_body
from tests.e2e.test_auth import make_key
from tests.waiting import wait_until

UNKNOWN = "chatcmpl-" + "0" * 32


@pytest.fixture(scope="module")
def console_db(pg_admin_url: str) -> Iterator[str]:
    """A database of this module's own: reconcile and spend see only its rows."""
    with migrated_database(pg_admin_url) as url:
        yield url


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, console_db: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("console"), redis_url, console_db, model_dir, auth="required"
    ) as st:
        yield st


@pytest.fixture(scope="module")
def keys(stack: Stack, console_db: str) -> dict[str, str]:
    return {
        "acme": make_key(console_db, "acme"),
        "globex": make_key(console_db, "globex"),
        "operator": make_key(console_db, "ops", role="operator"),
    }


@pytest.fixture(scope="module")
def made(stack: Stack, keys: dict[str, str]) -> dict[str, str]:
    """Requests of both tenants: stored and tagged, kept out of the list, a user's."""
    ids = {
        "stored": _chat(stack, keys["acme"], "acme asks <b>this</b>", store=True,
                        metadata={"team": "red"}, user="u-1"),
        "plain": _chat(stack, keys["acme"], "acme asks quietly", user="u-2"),
        "globex": _chat(stack, keys["globex"], "globex asks", store=True,
                        metadata={"team": "red"}),
    }  # fmt: skip
    for rid in ids.values():
        recorded(stack, keys["operator"], rid)
    return ids


def recorded(stack: Stack, key: str, rid: str) -> None:
    """The list and the page's row read the ledger: wait until the recorder wrote it."""

    def row() -> Any:
        return _get(stack, key, f"/requests/{rid}").json().get("request")

    wait_until(row, f"{rid} recorded")


def _chat(stack: Stack, key: str, text: str, **extra: Any) -> str:
    body = chat_body(stack.model, text, **extra)
    answer = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=_auth(key))
    assert answer.status_code == 200, answer.text
    rid: str = answer.json()["id"]
    return rid


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _get(stack: Stack, key: str, path: str, **params: Any) -> httpx.Response:
    return httpx.get(f"{stack.url}/v1/admin{path}", params=params, headers=_auth(key))


def _ids(stack: Stack, key: str, **params: Any) -> list[str]:
    answer = _get(stack, key, "/requests", **params)
    assert answer.status_code == 200, answer.text
    return [r["id"] for r in answer.json()["data"]]


def test_who_am_i(stack: Stack, keys: dict[str, str]) -> None:
    assert _get(stack, keys["operator"], "/me").json()["role"] == "operator"
    me = _get(stack, keys["acme"], "/me").json()
    assert (me["role"], me["tenant"]) == ("user", "acme")
    assert _get(stack, "sk-le-nobody-aaaaaaaaaaaaaaaa", "/me").status_code == 401


def test_filters_and_tenant_scope(stack: Stack, keys: dict[str, str], made: dict[str, str]) -> None:
    op = keys["operator"]
    assert set(made.values()) <= set(_ids(stack, op))
    assert _ids(stack, op, tenant="globex") == [made["globex"]]
    assert _ids(stack, op, user="u-1") == [made["stored"]]
    assert set(_ids(stack, op, **{"metadata[team]": "red"})) == {made["stored"], made["globex"]}
    assert _ids(stack, op, **{"metadata[team]": "blue"}) == []
    assert set(_ids(stack, op, state="finished", finish_reason="stop")) >= set(made.values())
    assert _ids(stack, op, state="errored") == []
    later = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert _ids(stack, op, since=later) == []
    # a tenant key: its own rows only, whatever it asks for
    acme = set(_ids(stack, keys["acme"]))
    assert acme == {made["stored"], made["plain"]}
    assert set(_ids(stack, keys["acme"], tenant="globex")) == acme
    assert _ids(stack, keys["globex"], **{"metadata[team]": "red"}) == [made["globex"]]


def test_keyset_pages_cover_everything_once(
    stack: Stack, keys: dict[str, str], made: dict[str, str]
) -> None:
    op, seen, cursor = keys["operator"], [], None
    while True:
        page = _get(stack, op, "/requests", limit=1, **({"cursor": cursor} if cursor else {}))
        body = page.json()
        seen += [r["id"] for r in body["data"]]
        cursor = body["next_cursor"]
        if cursor is None:
            break
    assert seen == _ids(stack, op, limit=200) and len(seen) == len(set(seen))
    bad = _get(stack, op, "/requests", cursor="not-a-cursor")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "cursor"
    assert _get(stack, op, "/requests", limit=0).status_code == 400
    assert _get(stack, op, "/requests", since="yesterday").status_code == 400


def test_request_page(stack: Stack, keys: dict[str, str], made: dict[str, str]) -> None:
    page = _get(stack, keys["acme"], f"/requests/{made['stored']}").json()
    assert page["request"]["tenant"] == "acme" and page["request"]["stored"] is True
    assert page["request"]["metadata"] == {"team": "red"}
    assert page["input"]["messages"] == [{"role": "user", "content": "acme asks <b>this</b>"}]
    assert page["input"]["metadata"] == {"team": "red"}
    assert page["output"][0]["text"] == "acme asks <b>this</b>"
    kinds = [e["type"] for e in page["events"]]
    assert kinds[0] == "created" and kinds[-1] == "end" and "delta" in kinds
    first = next(e for e in page["events"] if e["type"] == "delta")
    assert first["how"] == "first" and first["worker"]
    # ``store`` not sent: the answer is kept (replay), the input is not
    plain = _get(stack, keys["acme"], f"/requests/{made['plain']}").json()
    assert plain["input"] is None and plain["output"][0]["text"] == "acme asks quietly"


def test_another_tenants_request_is_404_everywhere(
    stack: Stack, keys: dict[str, str], made: dict[str, str]
) -> None:
    acme = keys["acme"]
    for path in (f"/requests/{made['globex']}", f"/requests/{made['globex']}/replay"):
        theirs, never = (
            _get(stack, acme, path),
            _get(stack, acme, path.replace(made["globex"], UNKNOWN)),
        )
        assert theirs.status_code == never.status_code == 404
        assert theirs.json()["error"]["code"] == never.json()["error"]["code"]
    mine = _get(stack, acme, f"/requests/{made['stored']}/replay", format="text")
    assert mine.status_code == 200 and mine.text == "acme asks <b>this</b>"


def test_reconcile_is_the_operators(
    stack: Stack, keys: dict[str, str], made: dict[str, str]
) -> None:
    span = {
        "since": "2020-01-01T00:00:00Z",
        "until": (datetime.now(UTC) + timedelta(1)).isoformat(),
    }
    assert _get(stack, keys["acme"], "/billing/reconcile", **span).status_code == 403
    report = _get(stack, keys["operator"], "/billing/reconcile", **span).json()
    assert report["clean"] is True and report["checked"] >= len(made), report
    backwards = {"since": span["until"], "until": span["since"]}
    assert _get(stack, keys["operator"], "/billing/reconcile", **backwards).status_code == 400


def test_spend_per_day_as_json_and_csv(
    stack: Stack, keys: dict[str, str], made: dict[str, str]
) -> None:
    today = datetime.now(UTC).date()
    span = {"since": str(today), "until": str(today + timedelta(days=1))}
    rows = _get(stack, keys["operator"], "/billing/spend", **span).json()["data"]
    by_tenant = {r["tenant"]: r for r in rows}
    assert by_tenant["acme"]["requests"] == 2 and by_tenant["globex"]["requests"] == 1
    assert {r["day"] for r in rows} == {str(today)}
    mine = _get(stack, keys["acme"], "/billing/spend", tenant="globex", **span).json()["data"]
    assert {r["tenant"] for r in mine} == {"acme"}
    answer = _get(stack, keys["operator"], "/billing/spend", format="csv", **span)
    assert answer.headers["content-type"].startswith("text/csv")
    assert "attachment" in answer.headers["content-disposition"]
    table = list(csv.DictReader(io.StringIO(answer.text)))
    assert {r["tenant"]: int(r["requests"]) for r in table} == {"acme": 2, "globex": 1}
    assert int(table[0]["total_tokens"]) == by_tenant[table[0]["tenant"]]["total_tokens"]


def test_kept_inputs_for_a_tenant_without_listing_them(
    stack: Stack, keys: dict[str, str], console_db: str
) -> None:
    """An operator keeps every input of a tenant (``lastevent tenants``): the console shows
    it, the tenant's stored-completions list does not (the client did not ask)."""
    tenant = f"audited-{uuid.uuid4().hex[:6]}"
    key = make_key(console_db, tenant)
    env = {**os.environ, **stack.settings.to_env()}
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "tenants", "set", tenant, "--keep-inputs", "on"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rid = _chat(stack, key, "kept for the auditors")
    recorded(stack, keys["operator"], rid)
    page = _get(stack, keys["operator"], f"/requests/{rid}").json()
    assert page["input"]["messages"][0]["content"] == "kept for the auditors"
    assert page["request"]["stored"] is False
    listed = httpx.get(f"{stack.url}/v1/chat/completions", headers=_auth(key)).json()
    assert listed["data"] == []
