"""The operators' console (/console) in real headless Chromium (Debian's /usr/bin/chromium
through playwright-core, tests/clients/js/console.mjs) against a real stack of its own: a
database of its own (so reconcile and spend see only this module's requests), API keys
required, two workers of the scripted engine, one of them killed with SIGKILL while it
streams an answer (the other takes it over).

- an operator logs in, pages through and filters the list, opens the request that was
  taken over (the takeover is shown), replays it at the original speed (the text equals
  what the client received), reconciles (clean) and exports spend as CSV (its rows are
  this module's requests);
- a tenant's key sees its tenant's rows only, and another tenant's request is "no such
  request" (a 404, as on the API);
- a prompt, answer, metadata and end user made of markup (``<script>``, ``<img
  onerror>``, ``javascript:`` links) and SSE-looking lines are shown as text in every view,
  and nothing of it runs: no call of the page's ``pwned()``, no CSP violation, no element
  made of it;
- the key is never in the address, localStorage or a cookie.

``LASTEVENT_SCREENSHOTS=docs/img`` saves the pictures of docs/operations/console.md (the list,
the request page and the spend chart) there.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import EventSource, ServerSentEvent

from service.store.keys import Keys
from tests.conftest import migrated_database
from tests.e2e.conftest import Stack, make_stack
from tests.e2e.helpers import LONG, content_of
from tests.e2e.test_auth import make_key
from tests.waiting import wait_until

pytestmark = [pytest.mark.clients, pytest.mark.timeout(300)]

CHROMIUM = Path(os.environ.get("LASTEVENT_CHROMIUM", "/usr/bin/chromium"))
SAFETY_S = 120.0  # a hang guard only
TOKENS_PER_S = 30.0  # LONG (~300 tokens) takes ~10 s: time to kill its worker mid-answer
KILL_AFTER_EVENTS = 40  # ~1.3 s into the answer

# what an attacker may send: markup that would run if the page parsed it, and lines that
# look like the SSE stream's own framing
HOSTILE = (
    "<script>pwned('script')</script>\n"
    "<img src=x onerror=\"pwned('img'); window.__hostile = 1\">\n"
    "<a href=\"javascript:pwned('link')\">click me</a>\n"
    "<svg onload=\"pwned('svg')\"></svg><iframe src=\"javascript:pwned('frame')\"></iframe>\n"
    "</pre></td></tr><b onmouseover=pwned('b')>bold</b> &lt;escaped&gt;\n"
    'data: {"choices":[{"delta":{"content":"injected"}}]}\n\n'
    "id: 1\n\n"
    "event: end\ndata: [DONE]\n\n"
)
HOSTILE_USER = "<script>pwned('user')</script>"
HOSTILE_METADATA = {"case": "hostile", "note": "<img src=x onerror=pwned('meta')>"}
HOSTILE_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "<img src=x onerror=pwned('tool')> javascript:pwned('tool')",
            "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
        },
    }
]
SPEND_COLUMNS = [
    "day",
    "tenant",
    "model",
    "requests",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
    "wasted_tokens",
    "reprefill_tokens",
]


@pytest.fixture(autouse=True)
def _chromium() -> None:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test-clients` installs Debian's chromium")


@dataclasses.dataclass
class Scene:
    """The module's stack and what was sent through it."""

    stack: Stack
    operator: str  # keys
    acme: str
    globex: str
    taken: str  # request ids
    client_text: str  # what the taken-over request's client received
    hostile: str
    ids: dict[str, list[str]]  # tenant -> its request ids
    since: str
    until: str = ""


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def owner_of(st: Stack, rid: str) -> str:
    keys = Keys(st.settings.key_prefix, st.settings.partitions)
    raw = st.store().hget(keys.meta(rid), "owner")
    return raw.decode() if isinstance(raw, bytes) else ""


def seen_connected(st: Stack, n: int) -> None:
    """The API process has seen ``n`` workers' named connections (a worker it never saw
    is left to its heartbeat)."""
    wanted = f"lastevent_workers_connected {float(n)}"
    wait_until(lambda: wanted in httpx.get(f"{st.url}/metrics").text, "the workers' connections")


@dataclasses.dataclass
class Streaming:
    """A streaming client in a thread."""

    events: list[ServerSentEvent] = dataclasses.field(default_factory=list)
    request_id: str = ""
    started: threading.Event = dataclasses.field(default_factory=threading.Event)
    failure: BaseException | None = None

    def run(self, url: str, key: str, body: dict[str, Any]) -> None:
        try:
            with (
                httpx.Client(base_url=url, timeout=SAFETY_S, headers=auth(key)) as client,
                client.stream("POST", "/v1/chat/completions", json=body) as r,
            ):
                assert r.status_code == 200, r.read()
                self.request_id = r.headers["x-request-id"]
                for event in EventSource(r).iter_sse():
                    self.events.append(event)
                    if len(self.events) >= KILL_AFTER_EVENTS:
                        self.started.set()
        except BaseException as e:  # noqa: BLE001 -- handed to the test
            self.failure = e
        finally:
            self.started.set()


def chat(model: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def taken_over(st: Stack, workers: dict[str, subprocess.Popen[bytes]], key: str) -> Streaming:
    """A stored, streamed answer whose worker is killed (SIGKILL) mid-answer."""
    body = chat(st.model, LONG, stream=True, store=True, user="alice")
    body["metadata"] = {"case": "takeover"}
    s = Streaming()
    thread = threading.Thread(target=s.run, args=(st.url, key, body), daemon=True)
    thread.start()
    assert s.started.wait(SAFETY_S) and s.failure is None, s.failure
    owner = owner_of(st, s.request_id)
    [name] = [n for n in workers if owner.startswith(f"{n}-")]
    workers[name].send_signal(signal.SIGKILL)
    workers[name].wait()
    thread.join(SAFETY_S)
    assert s.failure is None, s.failure
    assert content_of(s.events) == LONG, "the client's answer is not whole"
    return s


def answered(st: Stack, key: str, body: dict[str, Any]) -> str:
    r = httpx.post(f"{st.url}/v1/chat/completions", json=body, headers=auth(key), timeout=60)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def recorded(scene: Scene) -> None:
    """Every request of the scene has its billing row (the console lists from it)."""
    every = {rid for ids in scene.ids.values() for rid in ids}

    def listed() -> bool:
        r = httpx.get(
            f"{scene.stack.url}/v1/admin/requests",
            params={"limit": 200},
            headers=auth(scene.operator),
            timeout=30,
        )
        assert r.status_code == 200, r.text
        return every <= {row["id"] for row in r.json()["data"]}

    wait_until(listed, "the billing rows of every request", timeout=60)


@pytest.fixture(scope="module")
def scene(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, pg_admin_url: str, model_dir: Path
) -> Iterator[Scene]:
    since = (datetime.now(UTC) - timedelta(seconds=5)).isoformat()
    with migrated_database(pg_admin_url) as db:
        st = make_stack(
            tmp_path_factory.mktemp("console"),
            redis_url,
            db,
            model_dir,
            auth="required",
            scripted_tokens_per_s=TOKENS_PER_S,
            worker_stale_s=2.0,
            recorder_claim_idle_ms=1000,  # the killed worker's recorder entries are taken soon
        )
        try:
            workers = {"a": st.start_worker("a"), "b": st.start_worker("b")}
            st.start_api()
            seen_connected(st, 2)
            yield setting_up(st, db, workers, since)
        finally:
            st.stop()


def setting_up(
    st: Stack, db: str, workers: dict[str, subprocess.Popen[bytes]], since: str
) -> Scene:
    keys = {t: make_key(db, t) for t in ("acme", "globex")}
    operator = make_key(db, "ops", role="operator")
    s = taken_over(st, workers, keys["acme"])
    hostile = answered(
        st,
        keys["globex"],
        chat(
            st.model,
            HOSTILE,
            store=True,
            user=HOSTILE_USER,
            metadata=HOSTILE_METADATA,
            tools=HOSTILE_TOOLS,
        ),
    )
    acme = [answered(st, keys["acme"], chat(st.model, f"Hello from acme, {i}.")) for i in (1, 2)]
    globex = answered(st, keys["globex"], chat(st.model, "Hello from globex.", store=True))
    scene = Scene(
        stack=st,
        operator=operator,
        acme=keys["acme"],
        globex=keys["globex"],
        taken=s.request_id,
        client_text=content_of(s.events),
        hostile=hostile,
        ids={"acme": [s.request_id, *acme], "globex": [hostile, globex]},
        since=since,
    )
    recorded(scene)
    scene.until = (datetime.now(UTC) + timedelta(seconds=60)).isoformat()
    return scene


def browser(node: Any, scene: Scene, mode: str, key: str, **env: str) -> dict[str, Any]:
    run = node(
        "js/console.mjs",
        mode,
        env={
            "CHROMIUM": str(CHROMIUM),
            "BASE_URL": scene.stack.url,
            "CONSOLE_KEY": key,
            **env,
        },
        timeout=240,
    )
    out: dict[str, Any] = run.result()
    return out


def assert_nothing_ran(out: dict[str, Any], expected: str = "") -> None:
    """No injected script ran, the CSP was never needed, the key stayed in the session;
    the page logged no error (but for a resource ``expected`` to fail)."""
    exposure = out["exposure"]
    assert out["pwned"] == [], out["pwned"]
    assert exposure["flag"] is None
    assert exposure["violations"] == [], exposure["violations"]
    assert exposure["injected"] == 0
    errors = [
        line
        for line in out["console"]
        if line.startswith(("error", "pageerror")) and not (expected and expected in line)
    ]
    assert errors == [], errors
    assert not exposure["inHref"] and "sk-le-" not in exposure["href"]
    assert not exposure["inLocalStorage"] and not exposure["inCookie"]
    assert exposure["inSessionStorage"]


def test_the_console_is_served_with_a_strict_policy(scene: Scene) -> None:
    with httpx.Client(base_url=scene.stack.url, timeout=30) as c:
        page = c.get("/console")  # no key needed to load the page
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        for directive in ("default-src 'none'", "script-src 'self'", "style-src 'self'"):
            assert directive in csp, csp
        assert "frame-ancestors 'none'" in csp and "form-action 'none'" in csp
        assert page.headers["x-frame-options"] == "DENY"
        assert page.headers["referrer-policy"] == "no-referrer"
        assert page.headers["x-content-type-options"] == "nosniff"
        assert b"<script>" not in page.content and b"style=" not in page.content
        for name in ("console.js", "console.css"):
            assert c.get(f"/static/{name}").status_code == 200, name


def test_an_operator_finds_replays_reconciles_and_exports(node: Any, scene: Scene) -> None:
    env = {
        "TENANT": "acme",
        "METADATA": "case=takeover",
        "END_USER": "alice",
        "TAKEN_ID": scene.taken,
        "SINCE": scene.since,
        "UNTIL": scene.until,
    }
    if os.environ.get("LASTEVENT_SCREENSHOTS"):
        env["SCREENSHOTS"] = str(Path(os.environ["LASTEVENT_SCREENSHOTS"]).resolve())
    out = browser(node, scene, "operator", scene.operator, **env)
    every = [*scene.ids["acme"], *scene.ids["globex"]]
    assert "operator" in out["who"]
    assert set(out["first"]["ids"]) == set(every), out["first"]
    # keyset paging, two at a time: the first page, then the next two, newest first
    one, two = out["paged"]
    assert len(one["ids"]) == len(two["ids"]) == 2 and one["next"], out["paged"]
    assert one["ids"] + two["ids"] == out["first"]["ids"][:4]
    assert set(out["byTenant"]["ids"]) == set(scene.ids["acme"]), out["byTenant"]
    assert out["byMetadata"]["ids"] == [scene.taken], out["byMetadata"]
    assert out["byUser"]["ids"] == [scene.taken], out["byUser"]
    assert_taken_over_shown(out["opened"], scene)
    replayed = out["replayed"]
    assert replayed["text"] == scene.client_text, replayed["status"]
    assert out["reconciled"]["summary"].startswith("clean"), out["reconciled"]
    assert_spend(out, scene)
    assert_nothing_ran(out)


def assert_taken_over_shown(opened: dict[str, Any], scene: Scene) -> None:
    assert opened["state"] == "ready", opened
    assert opened["billing"]["takeovers"] == "1", opened["billing"]
    assert opened["billing"]["tenant"] == "acme"
    assert any("took over" in line for line in opened["workers"]), opened["workers"]
    assert "time to first token" in opened["timing"]
    assert opened["timeline"] > 20  # a mark per delta, and a gap bar
    assert opened["messages"] == [LONG]
    assert opened["output"] == [scene.client_text]
    assert "takeover" in opened["input"]  # its metadata


def assert_spend(out: dict[str, Any], scene: Scene) -> None:
    rows = list(csv.reader(io.StringIO(out["csv"]["text"])))
    assert rows[0] == SPEND_COLUMNS, rows[0]
    data = [dict(zip(rows[0], row, strict=True)) for row in rows[1:]]
    for tenant, ids in scene.ids.items():
        got = sum(int(r["requests"]) for r in data if r["tenant"] == tenant)
        assert got == len(ids), (tenant, data)
    assert {r["tenant"] for r in data} == set(scene.ids)
    assert all(int(r["total_tokens"]) > 0 for r in data)
    assert out["csv"]["name"].startswith("spend") and out["csv"]["name"].endswith(".csv")
    spend = out["spend"]
    assert len(spend["rows"]) == len(data), spend
    assert spend["bars"] >= len(data) and len(spend["legend"]) == len(data)


def test_a_tenant_sees_its_own_rows_only(node: Any, scene: Scene) -> None:
    out = browser(node, scene, "tenant", scene.acme, OTHER_ID=scene.hostile, OWN_ID=scene.taken)
    assert "tenant acme" in out["who"] and "user" in out["who"]
    assert set(out["first"]["ids"]) == set(scene.ids["acme"]), out["first"]
    assert not out["reconcileShown"]
    other = out["other"]
    assert other["state"] == "missing" and "No such request" in other["missing"], other
    assert other["body"] == "" and HOSTILE_USER not in str(other)
    assert out["own"]["state"] == "ready" and out["own"]["billing"]["tenant"] == "acme"
    assert_nothing_ran(out, expected=f"/v1/admin/requests/{scene.hostile})")
    # the API says the same: 404s, never a 403 that would tell the request exists
    with httpx.Client(base_url=scene.stack.url, headers=auth(scene.acme), timeout=30) as c:
        assert c.get(f"/v1/admin/requests/{scene.hostile}").status_code == 404
        assert c.get(f"/v1/admin/requests/{scene.hostile}/replay").status_code == 404
        listed = c.get("/v1/admin/requests", params={"tenant": "globex"}).json()["data"]
        assert {row["tenant"] for row in listed} <= {"acme"}, listed
        window = {"since": scene.since, "until": scene.until}
        assert c.get("/v1/admin/billing/reconcile", params=window).status_code == 403


def test_hostile_text_is_shown_as_text_and_never_runs(node: Any, scene: Scene) -> None:
    out = browser(
        node, scene, "hostile", scene.operator, METADATA="case=hostile", HOSTILE_ID=scene.hostile
    )
    assert_nothing_ran(out)
    [row] = [cells for cells in out["first"]["rows"] if cells[1] == scene.hostile]
    assert HOSTILE_USER in row and any(HOSTILE_METADATA["note"] in cell for cell in row), row
    assert out["byMetadata"]["ids"] == [scene.hostile]
    for shown in (out["opened"], out["reopened"]):
        assert shown["state"] == "ready", shown
        assert shown["messages"] == [HOSTILE]
        assert shown["output"] == [HOSTILE]
        assert HOSTILE_METADATA["note"] in shown["input"]
        assert "pwned('tool')" in shown["input"]
        assert HOSTILE_USER in shown["billing"]["end_user"]
    assert out["replayed"]["text"] == HOSTILE
