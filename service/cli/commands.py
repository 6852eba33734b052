"""The ``lastevent`` subcommands other than ``up``."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from service.api import billing
from service.ledger.api_keys import ApiKeys
from service.ledger.ledger import Ledger, make_engine
from service.settings import Settings
from service.store import commit, pool
from service.store.keys import Keys
from service.store.log import RedisLog
from service.store.outbox import Outbox
from service.store.pool import warm
from service.stream import replay

T = TypeVar("T")


def api(settings: Settings) -> None:
    from service.api.server import run

    run(settings)


def worker(settings: Settings) -> None:
    from workers.__main__ import main

    main(settings)


def recorder(settings: Settings) -> None:
    from workers.__main__ import main_recorder

    main_recorder(settings)


def migrate(settings: Settings) -> None:
    from service.ledger.migrate import upgrade

    if not settings.database_url:
        raise SystemExit("LASTEVENT_DATABASE_URL is not set")
    upgrade(settings.database_url)


def model_prepare(settings: Settings, *, force: bool = False) -> None:
    from service.cli.model import prepare_model

    path = prepare_model(settings.resolved_model_dir, force=force)
    print(f"model ready in {path}")


class Stores:
    """Redis and Postgres for a command that needs both."""

    def __init__(self, settings: Settings) -> None:
        if not settings.redis_url or not settings.database_url:
            raise SystemExit("LASTEVENT_REDIS_URL and LASTEVENT_DATABASE_URL must be set")
        self.redis = pool.of(settings, 4)
        self.engine = make_engine(settings.database_url)
        keys = Keys(settings.key_prefix, settings.partitions)
        committer = commit.of(settings, self.redis, keys)  # replays show what is committed
        self.log = RedisLog(self.redis, keys, committer=committer)
        self.outbox = Outbox(self.redis, keys, committer)
        self.ledger = Ledger(self.engine)

    async def close(self) -> None:
        await self.redis.aclose()
        await self.engine.dispose()


def _with_stores(settings: Settings, work: Callable[[Stores], Awaitable[T]]) -> T:
    async def run() -> T:
        stores = Stores(settings)
        try:
            await warm(stores.redis)  # (a cluster's slot map: reads are confirmed per node)
            return await work(stores)
        finally:
            await stores.close()

    return asyncio.run(run())


def _since_until(args: argparse.Namespace) -> tuple[dt.datetime, dt.datetime]:
    def parse(value: str) -> dt.datetime:
        t = dt.datetime.fromisoformat(value)
        return t if t.tzinfo else t.replace(tzinfo=dt.UTC)

    until = parse(args.until) if args.until else dt.datetime.now(dt.UTC)
    return parse(args.since), until


def billing_cmd(settings: Settings, args: argparse.Namespace) -> int:
    since, until = _since_until(args)
    if args.billing_cmd == "reconcile":
        report = _with_stores(
            settings, lambda s: billing.reconcile(s.outbox, s.log, s.ledger, since, until)
        )
        print("\n".join(report.lines()))
        return 0 if report.clean else 1
    rows = _with_stores(settings, lambda s: billing.export_usage(s.ledger, since, until))
    # the API's CSV (a cell a spreadsheet would run as a formula is quoted)
    sys.stdout.write(billing.csv_text(rows, billing.EXPORT_FIELDS))
    return 0


def replay_cmd(settings: Settings, args: argparse.Namespace) -> int:
    speed = None if args.speed == "max" else float(args.speed)

    async def run(stores: Stores) -> int:
        entries = await stores.log.read(args.request_id)
        if not entries:
            entries = await stores.ledger.archived(args.request_id) or []
        if not entries:
            print(f"no request {args.request_id} (hot log or archive)", file=sys.stderr)
            return 1
        async for chunk in replay.render(
            args.request_id,
            entries,
            speed=speed,
            fmt=args.format,
            reconnect_hint_ms=settings.reconnect_hint_ms,
        ):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
        return 0

    return _with_stores(settings, run)


def keys_create(settings: Settings, args: argparse.Namespace) -> int:
    if not settings.database_url:
        raise SystemExit("LASTEVENT_DATABASE_URL is not set")
    url = settings.database_url

    async def create() -> str:
        engine = make_engine(url)
        try:
            models = args.models.split(",") if args.models else None
            return await ApiKeys(engine).create(args.tenant, role=args.role, models=models)
        finally:
            await engine.dispose()

    print(asyncio.run(create()))
    print(f"(tenant {args.tenant}, role {args.role}; shown once, stored hashed)", file=sys.stderr)
    return 0


def tenants_set(settings: Settings, args: argparse.Namespace) -> int:
    if not settings.database_url:
        raise SystemExit("LASTEVENT_DATABASE_URL is not set")
    url, keep = settings.database_url, args.keep_inputs == "on"

    async def change() -> None:
        engine = make_engine(url)
        try:
            await ApiKeys(engine).set_keep_inputs(args.tenant, keep)
        finally:
            await engine.dispose()

    asyncio.run(change())
    print(
        f"tenant {args.tenant}: keep_inputs {args.keep_inputs} (API processes see it within "
        f"LASTEVENT_AUTH_CACHE_S, {settings.auth_cache_s:g} s)"
    )
    return 0


def archive_purge(settings: Settings, args: argparse.Namespace) -> int:
    days = settings.archive_retention_days if args.older_than_days is None else args.older_than_days
    older = (
        None
        if args.tenant and args.older_than_days is None
        else (dt.datetime.now(dt.UTC) - dt.timedelta(days=days))
    )
    n = _with_stores(
        settings, lambda s: s.ledger.purge_archives(older_than=older, tenant=args.tenant)
    )
    print(f"deleted {n} archived logs")
    return 0
