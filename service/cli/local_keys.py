"""The keys ``lastevent up`` makes for the person at the keyboard: a development key
(tenant ``dev``) and an operator key (tenant ``ops``, the console's).

Each is random, made on the first start and kept in the data dir (``local-keys.json``,
readable by its owner only), and printed at every start, so the quick start works by
copy-paste and nobody else knows the key. A key kept there that the database does not
know (a new database) is created in it; one that was revoked is replaced.

``LASTEVENT_DEV_API_KEY`` / ``LASTEVENT_DEV_OPERATOR_KEY`` name a key to create instead
(``sk-le-<id>-<secret>``), or ``""`` for none. A key from the environment is for local
use only: it is refused when ``up`` listens beyond loopback or uses servers it did not
start itself (``exposure``). The fixed keys that earlier versions created and printed
in the README are published, so they are revoked wherever ``up`` finds them.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
from pathlib import Path

from service.api.auth import parse_key
from service.ledger.api_keys import ApiKeys, hash_secret
from service.settings import Settings

FILE = "local-keys.json"
RANDOM = "random"  # the setting's default: a random key, kept in the data dir
# id -> secret of the keys earlier versions made and the README printed: known to all
PUBLISHED = {"dev": "localdevelopment", "devops": "localoperator"}
LOCAL_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """True for an address (or ``localhost``) that only this machine can reach."""
    host = host.strip().strip("[]").lower()
    if host in LOCAL_NAMES or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def exposure(settings: Settings, *, external_servers: bool) -> str | None:
    """Why keys meant for local use must not be made here; None when it is local."""
    if not is_loopback(settings.host):
        return f"it listens on {settings.host} (LASTEVENT_HOST), beyond this machine"
    if external_servers:
        return "it uses Redis/Postgres servers it did not start (LASTEVENT_*_URL)"
    return None


async def ensure(settings: Settings, keys: ApiKeys, *, exposed: str | None) -> dict[str, str]:
    """The local keys to print, by role (``user``, ``operator``), made where needed."""
    await revoke_published(keys)
    path = settings.data_dir / FILE
    kept = _read(path)
    out: dict[str, str] = {}
    for role, tenant, setting in (
        ("user", "dev", settings.dev_api_key),
        ("operator", "ops", settings.dev_operator_key),
    ):
        if not setting:
            continue
        if setting != RANDOM:
            out[role] = await _from_env(keys, role, tenant, setting, exposed)
            continue
        key = kept.get(role)
        if key is None or not await _usable(keys, key, tenant, role):
            key = await keys.create(tenant, role=role)
        out[role] = kept[role] = key
    _write(path, kept)
    return out


async def revoke_published(keys: ApiKeys) -> list[str]:
    """Revoke the published keys earlier versions made; the ids revoked."""
    revoked = []
    for key_id, secret in PUBLISHED.items():
        row = await keys.get(key_id)
        if row is not None and row.secret_hash == hash_secret(secret) and row.revoked_at is None:
            await keys.revoke(key_id)
            revoked.append(key_id)
    return revoked


async def _from_env(keys: ApiKeys, role: str, tenant: str, key: str, exposed: str | None) -> str:
    name = "LASTEVENT_DEV_OPERATOR_KEY" if role == "operator" else "LASTEVENT_DEV_API_KEY"
    parsed = parse_key(key)
    if parsed is None:
        raise SystemExit(f"{name} must look like sk-le-<id>-<secret> (or be empty: no key)")
    if exposed is not None:
        raise SystemExit(
            f"{name} names a key for local use only, and `lastevent up` is not local: "
            f"{exposed}. Unset it (a random key is made and printed) or create real keys "
            "with `lastevent keys create`."
        )
    if PUBLISHED.get(parsed[0]) == parsed[1]:
        raise SystemExit(f"{name}: that key was published in the README; choose another")
    await keys.create(tenant, role=role, key_id=parsed[0], secret=parsed[1])
    return key


async def _usable(keys: ApiKeys, key: str, tenant: str, role: str) -> bool:
    """The kept key is in the database (created there if it is a new one), unrevoked."""
    parsed = parse_key(key)
    if parsed is None:
        return False
    row = await keys.get(parsed[0])
    if row is None:
        await keys.create(tenant, role=role, key_id=parsed[0], secret=parsed[1])
        return True
    return row.revoked_at is None and row.secret_hash == hash_secret(parsed[1])


def _read(path: Path) -> dict[str, str]:
    with contextlib.suppress(FileNotFoundError, ValueError):
        kept = json.loads(path.read_text())
        if isinstance(kept, dict):
            return {str(k): str(v) for k, v in kept.items()}
    return {}


def _write(path: Path, kept: dict[str, str]) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(kept, f, indent=2)
    os.replace(tmp, path)
