"""Process helpers shared by the benchmark scripts."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ok(url: str, procs: list[subprocess.Popen[bytes]], timeout_s: float = 300) -> None:
    """Until ``url`` answers below 500; fail if one of ``procs`` exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{p.args} exited with {p.returncode}; see its log")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code < 500:
                return
        time.sleep(0.2)
    raise TimeoutError(url)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def start_roles(
    env: dict[str, str], logs: Path, roles: tuple[str, ...] = ("worker", "api")
) -> list[subprocess.Popen[bytes]]:
    """lastevent processes of ``roles`` (``lastevent worker`` / ``api`` / ``node``) with
    ``env``, each logging to ``logs/<role>.log``, in that order."""
    procs = []
    for role in roles:
        with open(logs / f"{role}.log", "wb") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "service.cli", role], env=env, stdout=out, stderr=out
                )
            )
    return procs
