"""The keys `lastevent up` makes (service/cli/local_keys.py), against a real Postgres:
random and kept in the data dir, the published ones revoked, environment keys refused
where `up` is not local."""

from __future__ import annotations

import dataclasses
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import create_async_engine

from service.api.auth import parse_key
from service.cli import local_keys
from service.ledger.api_keys import ApiKeys, hash_secret
from service.settings import Settings
from tests.conftest import migrated_database


@pytest.fixture
def keys(pg_admin_url: str) -> Iterator[ApiKeys]:
    with migrated_database(pg_admin_url) as url:
        yield ApiKeys(create_async_engine(url))


@pytest.fixture
def other(pg_admin_url: str) -> Iterator[ApiKeys]:
    """A second, new database."""
    with migrated_database(pg_admin_url) as url:
        yield ApiKeys(create_async_engine(url))


def settings(tmp_path: Path, **kw: object) -> Settings:
    return dataclasses.replace(Settings(data_dir=tmp_path), **kw)  # type: ignore[arg-type]


async def test_random_keys_are_made_once_kept_and_made_again_when_revoked(
    tmp_path: Path, keys: ApiKeys, other: ApiKeys
) -> None:
    s = settings(tmp_path)
    made = await local_keys.ensure(s, keys, exposed=None)
    assert set(made) == {"user", "operator"}
    for role, tenant in (("user", "dev"), ("operator", "ops")):
        parsed = parse_key(made[role])
        assert parsed is not None and parsed[0] not in local_keys.PUBLISHED
        row = await keys.get(parsed[0])
        assert row is not None and (row.tenant, row.role) == (tenant, role)
    kept = tmp_path / local_keys.FILE
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600  # the owner's only
    assert await local_keys.ensure(s, keys, exposed=None) == made  # printed again, the same
    # revoked (`lastevent keys revoke`): a new one is made in its place
    await keys.revoke(made["user"].split("-")[2])
    again = await local_keys.ensure(s, keys, exposed=None)
    assert again["user"] != made["user"] and again["operator"] == made["operator"]
    # a new database (the kept key unknown there): the kept key is created in it
    assert await local_keys.ensure(s, other, exposed=None) == again
    assert await other.get(again["user"].split("-")[2]) is not None
    await other.engine.dispose()
    await keys.engine.dispose()


async def test_the_published_keys_are_revoked_wherever_up_finds_them(
    tmp_path: Path, keys: ApiKeys
) -> None:
    for key_id, secret in local_keys.PUBLISHED.items():
        await keys.create("dev", key_id=key_id, secret=secret)
    await keys.create("mine", key_id="devkeep", secret="myownsecret1")
    await local_keys.ensure(settings(tmp_path, dev_operator_key=""), keys, exposed=None)
    for key_id in local_keys.PUBLISHED:
        row = await keys.get(key_id)
        assert row is not None and row.revoked_at is not None
    kept = await keys.get("devkeep")
    assert kept is not None and kept.revoked_at is None
    assert kept.secret_hash == hash_secret("myownsecret1")
    await keys.engine.dispose()


async def test_keys_from_the_environment_are_local_only(tmp_path: Path, keys: ApiKeys) -> None:
    mine = "sk-le-mydev-0123456789abcdef"
    s = settings(tmp_path, dev_api_key=mine, dev_operator_key="")
    assert await local_keys.ensure(s, keys, exposed=None) == {"user": mine}
    exposed = local_keys.exposure(settings(tmp_path, host="0.0.0.0"), external_servers=False)
    assert exposed is not None and "0.0.0.0" in exposed
    with pytest.raises(SystemExit, match="local use only"):
        await local_keys.ensure(s, keys, exposed=exposed)
    published = settings(tmp_path, dev_api_key="sk-le-dev-localdevelopment", dev_operator_key="")
    with pytest.raises(SystemExit, match="published"):
        await local_keys.ensure(published, keys, exposed=None)
    assert local_keys.exposure(settings(tmp_path), external_servers=True) is not None
    assert local_keys.exposure(settings(tmp_path, host="::1"), external_servers=False) is None
    await keys.engine.dispose()
