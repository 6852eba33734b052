"""Durability levels at a process's start: each role refuses, saying what is missing, a
level its Redis cannot give, and starts at one it can (``/readyz`` says which and how).

The shared Redis of this tier has no AOF and no replica (a server of the test's own
with ``appendfsync always`` gives ``disk``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import make_stack
from tests.servers import OwnRedis

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("level", "missing"), [("disk", "appendonly yes"), ("replica", "connected replica")]
)
@pytest.mark.parametrize("role", ["api", "worker"])
def test_a_process_refuses_a_level_its_redis_cannot_give(
    tmp_path: Path,
    redis_url: str,
    database_url: str,
    model_dir: Path,
    role: str,
    level: str,
    missing: str,
) -> None:
    if redis_url != "redis://127.0.0.1:6379/0":
        pytest.skip("needs the shared Redis without AOF or replica")
    st = make_stack(
        tmp_path, redis_url, database_url, model_dir, durability=level, startup_replica_wait_s=1.0
    )
    proc = st._spawn(role, role)
    assert proc.wait(timeout=60) != 0
    assert f"LASTEVENT_DURABILITY={level} needs" in st.tail(role) and missing in st.tail(role)


def test_disk_on_a_redis_that_fsyncs_every_write(
    tmp_path: Path, database_url: str, model_dir: Path
) -> None:
    server = OwnRedis(tmp_path / "redis", appendfsync="always")
    server.start()
    st = make_stack(tmp_path / "stack", server.url, database_url, model_dir, durability="disk")
    try:
        st.start_worker()
        url = st.start_api()
        ready = httpx.get(url + "/readyz", timeout=10).json()
        assert ready["durability"]["level"] == "disk"
        assert "appendfsync always" in ready["durability"]["how"]
        body = {"model": st.model, "messages": [{"role": "user", "content": "hi there"}]}
        answer = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["finish_reason"] == "stop"
    finally:
        st.stop()
        server.stop()
