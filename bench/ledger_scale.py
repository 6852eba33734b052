"""The console's request list and the stored-completions list at 1,000,000 ledger rows:
each filter alone and a few combined, first pages and deep pages, timed through HTTP and
straight in SQL; figures for the docs, printed, not asserted (target: p99 under 100 ms).

A fresh database (random name, dropped at the end) is migrated to head (Alembic), then
``--rows`` requests rows are made by Postgres itself (one ``INSERT ... SELECT ... FROM
generate_series``, the secondary indexes dropped for the load and built again after it)
with a spread like a real ledger's: 20 tenants, the largest with ~30% of the rows and the
smallest with ~1%; 50 API keys (2 or 3 per tenant); ~5,000 end users (250 per tenant,
skewed; 15% of rows name none); 4 models (50 / 25 / 15 / 10%); 90% finished, 4%
cancelled, 3% errored (with an error code), 3% abandoned; finish reasons; chat / text /
response ids; ``metadata`` on 30% of rows (``env``, ``feature``, ``session``, and
``customer`` on a third of those); 30% of chat requests ``stored``; ``ended_at`` spread
over the last 30 days; 0.5% taken over, 0.3% handed over. Then ANALYZE.

One API process (``lastevent api``, API keys required, no worker: nothing here runs a
model) serves it. Timed sequentially on one keep-alive connection, after 3 warm-up
requests each: ``GET /v1/admin/requests`` with an operator key, each filter alone and
combined, and with a tenant key (its tenant forced: the largest and the smallest
tenant), the first page ``--repeat`` times and ``--pages`` pages deep through
``next_cursor``; ``GET /v1/chat/completions`` (the tenant's stored list) with ``model`` and
``metadata`` filters, paged with ``after``. The same queries run straight in SQL (the
statements ``service/ledger/audit.py`` sends, written out here), and ``EXPLAIN ANALYZE``
says which plan each took: the database part of each HTTP figure.

    make bench-ledger                       # = .venv/bin/python -m bench.ledger_scale
    .venv/bin/python -m bench.ledger_scale --rows 200000 --repeat 20 --pages 20

Needs Postgres (``LASTEVENT_TEST_PG_URL``, else the local server on 5432) and Redis
(``LASTEVENT_REDIS_URL``, else the local one on 6379: the API process needs one to
start). Writes ``ledger_scale.md`` and ``ledger_scale.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, create_async_engine

from service.ledger.api_keys import ApiKeys
from service.settings import MODEL_NAME
from tests.conftest import migrated_database
from tests.e2e.conftest import Stack, make_stack

REPO = Path(__file__).resolve().parents[1]
MODELS = ("SmolLM2-135M-Instruct", "llama-3.1-8b-instruct", "qwen2.5-7b-instruct", "mistral-7b")
TENANTS = 20
SLOW_MS = 100.0  # the target: a query whose p99 is above it gets its plan printed

# Postgres makes the rows: every random draw of a row in ``draw``, its columns from them
LOAD = """
INSERT INTO requests (id, tenant, api_key_id, kind, model, created_at, dispatched_at,
  first_token_at, ended_at, state, finish_reason, prompt_tokens, completion_tokens,
  total_tokens, wasted_tokens, takeovers, handovers, reprefill_tokens, error_code, end_user,
  worker_id, last_event_id, recorded_ms, metadata, stored)
WITH draw AS (
  SELECT g, least(19, floor(20 * power(random(), 2.5)))::int AS t,
    random() AS r_key, random() AS r_user, random() AS r_model, random() AS r_state,
    random() AS r_sub, random() AS r_kind, random() AS r_meta, random() AS r_m1,
    random() AS r_m2, random() AS r_store, random() AS r_rec, random() AS r_dur,
    CAST(:now AS timestamptz) - random() * interval '30 days' AS ended,
    (20 + power(random(), 2) * 2000)::int AS prompt, (1 + random() * 600)::int AS completion
  FROM generate_series(1, :rows) AS g
), shaped AS (
  SELECT d.*,
    CASE WHEN r_state < 0.90 THEN 'finished' WHEN r_state < 0.94 THEN 'cancelled'
         WHEN r_state < 0.97 THEN 'errored' ELSE 'abandoned' END AS state,
    CASE WHEN r_kind < 0.8 THEN 'chat' WHEN r_kind < 0.9 THEN 'text' ELSE 'response' END AS kind,
    t + 20 * floor(r_key * CASE WHEN t < 10 THEN 3 ELSE 2 END)::int AS key_no,
    ended - (0.5 + r_dur * 30) * interval '1 second' AS created
  FROM draw d
)
SELECT
  CASE kind WHEN 'chat' THEN 'chatcmpl-' WHEN 'text' THEN 'cmpl-' ELSE 'resp_' END
    || md5('row' || g),
  'tenant-' || lpad(t::text, 2, '0'),
  substr(md5('key' || key_no), 1, 12),
  kind,
  (CAST(:models AS text[]))[CASE WHEN r_model < 0.5 THEN 1 WHEN r_model < 0.75 THEN 2
                              WHEN r_model < 0.9 THEN 3 ELSE 4 END],
  created, created + interval '20 ms',
  CASE WHEN state = 'errored' AND r_sub < 0.3 THEN NULL
       ELSE created + (0.05 + r_sub * 0.4) * interval '1 second' END,
  ended, state,
  CASE WHEN state = 'finished' THEN
         CASE WHEN r_sub < 0.8 THEN 'stop' WHEN r_sub < 0.95 THEN 'length' ELSE 'tool_calls' END
       WHEN state = 'errored' THEN NULL ELSE state END,
  prompt, completion, prompt + completion,
  CASE WHEN state IN ('cancelled', 'abandoned') THEN (r_sub * 50)::int ELSE 0 END,
  (r_rec < 0.005)::int, (r_rec >= 0.005 AND r_rec < 0.008)::int,
  CASE WHEN r_rec < 0.008 THEN prompt + completion / 2 ELSE 0 END,
  CASE WHEN state = 'errored' THEN
         CASE WHEN r_sub < 0.4 THEN 'deadline' WHEN r_sub < 0.7 THEN 'engine_aborted'
              WHEN r_sub < 0.9 THEN 'internal_error' ELSE 'log_lost' END END,
  CASE WHEN r_m2 < 0.15 THEN NULL
       ELSE 'user-' || lpad((t * 250 + floor(power(r_user, 2) * 250))::text, 4, '0') END,
  'worker-' || (g % 8),
  (extract(epoch FROM ended) * 1000)::bigint || '-0',
  (extract(epoch FROM ended) * 1000)::bigint + 150,
  CASE WHEN r_meta < 0.3 THEN jsonb_build_object(
         'env', CASE WHEN r_m1 < 0.7 THEN 'prod' WHEN r_m1 < 0.9 THEN 'staging' ELSE 'dev' END,
         'feature', 'feature-' || lpad(floor(20 * power(r_m2, 2))::text, 2, '0'),
         'session', 'sess-' || substr(md5('sess' || g), 1, 16))
       || CASE WHEN r_meta < 0.1 THEN jsonb_build_object(
            'customer', 'cust-' || floor(r_m1 * 1000)::int) ELSE '{}'::jsonb END END,
  kind = 'chat' AND r_store < 0.3
FROM shaped
"""


async def load(url: str, rows: int) -> dict[str, float]:
    """Fill ``requests``; the seconds each step took."""
    engine = create_async_engine(url)
    took: dict[str, float] = {}
    try:
        async with engine.begin() as conn:
            await conn.execute(text("SET LOCAL maintenance_work_mem = '256MB'"))
            indexes = (
                await conn.execute(
                    text(
                        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'requests'"
                        " AND indexname NOT IN (SELECT conname FROM pg_constraint)"
                    )
                )
            ).all()
            for name, _ in indexes:
                await conn.execute(text(f'DROP INDEX "{name}"'))
            started = time.monotonic()
            await conn.execute(
                text(LOAD), {"rows": rows, "now": dt.datetime.now(dt.UTC), "models": list(MODELS)}
            )
            took["insert"] = time.monotonic() - started
            started = time.monotonic()
            for _, definition in indexes:
                await conn.execute(text(definition))
            took["indexes"] = time.monotonic() - started
        async with engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            started = time.monotonic()
            await conn.execute(text("VACUUM ANALYZE requests"))
            took["analyze"] = time.monotonic() - started
    finally:
        await engine.dispose()
    return took


ARCHIVE_COPY = """
INSERT INTO archives (request_id, tenant, ended_at, events, raw_bytes, data)
SELECT r.id, r.tenant, r.ended_at, a.events, a.raw_bytes, a.data
FROM requests r CROSS JOIN (SELECT * FROM archives WHERE request_id = :template) a
WHERE r.stored AND r.id <> :template
ON CONFLICT DO NOTHING
"""


async def copy_archives(url: str, template: str) -> float:
    """Every stored row gets the template's archive (its input and answer): the list
    renders each item from one. Seconds taken."""
    engine = create_async_engine(url)
    try:
        started = time.monotonic()
        async with engine.begin() as conn:
            await conn.execute(text(ARCHIVE_COPY), {"template": template})
        async with engine.connect() as conn:
            await conn.execution_options(isolation_level="AUTOCOMMIT")
            await conn.execute(text("VACUUM ANALYZE archives"))
        return time.monotonic() - started
    finally:
        await engine.dispose()


async def server(url: str) -> str:
    """Postgres's version and the settings that bound a cold read."""
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            version = (await conn.execute(text("SHOW server_version"))).scalar_one()
            buffers = (await conn.execute(text("SHOW shared_buffers"))).scalar_one()
            work_mem = (await conn.execute(text("SHOW work_mem"))).scalar_one()
    finally:
        await engine.dispose()
    return f"PostgreSQL {version.split()[0]}, shared_buffers {buffers}, work_mem {work_mem}"


# ------------------------------------------------------------------------------ cases


@dataclasses.dataclass(frozen=True)
class Case:
    """One query: its route (``admin``: the console's list, ``stored``: the stored
    completions), its query string, whose key asks (``operator`` or a tenant), and how many
    pages are walked (1: the first page, ``--repeat`` times)."""

    name: str
    params: dict[str, str]
    who: str = "operator"
    route: str = "admin"
    pages: int = 1


def key_id(n: int) -> str:
    """The id of the loader's API key number ``n`` (its tenant is ``n % 20``)."""
    return hashlib.md5(f"key{n}".encode()).hexdigest()[:12]


def cases(now: dt.datetime, pages: int, picks: dict[str, str]) -> list[Case]:
    day_ago = (now - dt.timedelta(days=1)).isoformat()
    hour = now - dt.timedelta(days=10)
    window = {"since": hour.isoformat(), "until": (hour + dt.timedelta(hours=1)).isoformat()}
    big, small = "tenant-00", "tenant-19"
    admin = [
        Case("no filter", {}),
        Case("tenant (largest, ~30%)", {"tenant": big}),
        Case("tenant (smallest, ~2%)", {"tenant": small}),
        Case("api_key (~10%)", {"api_key": key_id(0)}),
        Case("api_key (~1%)", {"api_key": key_id(19)}),
        Case("user", {"user": "user-0100"}),
        Case("model (10%)", {"model": MODELS[3]}),
        Case("state=errored (3%)", {"state": "errored"}),
        Case("error_code=log_lost (0.3%)", {"error_code": "log_lost"}),
        Case("finish_reason=tool_calls", {"finish_reason": "tool_calls"}),
        Case("kind=response", {"kind": "response"}),
        Case("metadata env=prod (~21%)", {"metadata[env]": "prod"}),
        Case("metadata feature (~1%)", {"metadata[feature]": "feature-07"}),
        Case("metadata customer (~0.01%)", {"metadata[customer]": "cust-7"}),
        Case("metadata session (1 row)", {"metadata[session]": picks["session"]}),
        Case("since..until (1 h)", window),
        Case("since (last 24 h)", {"since": day_ago}),
        Case("tenant + model + state", {"tenant": big, "model": MODELS[1], "state": "finished"}),
        Case("tenant (small) + state=errored", {"tenant": small, "state": "errored"}),
        Case("tenant (small) + error_code", {"tenant": small, "error_code": "log_lost"}),
        Case("api_key (small) + model", {"api_key": key_id(19), "model": MODELS[3]}),
        Case("user + state=errored", {"user": "user-0100", "state": "errored"}),
        Case(
            "model + finish_reason + 1 h", {"model": MODELS[2], "finish_reason": "length", **window}
        ),
        Case(
            "tenant + metadata feature + 24 h",
            {"tenant": "tenant-03", "metadata[feature]": "feature-01", "since": day_ago},
        ),
    ]
    tenant_keys = [
        Case(name, params, who=who)
        for who in (big, small)
        for name, params in (
            ("no filter", {}),
            ("model", {"model": MODELS[3]}),
            ("state=errored", {"state": "errored"}),
            ("metadata env=staging", {"metadata[env]": "staging"}),
            ("since..until (1 h)", window),
        )
    ]
    deep = [
        Case(f"{pages} pages: no filter", {}, pages=pages),
        Case(f"{pages} pages: model", {"model": MODELS[3]}, pages=pages),
        Case(f"{pages} pages: state=errored", {"state": "errored"}, pages=pages),
        Case(f"{pages} pages: metadata feature", {"metadata[feature]": "feature-07"}, pages=pages),
        Case(f"{pages} pages: no filter", {}, who=big, pages=pages),
        Case(f"{pages} pages: model", {"model": MODELS[3]}, who=small, pages=pages),
    ]
    stored = [
        Case(name, params, who=who, route="stored", pages=n)
        for who in (big, small)
        for name, params, n in (
            ("no filter", {}, 1),
            ("order=desc, limit=100", {"order": "desc", "limit": "100"}, 1),
            ("model", {"model": MODELS[3]}, 1),
            ("metadata feature", {"metadata[feature]": "feature-07"}, 1),
            ("model + metadata env", {"model": MODELS[1], "metadata[env]": "staging"}, 1),
            ("after an id ~90% in", {"after": picks[f"late {who}"]}, 1),
            (f"{pages} pages (after)", {}, pages),
            (f"{pages} pages (after), order=desc", {"order": "desc"}, pages),
        )
    ]
    return admin + tenant_keys + deep + stored


async def pick(url: str) -> dict[str, str]:
    """Values the cases ask for that only the loaded rows know: one row's ``session``, and
    per tenant of the cases a stored completion about 90% of the way through its list."""
    engine = create_async_engine(url)
    out: dict[str, str] = {}
    try:
        async with engine.connect() as conn:
            out["session"] = (
                await conn.execute(
                    text(
                        "SELECT metadata->>'session' FROM requests WHERE metadata ? 'session'"
                        " ORDER BY id LIMIT 1"
                    )
                )
            ).scalar_one()
            for tenant in ("tenant-00", "tenant-19"):
                late = (
                    "SELECT id FROM requests WHERE tenant = :t AND stored"
                    " ORDER BY created_at, id OFFSET"
                    " (SELECT count(*) * 9 / 10 FROM requests WHERE tenant = :t AND stored)"
                    " LIMIT 1"
                )
                out[f"late {tenant}"] = (await conn.execute(text(late), {"t": tenant})).scalar_one()
    finally:
        await engine.dispose()
    return out


# --------------------------------------------------------------------------- the SQL


ADMIN_COLUMNS = {
    "tenant": "tenant",
    "api_key": "api_key_id",
    "user": "end_user",
    "model": "model",
    "state": "state",
    "error_code": "error_code",
    "finish_reason": "finish_reason",
    "kind": "kind",
}


def _metadata(params: dict[str, str]) -> dict[str, str]:
    return {k[len("metadata[") : -1]: v for k, v in params.items() if k.startswith("metadata[")}


@dataclasses.dataclass
class Statement:
    sql: str
    binds: dict[str, Any]


def admin_sql(case: Case, after: tuple[dt.datetime, str] | None, limit: int = 50) -> Statement:
    """``Audit.requests``: equality per filter, ``metadata @>``, ``ended_at`` in [since,
    until), the keyset ``(ended_at, id) < cursor``, newest first, one row more than shown."""
    params = dict(case.params)
    if case.who != "operator":
        params["tenant"] = case.who  # a tenant key's tenant is forced
    where: list[str] = ["true"]
    binds: dict[str, Any] = {}
    for name, column in ADMIN_COLUMNS.items():
        if name in params:
            where.append(f"{column} = :{name}")
            binds[name] = params[name]
    if meta := _metadata(params):
        where.append("metadata @> CAST(:meta AS jsonb)")
        binds["meta"] = json.dumps(meta)
    for name, op in (("since", ">="), ("until", "<")):
        if name in params:
            where.append(f"ended_at {op} :{name}")
            binds[name] = dt.datetime.fromisoformat(params[name])
    if after is not None:
        where.append("(ended_at, id) < (:after_at, :after_id)")
        binds.update(after_at=after[0], after_id=after[1])
    sql = (
        f"SELECT * FROM requests WHERE {' AND '.join(where)}"
        f" ORDER BY ended_at DESC, id DESC LIMIT {limit + 1}"
    )
    return Statement(sql, binds)


def stored_sql(case: Case, after: tuple[dt.datetime, str] | None) -> Statement:
    """``Audit.stored``: the tenant's ``stored`` rows by ``created_at`` (then id), the
    ``after`` anchor's position as a row comparison ``(created_at, id) > (t, id)``."""
    desc = case.params.get("order") == "desc"
    where = ["tenant = :tenant", "stored"]
    binds: dict[str, Any] = {"tenant": case.who}
    if "model" in case.params:
        where.append("model = :model")
        binds["model"] = case.params["model"]
    if meta := _metadata(case.params):
        where.append("metadata @> CAST(:meta AS jsonb)")
        binds["meta"] = json.dumps(meta)
    if after is not None:
        op = "<" if desc else ">"
        where.append(f"(created_at, id) {op} (:after_at, :after_id)")
        binds.update(after_at=after[0], after_id=after[1])
    way = "DESC" if desc else "ASC"
    limit = int(case.params.get("limit", "20"))
    sql = (
        f"SELECT * FROM requests WHERE {' AND '.join(where)}"
        f" ORDER BY created_at {way}, id {way} LIMIT {limit + 1}"
    )
    return Statement(sql, binds)


ANCHOR = "SELECT * FROM requests WHERE id = :id AND tenant = :tenant AND stored"


def plan_summary(plan: dict[str, Any]) -> str:
    """The nodes from the top down to the first scan: ``Limit > Index Scan Backward
    (ix_...)``; a bitmap scan names its index scans."""
    parts, node = [], plan
    while True:
        name = node["Node Type"]
        if node.get("Scan Direction") == "Backward":
            name += " Backward"
        if "Index Name" in node:
            name += f" ({node['Index Name']})"
        if name.startswith("Bitmap Heap Scan"):
            inner = [n.get("Index Name", n["Node Type"]) for n in _leaves(node)]
            name += f" ({' + '.join(inner)})"
        if node.get("Rows Removed by Filter"):
            name += f" [{node['Rows Removed by Filter']} removed by filter]"
        parts.append(name)
        children = node.get("Plans") or []
        if "Scan" in node["Node Type"] or not children:
            return " > ".join(parts)
        node = children[0]


def _leaves(node: dict[str, Any]) -> list[dict[str, Any]]:
    children = node.get("Plans") or []
    return [leaf for c in children for leaf in _leaves(c)] if children else [node]


# ---------------------------------------------------------------------------- timing


@dataclasses.dataclass
class Figure:
    case: Case
    http_ms: list[float] = dataclasses.field(default_factory=list)
    sql_ms: list[float] = dataclasses.field(default_factory=list)
    shown: int = 0  # rows on the first page
    matching: int = 0  # rows the filters match
    plan: str = ""  # the first page's (the deepest page's when pages are walked)
    explain_ms: float = 0.0  # EXPLAIN ANALYZE's execution time of that page


def pct(values: list[float], q: float) -> float:
    """The ``q`` quantile, interpolated between the closest ranks."""
    ordered = sorted(values)
    at = (len(ordered) - 1) * q
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def time_http(client: httpx.Client, case: Case, key: str, repeat: int, fig: Figure) -> None:
    path = "/v1/admin/requests" if case.route == "admin" else "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {key}"}

    def get(params: dict[str, str]) -> dict[str, Any]:
        started = time.perf_counter()
        r = client.get(path, params=params, headers=headers)
        elapsed = (time.perf_counter() - started) * 1000
        if r.status_code != 200:
            raise RuntimeError(f"{case.name}: HTTP {r.status_code} {r.text[:300]}")
        fig.http_ms.append(elapsed)
        body: dict[str, Any] = r.json()
        return body

    for _ in range(3):
        fig.shown = len(get(case.params)["data"])
    fig.http_ms.clear()
    if case.pages == 1:
        for _ in range(repeat):
            get(case.params)
        return
    params = dict(case.params)
    for _ in range(case.pages):
        page = get(params)
        if case.route == "admin" and page["next_cursor"]:
            params["cursor"] = page["next_cursor"]
        elif case.route == "stored" and page["has_more"]:
            params["after"] = page["last_id"]
        else:
            break


async def _page(
    conn: AsyncConnection, case: Case, after: tuple[dt.datetime, str] | None
) -> tuple[list[Any], Statement]:
    if case.route == "admin":
        st = admin_sql(case, after)
    else:
        anchor_id = after[1] if after is not None else case.params.get("after")
        if anchor_id is not None:  # the API looks the ``after`` id up first
            binds = {"id": anchor_id, "tenant": case.who}
            row = (await conn.execute(text(ANCHOR), binds)).one()
            after = (row.created_at, row.id)
        st = stored_sql(case, after)
    return list((await conn.execute(text(st.sql), st.binds)).all()), st


def _page_size(case: Case) -> int:
    return 50 if case.route == "admin" else int(case.params.get("limit", "20"))


def _next(case: Case, rows: list[Any]) -> tuple[dt.datetime, str] | None:
    """Where the next page starts (the last row shown), ``None`` on the last page."""
    limit = _page_size(case)
    if len(rows) <= limit:
        return None
    last = rows[limit - 1]
    return (last.ended_at if case.route == "admin" else last.created_at), last.id


async def time_sql(conn: AsyncConnection, case: Case, repeat: int, fig: Figure) -> None:
    """The same pages straight from Postgres, then EXPLAIN ANALYZE of the first (or the
    deepest) page and the count of the rows the filters match."""
    for _ in range(3):
        rows, st = await _page(conn, case, None)
    after: tuple[dt.datetime, str] | None = None
    for _ in range(repeat if case.pages == 1 else case.pages):
        started = time.perf_counter()
        rows, st = await _page(conn, case, after)
        fig.sql_ms.append((time.perf_counter() - started) * 1000)
        if case.pages > 1 and (after := _next(case, rows)) is None:
            break
    explain = "EXPLAIN (ANALYZE, FORMAT JSON) " + st.sql
    doc = (await conn.execute(text(explain), st.binds)).scalar_one()
    doc = json.loads(doc) if isinstance(doc, str) else doc
    fig.plan = plan_summary(doc[0]["Plan"])
    fig.explain_ms = float(doc[0]["Execution Time"])
    whole = admin_sql(case, None) if case.route == "admin" else stored_sql(case, None)
    count = whole.sql.split(" ORDER BY ")[0].replace("SELECT *", "SELECT count(*)", 1)
    fig.matching = (await conn.execute(text(count), whole.binds)).scalar_one()


# ----------------------------------------------------------------------------- stack


async def make_keys(url: str) -> dict[str, str]:
    """An operator key, and a key of the largest and of the smallest tenant."""
    engine = create_async_engine(url)
    try:
        keys = ApiKeys(engine)
        out = {"operator": await keys.create("operators", role="operator")}
        for tenant in ("tenant-00", "tenant-19"):
            out[tenant] = await keys.create(tenant)
        return out
    finally:
        await engine.dispose()


TEMPLATE = {
    "messages": [
        {"role": "system", "content": "You are a support assistant for an online bookshop."},
        {
            "role": "user",
            "content": "My order #48213 arrived with a torn cover. Can I get a "
            "replacement, and do I need to send the damaged copy back first?",
        },
    ],
    "store": True,
    "metadata": {"env": "prod", "feature": "feature-01", "session": "sess-template"},
    "max_tokens": 60,
    "temperature": 0.7,
}


async def _archived(url: str, request_id: str, timeout_s: float = 60) -> None:
    engine = create_async_engine(url)
    try:
        deadline = time.monotonic() + timeout_s
        query = text("SELECT 1 FROM archives WHERE request_id = :id")
        while time.monotonic() < deadline:
            async with engine.connect() as conn:
                if (await conn.execute(query, {"id": request_id})).first():
                    return
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{request_id} was not archived within {timeout_s:g} s")
    finally:
        await engine.dispose()


def template_request(st: Stack, key: str, db: str) -> str:
    """One real stored chat completion (the scripted engine's answer), archived: every
    loaded stored row gets a copy of its archive. Its id."""
    r = httpx.post(
        st.url + "/v1/chat/completions",
        json={"model": st.model, **TEMPLATE},
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    if r.status_code != 200:
        raise RuntimeError(f"the template request: HTTP {r.status_code} {r.text[:300]}")
    request_id: str = r.json()["id"]
    asyncio.run(_archived(db, request_id))
    return request_id


async def measure_sql(url: str, figs: list[Figure], repeat: int) -> None:
    engine = create_async_engine(url)
    try:
        async with engine.connect() as conn:
            for f in figs:
                await time_sql(conn, f.case, repeat, f)
    finally:
        await engine.dispose()


def measure(
    st: Stack, db: str, keys: dict[str, str], todo: list[Case], repeat: int
) -> list[Figure]:
    figs = [Figure(c) for c in todo]
    with httpx.Client(base_url=st.url, timeout=120) as client:
        for f in figs:
            time_http(client, f.case, keys[f.case.who], repeat, f)
            print(
                f"  {_route(f.case)} {f.case.who} {f.case.name}: "
                f"HTTP p50 {pct(f.http_ms, 0.5):.1f} ms",
                file=sys.stderr,
                flush=True,
            )
    asyncio.run(measure_sql(db, figs, repeat))
    return figs


# ---------------------------------------------------------------------------- report


def _route(case: Case) -> str:
    return "GET /v1/admin/requests" if case.route == "admin" else "GET /v1/chat/completions"


def table(figs: list[Figure]) -> str:
    """One table per route; a p99 over the target in bold."""
    head = (
        "| query | key | n | HTTP p50 / p99 / max (ms) | SQL p50 / p99 (ms)"
        " | rows shown / matching | plan (EXPLAIN ANALYZE ms) |"
    )
    out = []
    for route in ("admin", "stored"):
        out += [f"`{_route(Case('', {}, route=route))}`", "", head, "|" + "---|" * 7]
        for f in (f for f in figs if f.case.route == route):
            c, h, s = f.case, f.http_ms, f.sql_ms
            http = f"{pct(h, 0.5):.1f} / {pct(h, 0.99):.1f} / {max(h):.1f}"
            if pct(h, 0.99) > SLOW_MS:
                http = f"**{http}**"
            out.append(
                f"| {c.name} | {c.who} | {len(h)} | {http}"
                f" | {pct(s, 0.5):.1f} / {pct(s, 0.99):.1f} | {f.shown} / {f.matching:,}"
                f" | {f.plan} ({f.explain_ms:.1f}) |"
            )
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=50, help="timed first pages per query")
    parser.add_argument("--pages", type=int, default=50, help="pages walked by the deep cases")
    parser.add_argument("--model-dir", type=Path, default=REPO / ".cache/models" / MODEL_NAME)
    parser.add_argument("--out", type=Path, default=REPO / "bench-results")
    args = parser.parse_args()
    from service.cli.model import prepare_model

    args.model_dir = prepare_model(args.model_dir)
    args.out.mkdir(parents=True, exist_ok=True)
    started, load_avg = time.monotonic(), os.getloadavg()[0]
    pg = os.environ.get(
        "LASTEVENT_TEST_PG_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
    )
    redis_url = os.environ.get("LASTEVENT_REDIS_URL", "redis://127.0.0.1:6379/0")
    with migrated_database(pg) as db:
        st = make_stack(
            args.out / "logs" / "ledger_scale", redis_url, db, args.model_dir, auth="required"
        )
        try:
            worker = st.start_worker()
            st.start_api()
            keys = asyncio.run(make_keys(db))
            template = template_request(st, keys["tenant-00"], db)
            worker.terminate()
            worker.wait()
            print(f"loading {args.rows:,} rows ...", file=sys.stderr, flush=True)
            took = asyncio.run(load(db, args.rows))
            took["archives"] = asyncio.run(copy_archives(db, template))
            picks = asyncio.run(pick(db))
            postgres = asyncio.run(server(db))
            now = dt.datetime.now(dt.UTC)
            figs = measure(st, db, keys, cases(now, args.pages, picks), args.repeat)
        finally:
            st.stop()
    loaded = ", ".join(f"{k} {v:.0f} s" for k, v in took.items())
    heading = (
        f"{args.rows:,} rows in `requests` ({loaded}); {postgres}; "
        "1 API process, API keys required; "
        f"{os.cpu_count()} CPUs, load average {load_avg:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end. Command: "
        f"`python -m bench.ledger_scale {' '.join(sys.argv[1:])}`".rstrip()
    )
    md = heading + "\n\n" + table(figs) + "\n"
    (args.out / "ledger_scale.md").write_text(md)
    raw = [{**dataclasses.asdict(f), "case": dataclasses.asdict(f.case)} for f in figs]
    (args.out / "ledger_scale.json").write_text(json.dumps(raw, indent=1))
    print("\n" + md)
    print(f"wrote {args.out / 'ledger_scale.md'}; took {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
