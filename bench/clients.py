"""The load generator: asyncio HTTP/SSE clients, the same for both systems.

Each client opens one streaming chat completion and measures, per content event,
the receipt time minus the event's emit time (both systems put the emit time, in
unix ms, first in the SSE event id). A client may follow a *plan*:

* ``drop`` after N content events, stay away a moment, then resume with
  ``Last-Event-ID`` (lastevent only: the baseline has nothing to resume from);
* ``abort`` after N content events: lastevent ``POST /v1/requests/{id}/cancel`` and
  reads on to the terminal event, whose id is its time in the log, written right after
  the engine's abort; the baseline disconnects (its only way) and reports when the
  engine's generator was closed (``GET /aborts``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from typing import Any

import httpx
import msgspec

MODEL = "SmolLM2-135M-Instruct"

_decode = msgspec.json.Decoder().decode


@dataclasses.dataclass
class Plan:
    drop_at: int | None = None  # content events before dropping (then resume)
    abort_at: int | None = None  # content events before cancelling / disconnecting


@dataclasses.dataclass
class Run:
    system: str
    streams: int
    wall_s: float = 0.0
    tokens: int = 0
    finished: int = 0
    ttft_ms: list[float] = dataclasses.field(default_factory=list)
    added_ms: list[float] = dataclasses.field(default_factory=list)
    itl_ms: list[float] = dataclasses.field(default_factory=list)  # gaps between content events
    resume_ms: list[float] = dataclasses.field(default_factory=list)
    abort_ms: list[float] = dataclasses.field(default_factory=list)
    lost_chars: int = 0
    dup_chars: int = 0
    checked: int = 0  # streams whose text was compared with the expected answer
    errors: int = 0
    request_ids: list[str] = dataclasses.field(default_factory=list)
    aborts_sent: dict[str, float] = dataclasses.field(default_factory=dict)  # baseline: rid -> t
    cpu_s: dict[str, float] = dataclasses.field(default_factory=dict)  # process -> CPU seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else float("nan")


def _emit_ms(event_id: str | None) -> int | None:
    if not event_id:
        return None
    return int(event_id.split("-", 1)[0])


class _Reader:
    """Parses one SSE response, accumulating text and figures into ``run``.

    As the SSE standard says: an event's fields collect until the blank line that
    dispatches it, and only then is its id the last event id. The field order within
    an event is free (lastevent and the baseline write ``data:`` before ``id:``), so
    taking the id that was current when the ``data:`` line arrived would pair each
    event with the previous one's id: a resume one event early (that event's text
    twice) and emit times one token old."""

    def __init__(self, run: Run, started: float) -> None:
        self.run = run
        self.started = started
        self.pieces: list[str] = []
        self.event_id: str | None = None  # the id field seen so far (it persists across events)
        self.data: list[str] = []  # the data lines of the event not yet dispatched
        self.last_id: str | None = None  # the id of the last dispatched event
        self.chunk_id: str | None = None
        self.finish_id: str | None = None
        self.cut_at: float = 0.0  # when the client left the stream on purpose
        self.live = True  # False while reading back what the log kept (not a live sample)
        self.piece_at = 0.0  # when the last content event arrived (live)
        self.done = False

    def feed(self, line: str) -> bool:
        """Take one line; True when it dispatched a content event."""
        if not line:
            return self._dispatch()
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "id" and "\0" not in value:
            self.event_id = value
        elif name == "data":
            self.data.append(value)
        return False  # retry:, event:, comments: nothing to take

    def _dispatch(self) -> bool:
        if not self.data:  # e.g. the stream's leading retry: line
            return False
        data = "\n".join(self.data)
        self.data = []
        self.last_id = self.event_id
        if data == "[DONE]":
            self.done = True
            return False
        chunk: dict[str, Any] = _decode(data)
        self.chunk_id = chunk.get("id", self.chunk_id)
        usage = chunk.get("usage")
        if usage:
            self.run.tokens += usage["completion_tokens"]
        got = False
        for choice in chunk.get("choices") or ():
            if choice.get("finish_reason"):
                self.finish_id = self.event_id
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                now = time.time()
                if not self.pieces and self.started:
                    self.run.ttft_ms.append((now - self.started) * 1000)
                emitted = _emit_ms(self.event_id)
                if emitted is not None and self.live:
                    self.run.added_ms.append(now * 1000 - emitted)
                if self.live and self.piece_at:
                    self.run.itl_ms.append((now - self.piece_at) * 1000)
                self.piece_at = now if self.live else 0.0
                self.pieces.append(piece)
                got = True
        return got


async def one_stream(
    client: httpx.AsyncClient, text: str, run: Run, plan: Plan, progress: Progress
) -> None:
    body = {
        "model": MODEL,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": len(text) + 16,
        "messages": [{"role": "user", "content": text}],
    }
    reader = _Reader(run, time.time())
    rid = None
    cut_at = plan.drop_at or plan.abort_at
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                run.errors += 1
                return
            rid = r.headers.get("x-request-id")
            async for line in r.aiter_lines():
                if reader.feed(line):
                    progress.tokens += 1
                    if cut_at is not None and len(reader.pieces) == cut_at:
                        reader.cut_at = time.time()
                        break
                if reader.done:
                    break
        rid = rid or reader.chunk_id
        if rid:
            run.request_ids.append(rid)
        if plan.abort_at is not None and not reader.done:
            await _abort(client, run, reader, rid)
        elif plan.drop_at is not None and not reader.done:
            await _resume(client, run, reader, rid)
        if plan.abort_at is None:
            joined = "".join(reader.pieces)
            run.checked += 1
            run.lost_chars += max(0, len(text) - len(joined)) + (joined != text[: len(joined)])
            run.dup_chars += max(0, len(joined) - len(text))
        run.finished += 1
    except httpx.HTTPError:
        run.errors += 1
    finally:
        progress.done += 1


async def _resume(client: httpx.AsyncClient, run: Run, reader: _Reader, rid: str | None) -> None:
    await asyncio.sleep(0.5)  # offline for a moment: events pile up in the log meanwhile
    sent = time.time()
    first = True
    reader.started = 0.0  # no TTFT sample from the resumed part
    reader.live = False  # what piled up while away is not a live latency sample
    async with client.stream(
        "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": reader.last_id or ""}
    ) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and first:
                run.resume_ms.append((time.time() - sent) * 1000)
                first = False
            reader.feed(line)
            if reader.done:
                break


async def _abort(client: httpx.AsyncClient, run: Run, reader: _Reader, rid: str | None) -> None:
    if run.system == "baseline":  # leaving the `async with` closed the connection
        run.aborts_sent[reader.chunk_id or ""] = reader.cut_at
        return
    sent = time.time()
    # lastevent: the stream was left (its reader gone); cancel, then read the log's end
    await client.post(f"/v1/requests/{rid}/cancel")
    reader.live = False
    async with client.stream(
        "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": reader.last_id or ""}
    ) as r:
        async for line in r.aiter_lines():
            reader.feed(line)
            if reader.done:
                break
    emitted = _emit_ms(reader.finish_id)
    if emitted is not None:
        run.abort_ms.append(emitted - sent * 1000)


class Progress:
    """A one-line progress display on stderr while a run goes."""

    def __init__(self, label: str, streams: int) -> None:
        self.label = label
        self.streams = streams
        self.done = 0
        self.tokens = 0
        self._task: asyncio.Task[None] | None = None
        self._tty = sys.stderr.isatty()

    def __enter__(self) -> Progress:
        self._task = asyncio.get_running_loop().create_task(self._show())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
        self._line(final=True)

    def _line(self, final: bool = False) -> None:
        text = (
            f"  {self.label}: {self.done}/{self.streams} streams done, "
            f"{self.tokens} tokens received"
        )
        if self._tty:
            sys.stderr.write(f"\r{text}\033[K" + ("\n" if final else ""))
        elif final:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    async def _show(self) -> None:
        last = 0.0
        while True:
            await asyncio.sleep(0.5)
            if self._tty or time.monotonic() - last > 10:
                self._line()
                last = time.monotonic()


async def drive(
    url: str,
    system: str,
    streams: int,
    text: str,
    *,
    drops: int = 0,
    aborts: int = 0,
    seed: int = 0,
) -> Run:
    """``streams`` concurrent clients; the first ``drops`` drop and resume, the next
    ``aborts`` cancel (lastevent) or disconnect (baseline) part way."""
    import random

    rng = random.Random(seed)
    run = Run(system, streams)
    plans = [
        Plan(drop_at=rng.randint(2, 30))
        if i < drops
        else Plan(abort_at=rng.randint(2, 30))
        if i < drops + aborts
        else Plan()
        for i in range(streams)
    ]
    async with contextlib.AsyncExitStack() as stack:
        # httpcore scans its whole pool on every request (quadratic with one pool for 500
        # streams): one client per 25 streams
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=300))
            for _ in range(0, streams, 25)
        ]
        client = clients[0]
        with Progress(f"{system} x{streams}", streams) as progress:
            start = time.monotonic()
            await asyncio.gather(
                *(one_stream(clients[i // 25], text, run, p, progress) for i, p in enumerate(plans))
            )
            run.wall_s = time.monotonic() - start
        if system == "baseline" and run.aborts_sent:
            await asyncio.sleep(0.2)
            closed: dict[str, float] = (await client.get("/aborts")).json()
            for rid, sent in run.aborts_sent.items():
                if rid in closed:
                    run.abort_ms.append((closed[rid] - sent) * 1000)
    return run
