"""Issue 41, sizes: the CPU engine compiles a structured request's grammar off its
decode thread (the batch keeps decoding meanwhile), within a time bound, and keeps the
compiled grammars in a bounded LRU."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.settings import MODEL_NAME
from service.stream.params import Structured
from tests.e2e.conftest import Stack, running
from workers.engines.base import EngineError


def slow_schema(properties: int, salt: str = "") -> dict[str, Any]:
    """Seconds of xgrammar's time for a few KB (string patterns of bounded repeats)."""
    return {
        "type": "object",
        "properties": {
            f"p{i}{salt}": {"type": "string", "pattern": f"[a-z]{{{i % 7 + 1},{i % 50 + 20}}}x{i}"}
            for i in range(properties)
        },
    }


@pytest.fixture(scope="module")
def cpu_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("grammar"),
        redis_url,
        database_url,
        model_dir,
        engine="cpu",
        grammar_compile_timeout_s=120.0,
    ) as st:
        yield st


def test_the_batch_decodes_while_a_grammar_compiles(cpu_stack: Stack) -> None:
    """A (plain, long) is decoding when B arrives with a schema that takes seconds to
    compile (and the worker's first: the compiler is made too). A's tokens arrive between
    B's acceptance and B's first token: the compile did not hold the decode thread. Before,
    it compiled on the decode thread, and A got at most the step under way meanwhile."""
    events: list[str] = []  # in arrival order: "A" per token of A, "B sent", "B first"
    started, b_done = threading.Event(), threading.Event()

    def stream(body: dict[str, Any], name: str) -> None:
        with (
            httpx.Client(base_url=cpu_stack.url, timeout=300) as c,
            c.stream("POST", "/v1/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if b_done.is_set():
                    return  # (A's request goes on without its reader: it is parked)
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if any(ch["delta"].get("content") for ch in chunk["choices"]):
                    if name == "B":
                        events.append("B first")
                        b_done.set()
                        return
                    events.append("A")
                    if events.count("A") >= 3:
                        started.set()

    base = {"model": MODEL_NAME, "stream": True, "temperature": 0}
    a = {**base, "messages": [{"role": "user", "content": "Count to a thousand."}]}
    fmt = {"type": "json_schema", "json_schema": {"name": "slow", "schema": slow_schema(50)}}
    b = {**base, "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 2}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        reading_a = pool.submit(stream, {**a, "max_tokens": 4000, "ignore_eos": True}, "A")
        assert started.wait(60), "A produced no tokens"
        events.append("B sent")
        reading_b = pool.submit(stream, {**b, "response_format": fmt}, "B")
        try:
            reading_b.result()
        finally:
            b_done.set()
        reading_a.result()
    during = events[events.index("B sent") : events.index("B first")].count("A")
    assert during >= 5, f"{during} of A's tokens while B's grammar compiled"


def tokenizer_info(model_dir: Path) -> Any:
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=49152)


def test_a_compile_past_its_time_bound_fails_the_request_and_is_kept(model_dir: Path) -> None:
    """The request that waited past ``timeout_s`` gets ``grammar_timeout``; its compile
    goes on (xgrammar cannot be stopped) on its own thread while the next grammar
    compiles on a fresh one, and its grammar, when done, is kept for a retry."""
    from workers.engines.grammar import Grammars

    info = tokenizer_info(model_dir)
    grammars = Grammars(lambda: info, timeout_s=0.05)
    slow = Structured(kind="json_schema", schema=json.dumps(slow_schema(40, "t")))
    small = Structured(kind="json_schema", schema=json.dumps({"enum": ["a", "b"]}))

    async def go() -> None:
        with pytest.raises(EngineError) as refused:
            await grammars.compiled(slow)
        assert refused.value.code == "grammar_timeout"
        assert grammars.runaways == 1
        grammars.timeout_s = 300
        await grammars.compiled(small)  # not behind the runaway: it is still running
        assert grammars.runaways == 1 and len(grammars.cache) == 1
        while grammars.runaways:
            await asyncio.sleep(0.05)
        assert grammars.cache.get(slow.schema or "") is not None  # the late grammar, kept
        await grammars.compiled(slow)

    try:
        asyncio.run(go())
        assert grammars.compiles == 2 and len(grammars.cache) == 2
    finally:
        grammars.close()


def test_compiled_grammars_are_bounded_by_count(model_dir: Path) -> None:
    from workers.engines.grammar import Grammars

    info = tokenizer_info(model_dir)
    grammars = Grammars(lambda: info, max_entries=3)

    def schema(i: int) -> Structured:
        return Structured(kind="json_schema", schema=json.dumps({"enum": [f"v{i}"]}))

    async def go() -> None:
        for i in range(6):
            await grammars.compiled(schema(i))
        await grammars.compiled(schema(5))  # a hit
        await grammars.compiled(schema(0))  # evicted: compiled again

    try:
        asyncio.run(go())
        assert len(grammars.cache) == 3 and grammars.compiles == 7
    finally:
        grammars.close()
