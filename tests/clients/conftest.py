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
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from service.ledger.api_keys import ApiKeys
from tests.clients.proxy import CuttingProxy, _pipe
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


@dataclasses.dataclass
class Exchange:
    """One connection through a RecordingProxy: the request line it opened with (``""``:
    it sent nothing), the first line the server answered (``""``: none came through),
    and whether the proxy cut it."""

    request: str = ""
    response: str = ""
    cut: bool = False
    budget: int | None = None  # the bytes the server side may send before the cut


class RecordingProxy(CuttingProxy):
    """A CuttingProxy that also records each connection's request line and status line
    (``exchanges``), so a test counts requests, not only connections, and sees what each
    one was answered. Connections whose request line starts with one of ``spared`` are
    not cut and are closed after their response (``Connection: close``: nothing else rides
    on them) -- a page's own files, which would not load if cut at 300 bytes. ``budgets``:
    the bytes after which the first connections are cut (then random ones)."""

    def __init__(
        self,
        target: tuple[str, int],
        *,
        spared: tuple[str, ...] = (),
        budgets: tuple[int, ...] = (),
        **kw: Any,
    ) -> None:
        super().__init__(target, **kw)
        self.spared = spared
        self.budgets = list(budgets)  # the first cut connections' budgets, then random ones
        self.exchanges: list[Exchange] = []

    @property
    def request_lines(self) -> list[str]:
        return [x.request for x in self.exchanges]

    @property
    def requests(self) -> list[str]:
        """The request lines of the connections that sent one."""
        return [x.request for x in self.exchanges if x.request]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        x = Exchange()
        self.exchanges.append(x)
        first = await reader.read(65536)
        x.request = first.split(b"\r\n", 1)[0].decode("latin-1")
        spared = x.request.startswith(self.spared)
        if spared:
            head, sep, rest = first.partition(b"\r\n\r\n")
            head = re.sub(rb"\r\nconnection:[^\r]*", b"", head, flags=re.I)
            first = head + b"\r\nConnection: close" + sep + rest
        budget = None
        if self.cutting and not spared:
            budget = self.budgets.pop(0) if self.budgets else None
            budget = budget or self._random.randint(self.min_bytes, self.max_bytes)
        x.budget = budget
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        up_writer.write(first)
        upload = asyncio.create_task(_pipe(reader, up_writer, None))
        x.cut = await _pipe(_FirstLine(up_reader, x), writer, budget)  # type: ignore[arg-type]
        if x.cut:
            self.cuts += 1
        upload.cancel()
        for w in (writer, up_writer):
            w.close()


class _FirstLine:
    """The server's side of a connection, noting its first line in the Exchange."""

    def __init__(self, reader: asyncio.StreamReader, x: Exchange) -> None:
        self._reader, self._x = reader, x

    async def read(self, n: int = -1) -> bytes:
        data = await self._reader.read(n)
        if not self._x.response and data:
            self._x.response = data.split(b"\r\n", 1)[0].decode("latin-1")
        return data


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
        pytest.fail("node is not installed (Node 20+ is needed for tests/clients)")
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
