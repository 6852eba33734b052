"""`lastevent up` (what `make run` runs): embedded Valkey + Postgres, migrations, API, worker."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil

from service.cli import local_keys
from tests.e2e.conftest import free_port
from tests.waiting import wait_until


def test_up_with_embedded_servers_serves_and_stops_cleanly(tmp_path: Path, model_dir: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LASTEVENT_")}
    env.update(
        LASTEVENT_DATA_DIR=str(tmp_path / "data"),
        LASTEVENT_MODEL_DIR=str(model_dir),
        LASTEVENT_ENGINE="scripted",
        LASTEVENT_PORT=str(port),
    )
    log = open(tmp_path / "up.log", "wb")  # noqa: SIM115
    up = subprocess.Popen(
        [sys.executable, "-m", "service.cli", "up"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    banner = "development API key (tenant 'dev', local use only): "
    try:
        # the banner is what a user waits for: it comes only once the API answers
        wait_until(
            lambda: up.poll() is not None or banner in (tmp_path / "up.log").read_text(),
            timeout=90,
            what="the serving banner",
        )
        printed = (tmp_path / "up.log").read_text()
        assert up.poll() is None, printed
        assert httpx.get(url + "/readyz", timeout=5).status_code == 200
        key = printed.split(banner)[1].split()[0]
        body = {
            "model": "SmolLM2-135M-Instruct",
            "messages": [{"role": "user", "content": "hello up"}],
        }
        denied = httpx.post(url + "/v1/chat/completions", timeout=30, json=body)
        assert denied.status_code == 401
        resp = httpx.post(
            url + "/v1/chat/completions",
            timeout=30,
            json=body,
            headers={"Authorization": f"Bearer {key}"},
        )
        assert resp.json()["choices"][0]["message"]["content"] == "hello up"
        # a random key, kept for the next start (the published ones are never made)
        assert key.split("-")[2] not in local_keys.PUBLISHED
        assert key in (tmp_path / "data" / local_keys.FILE).read_text()
        # a page on another site that rebinds its name to 127.0.0.1 gets nothing
        rebound = httpx.get(
            url + "/v1/models",
            timeout=30,
            headers={"Authorization": f"Bearer {key}", "Host": f"evil.example:{port}"},
        )
        assert rebound.status_code == 400
        assert rebound.json()["error"]["code"] == "host_not_allowed"
        children = psutil.Process(up.pid).children(recursive=True)
        assert children
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        up.wait(timeout=60)
    assert up.returncode == 0, (tmp_path / "up.log").read_text()

    def alive() -> list[psutil.Process]:
        running = []
        for c in children:
            try:
                if c.is_running() and c.status() != psutil.STATUS_ZOMBIE:
                    running.append(c)
            except psutil.NoSuchProcess:
                pass
        return running

    # none outlives `up` (an orphan's exit may trail `up`'s own a little: wait for it)
    with contextlib.suppress(AssertionError):
        wait_until(lambda: not alive(), "every child of `up` to exit", timeout=30)
    assert alive() == [], [c.cmdline() for c in alive()]
    assert "lastevent stopped" in (tmp_path / "up.log").read_text()


def test_up_refuses_a_key_from_the_environment_when_it_listens_beyond_loopback(
    tmp_path: Path, model_dir: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LASTEVENT_")}
    env.update(
        LASTEVENT_DATA_DIR=str(tmp_path / "data"),
        LASTEVENT_MODEL_DIR=str(model_dir),
        LASTEVENT_ENGINE="scripted",
        LASTEVENT_PORT=str(free_port()),
        LASTEVENT_HOST="0.0.0.0",  # what a container, or a try from a phone, does
        LASTEVENT_DEV_API_KEY="sk-le-mine-0123456789abcdef",
    )
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "up"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode != 0
    assert "LASTEVENT_DEV_API_KEY names a key for local use only" in done.stderr + done.stdout
    assert "lastevent serving" not in done.stdout
