"""Alembic: head on an empty database, no drift between models and migrations, down and up."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.ext.asyncio import create_async_engine

from service.ledger.migrate import alembic_config, upgrade
from service.ledger.models import Base
from tests.conftest import drop_database, fresh_database


@pytest.fixture
def empty_db(pg_admin_url: str) -> Iterator[str]:
    url, name = fresh_database(pg_admin_url)
    try:
        yield url
    finally:
        drop_database(pg_admin_url, name)


def _diff_and_tables(url: str) -> tuple[list[object], set[str]]:
    async def run() -> tuple[list[object], set[str]]:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:

                def inspect_sync(sync_conn):  # type: ignore[no-untyped-def]
                    ctx = MigrationContext.configure(sync_conn, opts={"compare_type": True})
                    return compare_metadata(ctx, Base.metadata), set(
                        inspect(sync_conn).get_table_names()
                    )

                return await conn.run_sync(inspect_sync)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def test_upgrade_head_on_empty_database_matches_models(empty_db: str) -> None:
    upgrade(empty_db)
    diff, tables = _diff_and_tables(empty_db)
    assert {"requests", "alembic_version"} <= tables
    assert diff == [], f"models and migrations drifted: {diff}"


def test_downgrade_to_base_and_up_again(empty_db: str) -> None:
    upgrade(empty_db)
    command.downgrade(alembic_config(empty_db), "base")
    _, tables = _diff_and_tables(empty_db)
    assert "requests" not in tables
    upgrade(empty_db)
    diff, _ = _diff_and_tables(empty_db)
    assert diff == []
