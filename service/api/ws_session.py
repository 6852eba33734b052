"""One Responses WebSocket (``routes/responses_ws.py`` accepts it): client messages in,
response events out, one lane per ``stream_id``.

Every response is made and read as its ``POST /v1/responses`` twin with ``stream: true``
(``intake.response``, ``submit.accept``, ``readers.response_frames``): the same log, the
same reader lease while it streams here, the same events. A lane runs its responses one
after another; a cursor named on connect (``resume``) streams the rest of that response
in its lane first, like ``GET /v1/responses/{id}?stream=true&starting_after=`` (a reader
seat, a returning reader's admission). The socket gone, each lane's reader ends and its
lease goes: the answer parks as for a gone SSE reader. A process that drains closes the
socket with 1012 (service restart): the client reconnects elsewhere and resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import WebSocket

from service.api import intake
from service.api.auth import Principal
from service.api.context import Context
from service.api.intake import Idempotency
from service.api.metrics import REQUESTS
from service.api.readers import admit_return, response_frames, response_renderer, seated
from service.api.request_ids import no_such_request
from service.api.response_log import logged
from service.api.schemas import ResponsesRequest
from service.api.submit import accept
from service.errors import ApiError, InvalidRequest, ServiceUnavailable
from service.ledger.ledger import PostgresUnavailable
from service.store.pool import STORE_ERRORS
from service.stream import responses_ws as ws
from service.stream import resume, sse
from service.stream.response_events import frames_after

log = logging.getLogger(__name__)

MAX_LANES = 64  # lanes (stream_ids) one socket may hold
MAX_WAITING = 256  # requests queued behind their lanes' current ones, all lanes together
SERVICE_RESTART = 1012  # the close code a draining process sends: reconnect elsewhere
_AT = re.compile(r"at `\$\.([A-Za-z0-9_]+)")

Work = ws.Create | ws.Resume
_UNAVAILABLE: tuple[type[Exception], ...] = (*STORE_ERRORS, PostgresUnavailable)


class Session:
    def __init__(self, ctx: Context, socket: WebSocket[Any, Any, Any], principal: Principal):
        self.ctx = ctx
        self.socket = socket
        self.principal = principal
        self.lanes: dict[str | None, asyncio.Queue[Work]] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self.sending = asyncio.Lock()

    async def run(self, resumes: list[ws.Resume]) -> None:
        """Until the socket closes: resumed responses first, then what the client asks."""
        try:
            for resume in resumes:
                self._queue(resume.stream_id, resume)
            while True:
                message = await self.socket.receive()
                if message["type"] != "websocket.receive":
                    return
                await self._handle(message.get("text") or message.get("bytes") or b"")
        finally:
            for task in self.tasks:
                task.cancel()  # each reader's lease goes: the answer parks
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _handle(self, data: str | bytes) -> None:
        try:
            message = ws.parse(data)
        except ws.ProtocolError as exc:
            await self.send(ws.protocol_error(exc))
            return
        if isinstance(message, ws.Steer):
            await self.send(ws.steer_failed(message))
            return
        if message.stream_id not in self.lanes and len(self.lanes) >= MAX_LANES:
            error = ws.ProtocolError(f"at most {MAX_LANES} lanes per socket", param="stream_id")
            await self.send(ws.protocol_error(error, message.stream_id))
            return
        if sum(q.qsize() for q in self.lanes.values()) >= MAX_WAITING:
            text = f"{MAX_WAITING} requests wait on this socket's lanes (the limit); retry"
            code, lane = "too_many_pending_requests", message.stream_id
            await self.send(ws.error(429, "rate_limit_error", text, code=code, stream_id=lane))
            return
        self._queue(message.stream_id, message)

    def _queue(self, lane: str | None, work: Work) -> None:
        queue = self.lanes.get(lane)
        if queue is None:
            queue = self.lanes[lane] = asyncio.Queue()
            task = asyncio.create_task(self._lane(lane, queue), name=f"ws-lane-{lane}")
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        queue.put_nowait(work)

    async def _lane(self, lane: str | None, queue: asyncio.Queue[Work]) -> None:
        """A lane's responses, one after another; the lane goes when it has none left (a
        later request of its ``stream_id`` makes it again)."""
        try:
            while not queue.empty():
                await self._run(lane, queue.get_nowait())
        except Exception:  # the socket is gone (a send failed): the session ends
            log.debug("WebSocket lane %r ended", lane, exc_info=True)
            with contextlib.suppress(Exception):
                await self.socket.close(code=1011)
        finally:
            if self.lanes.get(lane) is queue:  # (no await since it was found empty)
                del self.lanes[lane]

    async def _run(self, lane: str | None, work: Work) -> None:
        """One request of a lane; what refuses it is an ``error`` event on the lane."""
        try:
            if isinstance(work, ws.Create):
                await self._create(work)
            else:
                await self._resume(work)
        except ApiError as exc:
            await self.send(ws.refused(exc.status_code, exc.body(), exc.headers, lane))
        except _UNAVAILABLE as exc:
            log.warning("a WebSocket response failed on its store: %r", exc)
            unavailable = ServiceUnavailable(
                "the service's store is unavailable; retry", retry_after_s=1
            )
            await self.send(ws.refused(503, unavailable.body(), unavailable.headers, lane))

    async def _create(self, work: ws.Create) -> None:
        """``response.create``: submitted as ``POST /v1/responses`` with stream: true."""
        try:
            body = msgspec.convert(work.body, ResponsesRequest)
        except msgspec.ValidationError as exc:
            raise _invalid(exc) from None
        sub = await intake.response(self.ctx, body, self.principal)
        acc = await accept(self.ctx, sub, self.principal, _idempotency(work))
        if not acc.replayed:  # (a replay streams from the start, with a lease of its own)
            REQUESTS.labels(kind="response", stream="true", model=acc.created.model).inc()
        frames = response_frames(self.ctx, acc.request_id, acc.created, None, lease=acc.lease)
        await self._pump(frames, work.stream_id)

    async def _resume(self, work: ws.Resume) -> None:
        """The rest of a response the client's cut socket was streaming."""
        rid, ctx = work.response_id, self.ctx
        log, looked = await logged(ctx, rid)
        plan = resume.sequence_plan(self.principal.tenant, looked, work.after, follow_ended=False)
        if isinstance(plan, resume.NotYours):
            raise no_such_request(rid)
        if isinstance(plan, resume.FromHotLog):  # followed to its end, as
            # GET /v1/responses/{id}?stream=true follows it
            frames = response_frames(ctx, rid, plan.created, plan.cursor, logged=log)
            frames = seated(ctx, rid, plan.created, frames)
            await admit_return(ctx, rid, plan.created)
            await self._pump(frames, work.stream_id)
            return
        renderer = response_renderer(rid, plan.created)  # it ended: the rest is here
        for frame in frames_after(renderer, (e for _, e in log), plan.cursor):
            await self.send(ws.event(sse.escape_json(frame.json()), work.stream_id))

    async def _pump(self, frames: AsyncIterator[bytes], lane: str | None) -> None:
        """A reader's SSE chunks as socket events, each the ``data`` of one SSE event."""
        last = b"{}"
        async with contextlib.aclosing(frames):  # type: ignore[type-var]
            async for chunk in frames:
                for data in ws.sse_data(chunk):
                    await self.send(ws.event(data, lane))
                    last = data
        drain = self.ctx.drain.future
        stopped = drain is not None and drain.done()
        if stopped and ws.event_type(last) not in ws.TERMINAL:  # stopped early
            await self.socket.close(code=SERVICE_RESTART, reason="reconnect and resume")

    async def send(self, text: str) -> None:
        async with self.sending:
            await self.socket.send_text(text)


def _idempotency(work: ws.Create) -> Idempotency | None:
    """The message's key and the digest of its body (its JSON, in key order), as a POST's
    ``Idempotency-Key`` and body."""
    if work.idempotency_key is None:
        return None
    canonical = msgspec.json.encode(work.body, order="sorted")
    return Idempotency(work.idempotency_key, hashlib.sha256(canonical).hexdigest())


def _invalid(exc: msgspec.ValidationError) -> InvalidRequest:
    """A ``response.create`` body the POST route's schema refuses, as its 400 says it."""
    text = str(exc)
    unknown = re.match(r"Object contains unknown field `(.*)`", text)
    if unknown is not None:
        param = unknown.group(1)
        return InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param)
    at = _AT.search(text)
    return InvalidRequest(f"Validation failed: {text}", param=at.group(1) if at else None)
