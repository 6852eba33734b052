"""The benchmarks' no-Redis baseline (``bench/baseline.py``) streams a whole answer: the
same pure code as lastevent (assembler, endings, renderer) straight to SSE. A refactor
of that code broke it once unnoticed (every baseline stream failed at its end, and
``make bench`` reported 0 tok/s); this keeps the yardstick working."""

from __future__ import annotations

import json

import pytest
from litestar.testing import AsyncTestClient

from bench.baseline import build
from service.tokenize import ModelInfo

pytestmark = pytest.mark.timeout(60)


async def test_the_baseline_streams_the_echo_to_its_end(model: ModelInfo) -> None:
    app = build(model, tokens_per_s=1000.0)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "one two three four"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 64,
    }
    async with AsyncTestClient(app) as client:
        r = await client.post("/v1/chat/completions", json=body)
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "one two three four"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["usage"]["completion_tokens"] == len(model.encode(text)) + 1  # EOS
