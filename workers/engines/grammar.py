"""The CPU engine's structured output: xgrammar grammars compiled on a thread of their
own, bounded in size, time and memory, so that the decode thread never waits for one.

A schema takes xgrammar from milliseconds to many seconds to compile (17 KB of string
patterns: 12 s and 85 MB here), and the compiler itself (the tokenizer's vocabulary,
read once) a second. The decode thread only makes a matcher from a compiled grammar; the
request waits for its grammar before it joins the batch, while the others decode.

    size    a schema over ``MAX_GRAMMAR_BYTES`` is refused (the API refuses it first)
    time    a request whose grammar is not compiled within ``timeout_s`` ends with an
            error. xgrammar cannot be interrupted: a compile past its bound goes on
            (its grammar is kept for a retry) on its own thread, and later ones get a
            fresh thread -- for ``MAX_RUNAWAYS`` of them at once; past that, they wait
            behind them (and time out), so runaways hold at most that many cores
    memory  compiled grammars are kept in an LRU of ``max_entries`` and ``max_bytes``
            (xgrammar's own cache is off: it has no bound by count)
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from service.stream.limits import MAX_GRAMMAR_BYTES
from service.stream.params import Structured
from workers.engines.base import EngineError

_ANY_OBJECT = '{"type": "object"}'  # json_object, as vLLM's xgrammar backend compiles it
MAX_ENTRIES = 64
MAX_BYTES = 256 * 1024 * 1024
TIMEOUT_S = 10.0
COMPILER_THREADS = 1  # xgrammar's own threads per compile (the decode thread needs the CPU)
MAX_RUNAWAYS = 1  # compiles past their time bound left running beside the compile thread


class Lru:
    """At most ``max_entries`` values and ``max_bytes`` of them (each put with its size),
    the least recently used dropped first; a value larger than ``max_bytes`` is not kept.
    Thread-safe: the compile thread puts, the event loop gets."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: collections.OrderedDict[str, tuple[Any, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> Any:
        with self._lock:
            found = self._items.get(key)
            if found is None:
                return None
            self._items.move_to_end(key)
            return found[0]

    def put(self, key: str, value: Any, size: int) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            if size > self.max_bytes or self.max_entries <= 0:
                return
            self._items[key] = (value, size)
            self.bytes += size
            while len(self._items) > self.max_entries or self.bytes > self.max_bytes:
                _, (_, gone) = self._items.popitem(last=False)
                self.bytes -= gone


def schema_of(structured: Structured) -> str:
    """The JSON schema ``structured`` asks for (``{"type": "object"}`` for json_object)."""
    if structured.kind == "json_object":
        return _ANY_OBJECT
    if structured.kind == "json_schema" and structured.schema is not None:
        if len(structured.schema.encode()) > MAX_GRAMMAR_BYTES:
            raise EngineError(
                f"the JSON schema is over {MAX_GRAMMAR_BYTES} bytes", "invalid_request"
            )
        return structured.schema
    raise EngineError(f"unknown structured output {structured.kind!r}", "invalid_request")


class Grammars:
    """Compiled grammars for one model, made on the compile thread and kept in an LRU."""

    def __init__(
        self,
        tokenizer_info: Callable[[], Any],
        *,
        timeout_s: float = TIMEOUT_S,
        max_entries: int = MAX_ENTRIES,
        max_bytes: int = MAX_BYTES,
    ) -> None:
        self.tokenizer_info = tokenizer_info  # xgrammar's TokenizerInfo, made when first needed
        self.timeout_s = timeout_s
        self.cache = Lru(max_entries, max_bytes)
        self.compiles = 0  # started on the compile thread
        self.runaways = 0  # compiles past their time bound, still running
        self._compiler: Any = None
        self._pool = _one_thread()

    async def compiled(self, structured: Structured) -> Any:
        """``structured``'s compiled grammar: from the LRU, or compiled on the compile
        thread within ``timeout_s`` (else an ``EngineError`` ``grammar_timeout``)."""
        schema = schema_of(structured)
        found = self.cache.get(schema)
        if found is not None:
            return found
        job = self._pool.submit(self._compile, schema)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job), self.timeout_s)
        except TimeoutError:
            self._give_up(job)
            raise EngineError(
                f"the JSON schema took longer than {self.timeout_s:g} s to compile",
                "grammar_timeout",
            ) from None

    def _give_up(self, job: concurrent.futures.Future[Any]) -> None:
        """A compile past its time bound: dropped if it has not started; else left to
        finish on its thread, and later compiles get a fresh one (``MAX_RUNAWAYS``)."""
        if job.done() or self.runaways >= MAX_RUNAWAYS:
            return
        self.runaways += 1
        loop = asyncio.get_running_loop()

        def ended(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # (the loop is closed: nobody counts)
                loop.call_soon_threadsafe(self._ended)

        job.add_done_callback(ended)
        self._pool.shutdown(wait=False)  # (what waits behind it still runs, or times out)
        self._pool = _one_thread()

    def _ended(self) -> None:
        self.runaways -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, schema: str) -> Any:
        """On the compile thread: the grammar, kept in the LRU (a late one too)."""
        found = self.cache.get(schema)  # (compiled meanwhile by an earlier request)
        if found is not None:
            return found
        self.compiles += 1
        compiler = self._compiler or self._make_compiler()
        try:
            compiled = compiler.compile_json_schema(schema)
        except Exception as exc:  # a schema xgrammar cannot read
            raise EngineError(f"invalid JSON schema: {exc}", "invalid_request") from exc
        self.cache.put(schema, compiled, int(compiled.memory_size_bytes))
        return compiled

    def _make_compiler(self) -> Any:
        import xgrammar

        self._compiler = xgrammar.GrammarCompiler(
            self.tokenizer_info(), max_threads=COMPILER_THREADS, cache_enabled=False
        )
        return self._compiler


def _one_thread() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
