"""``lastevent up`` (what ``make run`` runs): everything on one machine.

Servers (embedded unless URLs are set), migrations, the development key, the model,
then the API and one worker as child processes (and one more worker for each model in
``LASTEVENT_MODELS``). The banner is printed once the API answers and a worker of each
model has sent its first heartbeat. Ctrl-C stops all of it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from service.api import gate
from service.cli import local_keys
from service.cli.embedded import embedded_servers
from service.cli.local_keys import exposure
from service.cli.model import is_prepared, prepare_model
from service.ledger.api_keys import ApiKeys
from service.ledger.ledger import make_engine
from service.ledger.migrate import upgrade
from service.settings import Settings
from service.store import pool
from service.store.heartbeats import Heartbeats
from service.store.keys import Keys


def up(settings: Settings) -> None:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    want_redis, want_pg = not settings.redis_url, not settings.database_url
    with embedded_servers(settings.data_dir, redis=want_redis, postgres=want_pg) as (r, p):
        settings = Settings.from_env(
            redis_url=settings.redis_url or r,
            database_url=settings.database_url or p,
            # loopback names and IP addresses: no DNS rebinding page reaches it
            allowed_hosts=settings.allowed_hosts or gate.LOCAL,
        )
        assert settings.database_url is not None
        upgrade(settings.database_url)
        local: dict[str, str] = {}
        if settings.auth == "required":
            exposed = exposure(settings, external_servers=not (want_redis and want_pg))
            local = asyncio.run(_local_keys(settings, exposed))
        if not is_prepared(settings.resolved_model_dir):
            print("preparing the model (once)...", flush=True)
            prepare_model(settings.resolved_model_dir)
        env = {**os.environ, **settings.to_env()}
        children = [_spawn("api", env), _spawn("worker", env)]
        children += [_spawn("worker", e) for e in _more_workers(settings, env)]
        if _wait_until_serving(settings, children):
            print(f"lastevent serving on http://{settings.host}:{settings.port}  (Ctrl-C stops)")
            if "user" in local:
                print(f"development API key (tenant 'dev', local use only): {local['user']}")
            if "operator" in local:
                print(
                    f"operators' console: http://{settings.host}:{settings.port}/console "
                    f"(operator key, local use only: {local['operator']})"
                )
        _supervise(children)


async def _local_keys(settings: Settings, exposed: str | None) -> dict[str, str]:
    engine = make_engine(settings.database_url or "")
    try:
        return await local_keys.ensure(settings, ApiKeys(engine), exposed=exposed)
    finally:
        await engine.dispose()


def _more_workers(settings: Settings, env: dict[str, str]) -> list[dict[str, str]]:
    """A worker's environment for each model of ``LASTEVENT_MODELS``: that model, from
    its directory (a Hugging Face model directory: its tokenizer and weights), its own
    worker id and metrics port, and no adapters (they are the first model's)."""
    out = []
    for i, (name, path) in enumerate(list(settings.model_dirs.items())[1:], start=1):
        if not (path / "tokenizer.json").is_file():
            raise SystemExit(f"LASTEVENT_MODELS: {name}: no tokenizer.json in {path}")
        port = settings.metrics_port + i if settings.metrics_port else 0
        out.append(
            {
                **env,
                "LASTEVENT_MODEL_NAME": name,
                "LASTEVENT_MODEL_DIR": str(path),
                "LASTEVENT_WORKER_ID": f"{settings.worker_id}-{i}",
                "LASTEVENT_METRICS_PORT": str(port),
                "LASTEVENT_LORA_MODULES": "",
            }
        )
    return out


def _spawn(role: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "service.cli", role], env=env)


def _wait_until_serving(settings: Settings, children: list[subprocess.Popen[bytes]]) -> bool:
    """True once a worker of each model has sent its first heartbeat and the API answers
    ``/readyz``; False if a child exited (``_supervise`` reports it and stops the rest) or
    5 min passed."""
    deadline = time.monotonic() + 300

    async def workers() -> bool:
        redis = pool.of(settings, 1)
        try:
            beats = Heartbeats(redis, Keys(settings.key_prefix, settings.partitions))
            served = {m for b in await beats.live(settings.worker_stale_s) for m in b.models}
            return served >= set(settings.model_dirs)
        finally:
            await redis.aclose()

    url = f"http://{settings.host}:{settings.port}/readyz"
    while time.monotonic() < deadline:
        if any(c.poll() is not None for c in children):
            return False
        try:
            if asyncio.run(workers()):
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    return False


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
