"""Schemathesis over every operation of the API's own OpenAPI schema
(``/schema/openapi.json``), against a real stack (API + scripted worker, Redis,
Postgres, API keys required): no 5xx, and every answer as the schema documents it.

It runs as a user would run it -- ``schemathesis run`` (its own pytest plugin does not
load under this pytest) -- once per caller: a user's key, an operator's key, no key,
and a well-formed key that does not exist. Each run goes through schemathesis' phases:
coverage (boundary and near-miss values of every parameter and body field, positive
and negative), fuzzing (bounded examples per operation), stateful (chains through the
links it infers: create, then read, cancel, delete what was created). Deterministic
mode: the same cases every run, so a failure reproduces.

Reaching past the first check: half the generated bodies name the served model, and
half the path ids are requests the caller made just before (a stored chat completion,
a response, a text completion), so the streams, cancels, replays and deletes of real
requests are fuzzed too. Nothing is excluded: the answers stay short because the
stack's context is 256 tokens (a larger ``max_tokens`` is a 400), its engine produces
them at once, and a cancel waits at most a second.

Checks: all of schemathesis' but two, which judge the schema's completeness rather
than the server -- ``positive_data_acceptance`` (the server also checks what the
schema cannot say: the served model's name, the context length, stop strings, limits
of one parameter against another) and ``allow_header_conformance`` (``OPTIONS`` is
Litestar's own answer: at a path served by several handlers, its ``Allow`` names the
methods of only one of them).

One run takes 5-10 s (about 2,000 requests); the module, stack included, 25-45 s on
two busy CPUs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.settings import MODEL_NAME
from tests.e2e.conftest import Stack, running
from tests.e2e.test_auth import make_key
from tests.e2e.test_bad_input import MALFORMED, body_routes, check

EXAMPLES = 10  # fuzzed cases per operation (the coverage phase adds its own)
CHECKS = "all"
NOT_CHECKED = "positive_data_acceptance,allow_header_conformance"
# (a well-formed key, so that it is looked up, and refused)
UNKNOWN_KEY = "sk-le-000000000000-" + "0" * 32


@pytest.fixture(scope="module")
def fuzz_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("schema"),
        redis_url,
        database_url,
        model_dir,
        auth="required",
        scripted_tokens_per_s=0.0,
        worker_concurrency=64,
        default_max_tokens=4,
        max_model_len=256,
        cancel_wait_s=1.0,
    ) as st:
        yield st


@pytest.fixture(scope="module")
def callers(fuzz_stack: Stack, database_url: str) -> dict[str, str | None]:
    """The Authorization header of each caller (None: no header)."""
    return {
        "user": f"Bearer {make_key(database_url, 'fuzz')}",
        "operator": f"Bearer {make_key(database_url, 'fuzz-ops', role='operator')}",
        "no key": None,
        "unknown key": f"Bearer {UNKNOWN_KEY}",
    }


def made_requests(stack: Stack, authorization: str | None) -> list[str]:
    """Ids of requests the caller just made (none without a key that works)."""
    if authorization is None or UNKNOWN_KEY in authorization:
        return ["chatcmpl-" + "0" * 32]
    chat = {"messages": [{"role": "user", "content": "hi"}], "store": True}
    bodies = [
        ("/v1/chat/completions", {**chat, "metadata": {"k": "v"}}),
        ("/v1/responses", {"input": "hi", "store": True}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ]
    ids = []
    with httpx.Client(base_url=stack.url, headers={"Authorization": authorization}) as c:
        for path, body in bodies:
            resp = c.post(path, json={"model": MODEL_NAME, **body}, timeout=30)
            assert resp.status_code == 200, resp.text
            ids.append(resp.json()["id"])
    return ids


# Values schemathesis draws half the time for these parameters (the rest it makes up):
# what the schema cannot say is valid, and the edges of what is
EDGES: dict[str, list[str]] = {
    # instants: ISO 8601 or unix seconds; an offset can carry one out of the calendar
    "instants": [
        "0001-01-01T00:00:00+23:59",
        "9999-12-31T23:59:59-23:59",
        "0001-01-01T00:00:00Z",
        "1970-01-01",
        "2026-01-01T00:00:00+01:00",
        "-1",
        "0",
        "1e11",
    ],
    # event ids: <ms>-<seq>[:<frame>]
    "cursors": ["0-0", "1-0:3", "18446744073709551615-18446744073709551615", "1-1:-1"],
    "speeds": ["max", "1", "0.01", "1000"],
    "formats": ["sse", "text", "json", "csv"],
}
BINDINGS = {
    "body.model": "models",
    "path.model_id": "models",
    "path.request_id": "ids",
    "path.completion_id": "ids",
    "path.response_id": "ids",
    "query.since": "instants",
    "query.until": "instants",
    "query.after": "cursors",
    "query.speed": "speeds",
    "query.format": "formats",
}


def config(ids: list[str]) -> str:
    """schemathesis.toml: bounded, deterministic, and half the time the served model,
    the caller's own requests, and the edges above."""
    values = {**EDGES, "models": [MODEL_NAME], "ids": ids}
    dictionaries = "\n".join(f"{k} = {{ values = {json.dumps(v)} }}" for k, v in values.items())
    bindings = "\n".join(
        f'"{k}" = {{ dictionary = "{v}", probability = 0.5 }}' for k, v in BINDINGS.items()
    )
    return f"""
# (one: hypothesis describes a filter with ast.parse, which CPython 3.11 cannot run in two
# threads at once -- "AST constructor recursion depth mismatch")
workers = 1
request-timeout = 30
max-stream-events = 500

[cache]
enabled = false  # (its crash cache would replay old failures first: not repeatable)

[generation]
deterministic = true
max-examples = {EXAMPLES}
database = "none"

[dictionaries]
{dictionaries}

[parameters]
{bindings}
"""


def operations_of(schema: dict[str, Any]) -> int:
    methods = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
    return sum(len(set(item) & methods) for item in schema["paths"].values())


# (caller, phases, fuzzed cases per operation): without a working key every route but the
# probes answers 401 whatever else is sent -- no chains to follow, fewer cases
RUNS = [
    ("user", "coverage,fuzzing,stateful", EXAMPLES),
    ("operator", "coverage,fuzzing,stateful", EXAMPLES),
    ("no key", "coverage,fuzzing", EXAMPLES // 2),
    ("unknown key", "coverage,fuzzing", EXAMPLES // 2),
]


@pytest.mark.parametrize(("caller", "phases", "examples"), RUNS, ids=[r[0] for r in RUNS])
def test_every_operation_answers_as_documented(
    fuzz_stack: Stack,
    callers: dict[str, str | None],
    tmp_path: Path,
    caller: str,
    phases: str,
    examples: int,
) -> None:
    authorization = callers[caller]
    settings = tmp_path / "schemathesis.toml"
    settings.write_text(config(made_requests(fuzz_stack, authorization)))
    spec = f"{fuzz_stack.url}/schema/openapi.json"
    command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(settings)]
    command += ["--no-color", "run", spec, "--phases", phases, "--max-examples", str(examples)]
    command += ["--checks", CHECKS, "--exclude-checks", NOT_CHECKED]
    if authorization is not None:
        command += ["--header", f"Authorization: {authorization}"]
    started = time.monotonic()
    run = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=110, check=False
    )
    took = time.monotonic() - started
    assert run.returncode == 0, f"{caller}: {took:.1f} s\n{run.stdout[-20_000:]}{run.stderr}"
    # every operation of the schema, none skipped
    operations = operations_of(httpx.get(spec).json())
    tested = re.search(r"Selected: (\d+)/(\d+)\s+Tested: (\d+)", run.stdout)
    assert tested is not None, run.stdout[-3000:]
    assert tested.groups() == (str(operations),) * 3, run.stdout[-3000:]


def test_malformed_bodies_without_a_working_key(
    fuzz_stack: Stack, callers: dict[str, str | None]
) -> None:
    """100,000 ``[`` POSTed to ``/v1/chat/completions/{id}`` was a 500 without any key: a
    body that is not JSON is a 4xx whoever sends it (a 400: it is read before the key
    is checked; it says nothing of the server), a well-formed one a 401."""
    with httpx.Client(base_url=fuzz_stack.url, timeout=30) as c:
        routes = body_routes(c)
        for caller in ("no key", "unknown key"):
            authorization = callers[caller]
            headers = {"content-type": "application/json"}
            if authorization is not None:
                headers["authorization"] = authorization
            for path in routes:
                for raw in MALFORMED:
                    resp = c.post(path, content=raw, headers=headers)
                    check(resp)
                    assert resp.status_code in (400, 401), (caller, path, raw[:20], resp.text)
                assert c.post(path, content=b"{}", headers=headers).status_code == 401
