"""The baseline a user would pick instead: the engine streamed straight to SSE, no Redis.

The shape of vLLM's own OpenAI server: one process runs the (scripted) engine and
writes each step's text to the client as it comes. It uses the same tokenizer,
detokenizer, holdback and chunk rendering as lastevent, so the difference measured
is the event log (queue, Redis appends, multiplexed tail), nothing else. Each SSE
event's id carries its emit time (``<unix ms>-0``), as lastevent's entry ids do.
Its only way to stop a request is the client disconnecting (as with vLLM's server);
``GET /aborts`` tells when each disconnect reached the engine.

    python -m bench.baseline --port 8100 --model-dir DIR --tokens-per-s 20
"""

from __future__ import annotations

import argparse
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import uvicorn
from litestar import Litestar, Request, get, post
from litestar.response import Stream

from service.stream import endings, sse
from service.stream.assemble import Assembler
from service.stream.events import Created
from service.stream.ids import EventId
from service.stream.params import SamplingParams
from service.stream.render import ChunkRenderer, sse_event_frames
from service.tokenize import ModelInfo
from workers.engines.scripted import ScriptedEngine


def build(model: ModelInfo, tokens_per_s: float, prefill_s: float = 0.0) -> Litestar:
    engine = ScriptedEngine(model, tokens_per_s=tokens_per_s, prefill_s=prefill_s)
    counter = iter(range(10**12))
    aborts: dict[str, float] = {}  # request id -> when the engine's generator was closed early

    async def frames(body: dict[str, Any]) -> AsyncIterator[bytes]:
        rid = f"chatcmpl-base{next(counter)}"
        prompt = model.encode(model.render_chat(body["messages"]))
        options = body.get("stream_options") or {}
        created = Created(
            kind="chat",
            model=body["model"],
            created=int(time.time()),
            prompt_tokens=len(prompt),
            include_usage=bool(options.get("include_usage")),
        )
        renderer = ChunkRenderer(rid, created)
        asm = Assembler(
            model.tokenizer, prompt_tokens=len(prompt), stop_token_ids=model.eos_token_ids
        )

        def now_id() -> EventId:
            return EventId(int(time.time() * 1000), 0)

        yield b"".join(sse_event_frames(renderer, now_id(), created, None))
        params = SamplingParams(max_tokens=int(body.get("max_tokens") or 256))
        reason = None
        gen = engine.generate(rid, prompt, params)
        try:  # a client that disconnects closes this generator: that is the baseline's abort
            async for out in gen:
                for event in asm.step(out.token_ids).events:
                    yield b"".join(sse_event_frames(renderer, now_id(), event, None))
                if out.finished:
                    reason = out.finish_reason
        except BaseException:
            await gen.aclose()
            aborts[rid] = time.time()
            raise
        # the ending as a worker makes it (``endings.py``): the held text, then End
        tail = asm.flush()
        tokens = asm.completion_tokens
        shown = endings.Shown(0, asm.stopped, asm.has_calls, tokens, tokens)
        choice = endings.finished(shown, reason, tail=tail)
        request = endings.Request(rid, (now_id(), created), len(prompt), int(time.time() * 1000))
        ending = endings.ran(request, [choice])
        assert isinstance(ending, endings.Ending)
        for event in ending.events:
            yield b"".join(sse_event_frames(renderer, now_id(), event, None))

    @post("/v1/chat/completions", status_code=200)
    async def chat(request: Request[Any, Any, Any]) -> Stream:
        body = msgspec.json.decode(await request.body())
        return Stream(frames(body), media_type=sse.MEDIA_TYPE, headers=dict(sse.HEADERS))

    @get("/aborts")
    async def aborted() -> dict[str, float]:
        return aborts

    return Litestar(route_handlers=[chat, aborted])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--tokens-per-s", type=float, default=20.0)
    parser.add_argument("--prefill-s", type=float, default=0.0, help="idle-stream runs")
    args = parser.parse_args()
    app = build(ModelInfo.load(args.model_dir), args.tokens_per_s, args.prefill_s)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
