"""``lastevent keys list|revoke``: the API keys in the ledger (``keys create`` is in
``commands.py``). Revoking a key ends it on every API process within
``LASTEVENT_AUTH_CACHE_S``, and the stream tokens minted from it with it."""

from __future__ import annotations

import argparse
import asyncio

from service.api.auth import parse_key
from service.ledger.api_keys import ApiKeys
from service.ledger.ledger import make_engine
from service.settings import Settings


def keys_list(settings: Settings, args: argparse.Namespace) -> int:
    async def rows() -> list[str]:
        engine = make_engine(_url(settings))
        try:
            keys = await ApiKeys(engine).list(args.tenant)
        finally:
            await engine.dispose()
        out = ["id\ttenant\trole\tmodels\tcreated\trevoked"]
        for k in keys:
            revoked = k.revoked_at.isoformat(timespec="seconds") if k.revoked_at else "-"
            created = k.created_at.isoformat(timespec="seconds")
            out.append(f"{k.id}\t{k.tenant}\t{k.role}\t{k.models or '*'}\t{created}\t{revoked}")
        return out

    print("\n".join(asyncio.run(rows())))
    return 0


def keys_revoke(settings: Settings, args: argparse.Namespace) -> int:
    whole = parse_key(args.key_id)  # an id, or the whole key
    key_id = args.key_id if whole is None else whole[0]

    async def revoke() -> bool:
        engine = make_engine(_url(settings))
        try:
            return await ApiKeys(engine).revoke(key_id)
        finally:
            await engine.dispose()

    if not asyncio.run(revoke()):
        print(f"no unrevoked key {key_id}")
        return 1
    print(
        f"revoked {key_id}: API processes refuse it (and its stream tokens) within "
        f"LASTEVENT_AUTH_CACHE_S ({settings.auth_cache_s:g} s)"
    )
    return 0


def _url(settings: Settings) -> str:
    if not settings.database_url:
        raise SystemExit("LASTEVENT_DATABASE_URL is not set")
    return settings.database_url
