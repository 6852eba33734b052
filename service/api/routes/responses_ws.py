"""``GET /v1/responses`` upgraded to a WebSocket: OpenAI's Responses WebSocket mode
(``client.responses.connect()``) over the same logs as ``POST /v1/responses``.

The handshake is checked as an HTTP request is -- the API key (``Authorization:
Bearer``), the ``resume`` cursors (``stream/responses_ws.py``) -- and refused with the
HTTP status and error body a POST would get; the session is ``ws_session.Session``.
"""

from __future__ import annotations

from typing import Any, cast

import msgspec
from litestar import WebSocket, websocket

from service.api.context import Context
from service.api.metrics import REJECTED
from service.api.ws_session import Session
from service.errors import ApiError, InvalidRequest
from service.stream import responses_ws as ws


@websocket("/v1/responses")
async def responses_socket(socket: WebSocket[Any, Any, Any]) -> None:
    """OpenAI's Responses WebSocket mode; ``?resume=<response_id>:<sequence_number>,...``
    streams the rest of responses a cut socket was streaming first."""
    ctx: Context = socket.app.state.ctx
    try:
        client = socket.client.host if socket.client else None
        principal = await ctx.auth.principal(socket.headers.get("authorization"), client)
        try:
            resumes = ws.parse_resume(socket.query_params.getall(ws.RESUME_PARAM, []))
        except ws.ProtocolError as exc:
            raise InvalidRequest(exc.message, param=exc.param, code=exc.code) from None
    except ApiError as exc:
        await refuse(socket, exc)
        return
    await socket.accept()
    await Session(ctx, socket, principal).run(resumes)


async def refuse(socket: WebSocket[Any, Any, Any], error: ApiError) -> None:
    """The handshake answered with the error's HTTP status and body (ASGI's WebSocket
    denial response), as the POST route would answer it."""
    REJECTED.labels(status=str(error.status_code), reason=error.code or error.error_type).inc()
    await socket.receive()  # (websocket.connect)
    body = msgspec.json.encode(error.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    start = {"type": "websocket.http.response.start", "status": error.status_code}
    await socket.send(cast(Any, {**start, "headers": headers}))
    await socket.send(cast(Any, {"type": "websocket.http.response.body", "body": body}))
