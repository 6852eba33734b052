"""Shared fixtures: the prepared model, real Redis and Postgres (or embedded ones).

Servers: ``LASTEVENT_TEST_REDIS_URL`` / ``LASTEVENT_TEST_PG_URL`` when set; else
the local servers on 127.0.0.1:6379 / :5432 when they answer; else embedded
Valkey / Postgres started for the session. ``LASTEVENT_TEST_REDIS_CLUSTER=1``
(``make test-cluster``): a Redis Cluster of the session's own instead (three primaries,
three replicas: ``tests/cluster.py``), and the stacks the e2e tests start use it with
``LASTEVENT_REDIS_CLUSTER`` and six partitions. Isolation: every test gets a random
Redis key prefix; every session (each xdist worker) gets a fresh database.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.cli.embedded import answers
from service.tokenize import ModelInfo

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from service.cli.model import prepare_model

    path = Path(
        os.environ.get("LASTEVENT_TEST_MODEL_DIR")
        or REPO / ".cache" / "models" / "SmolLM2-135M-Instruct"
    )
    return prepare_model(path)


@pytest.fixture(scope="session")
def model(model_dir: Path) -> ModelInfo:
    return ModelInfo.load(model_dir)


@pytest.fixture(scope="session")
def embedded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("embedded")


CLUSTER = os.environ.get("LASTEVENT_TEST_REDIS_CLUSTER", "") not in ("", "0")


@pytest.fixture(scope="session")
def redis_url(embedded_dir: Path) -> Iterator[str]:
    if CLUSTER:
        from tests.cluster import LocalCluster

        cluster = LocalCluster(embedded_dir / "cluster")
        try:
            yield cluster.start().url
        finally:
            cluster.stop()
        return
    url = os.environ.get("LASTEVENT_TEST_REDIS_URL")
    if url:
        yield url
        return
    if answers("127.0.0.1", 6379):
        yield "redis://127.0.0.1:6379/0"
        return
    from service.cli.embedded import EmbeddedRedis

    server = EmbeddedRedis(embedded_dir / "redis")
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def pg_admin_url(embedded_dir: Path) -> Iterator[str]:
    """A URL to a database we may CREATE DATABASE from."""
    url = os.environ.get("LASTEVENT_TEST_PG_URL")
    if url:
        yield url
        return
    if answers("127.0.0.1", 5432):
        yield "postgresql+asyncpg://postgres@127.0.0.1:5432/postgres"
        return
    from service.cli.embedded import EmbeddedPostgres

    server = EmbeddedPostgres(embedded_dir / "pg")
    try:
        yield server.start()
    finally:
        server.stop()


async def _admin(url: str, sql: str) -> None:
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as conn:
            await conn.execute(text(sql))
    finally:
        await engine.dispose()


def fresh_database(admin_url: str) -> tuple[str, str]:
    """Create an empty database; return (its URL, its name)."""
    from sqlalchemy.engine import make_url

    name = f"lastevent_test_{uuid.uuid4().hex[:12]}"
    asyncio.run(_admin(admin_url, f'CREATE DATABASE "{name}"'))
    return make_url(admin_url).set(database=name).render_as_string(hide_password=False), name


def drop_database(admin_url: str, name: str) -> None:
    asyncio.run(_admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextlib.contextmanager
def migrated_database(admin_url: str) -> Iterator[str]:
    """A fresh database at alembic head, dropped afterwards."""
    from service.ledger.migrate import upgrade

    url, name = fresh_database(admin_url)
    try:
        upgrade(url)
        yield url
    finally:
        drop_database(admin_url, name)


@pytest.fixture(scope="session")
def database_url(pg_admin_url: str) -> Iterator[str]:
    with migrated_database(pg_admin_url) as url:
        yield url


@pytest.fixture
def key_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def upstream_server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Any]:
    """The test upstream (``tests/upstream_server.py``: vLLM's token-mode subset) over the
    CPU engine, a process of its own, one per module."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tests.upstream_server import ServerProcess

    server = ServerProcess(tmp_path_factory.mktemp("upstream"), model_dir, engine="cpu")
    try:
        yield server.start()
    finally:
        server.stop()
