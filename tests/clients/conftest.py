"""Shared fixtures for the client tests (make test-clients): real clients (Node, a browser,
Python) against a real stack through a CuttingProxy.

- ``clients_stack``: one stack for the session, API keys required (so a browser must use a
  stream token), the scripted engine at ~30 tokens/s (a ~300-token answer takes ~10 s, long
  enough for many cuts), CORS allowed for ``other_origin``.
- ``api_key``: a key of tenant ``webapp`` on that stack.
- ``proxy``: a fresh CuttingProxy in front of the API for each test (its counters are the
  test's own) that also records each connection's request line (``RecordingProxy``).
- ``node``: runs a Node script (cwd tests/clients, where ``npm ci`` put node_modules).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from service.ledger.api_keys import ApiKeys
from tests.clients.proxy import CuttingProxy
from tests.e2e.conftest import Stack, free_port, make_stack
from tests.e2e.helpers import LONG

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
QUESTION = LONG  # ~300 tokens, multi-byte characters and emoji: the scripted engine echoes it
TOKENS_PER_S = 30.0
RECONNECT_HINT_MS = 250  # the stack's `retry:`; a browser's EventSource waits this long


@pytest.hookimpl(tryfirst=True)  # before -m deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test in tests/clients is of the clients tier (make test-clients); the modules
    say so too (``pytestmark``)."""
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.clients)


@dataclasses.dataclass
class ClientStack(Stack):
    """A Stack whose processes get settings as environment variables (``extra``), so a
    setting can be used before ``Settings`` has a field for it."""

    extra: dict[str, object] = dataclasses.field(default_factory=dict)

    def _spawn(self, role: str, name: str, **overrides: object) -> subprocess.Popen[bytes]:
        return super()._spawn(role, name, **{**self.extra, **overrides})


@dataclasses.dataclass(frozen=True)
class Origin:
    """Another web origin (a static page server of a test binds ``port``)."""

    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="session")
def other_origin() -> Origin:
    return Origin(free_port())


@pytest.fixture(scope="session")
def clients_stack(
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    database_url: str,
    model_dir: Path,
    other_origin: Origin,
) -> Iterator[ClientStack]:
    base = make_stack(
        tmp_path_factory.mktemp("clients"),
        redis_url,
        database_url,
        model_dir,
        auth="required",
        scripted_tokens_per_s=TOKENS_PER_S,
    )
    st = ClientStack(
        settings=base.settings,
        logs=base.logs,
        extra={
            "cors_origins": f"{other_origin.url},http://localhost:{other_origin.port}",
            "reconnect_hint_ms": RECONNECT_HINT_MS,
        },
    )
    try:
        st.start_worker()
        st.start_api()
        yield st
    finally:
        st.stop()


def make_key(database_url: str, tenant: str) -> str:
    async def create() -> str:
        engine = create_async_engine(database_url)
        try:
            return await ApiKeys(engine).create(tenant)
        finally:
            await engine.dispose()

    return asyncio.run(create())


@pytest.fixture(scope="session")
def api_key(clients_stack: ClientStack, database_url: str) -> str:
    return make_key(database_url, "webapp")


def api_target(stack: Stack) -> tuple[str, int]:
    parts = urlsplit(stack.url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


class _FirstBytes:
    """A StreamReader that hands its first bytes to ``seen`` (CuttingProxy only reads)."""

    def __init__(self, reader: asyncio.StreamReader, seen: Callable[[bytes], None]) -> None:
        self._reader, self._seen = reader, seen
        self._first = True

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        if self._first:
            self._first = False
            self._seen(data)
        return data


class RecordingProxy(CuttingProxy):
    """A CuttingProxy that also records the request line each connection opened with
    (``b""``: a connection that sent nothing), so a test can count requests, not only
    connections."""

    def __init__(self, target: tuple[str, int], **kw: Any) -> None:
        super().__init__(target, **kw)
        self.request_lines: list[str] = []

    @property
    def requests(self) -> list[str]:
        """The request lines of the connections that sent one."""
        return [line for line in self.request_lines if line]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        def seen(data: bytes) -> None:
            self.request_lines.append(data.split(b"\r\n", 1)[0].decode("latin-1"))

        await super()._handle(_FirstBytes(reader, seen), writer)  # type: ignore[arg-type]


@pytest.fixture
def proxy(clients_stack: ClientStack) -> Iterator[RecordingProxy]:
    p = RecordingProxy(api_target(clients_stack), min_bytes=300, max_bytes=3000)
    p.start()
    try:
        yield p
    finally:
        p.close()


@dataclasses.dataclass
class NodeRun:
    returncode: int
    stdout: str
    stderr: str

    def result(self) -> dict[str, Any]:
        """The script's last stdout line, as JSON (the scripts print their result last)."""
        assert self.returncode == 0, f"node failed ({self.returncode}):\n{self.stderr[-4000:]}"
        lines = [line for line in self.stdout.splitlines() if line.strip()]
        assert lines, f"node printed nothing; stderr:\n{self.stderr[-4000:]}"
        out: dict[str, Any] = json.loads(lines[-1])
        return out


def _node_modules() -> None:
    if not (HERE / "node_modules").is_dir():
        pytest.fail("tests/clients/node_modules is missing: run `make test-clients`")


@pytest.fixture(scope="session")
def node() -> Any:
    """``node(script, *args, env={...}, timeout=...)`` -> NodeRun; the script's path is
    relative to tests/clients; ``env`` is added to this process's environment."""
    exe = shutil.which("node")
    if exe is None:
        pytest.fail("node is not installed (Node 18+ is needed for tests/clients)")
    _node_modules()

    def run(
        script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 180
    ) -> NodeRun:
        proc = subprocess.run(
            [exe, str(HERE / script), *args],
            cwd=HERE,
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return NodeRun(proc.returncode, proc.stdout, proc.stderr)

    return run
