"""OpenAI's Responses WebSocket mode, without I/O: what a client message asks, the events
the socket sends back, and the cursor a reconnecting client names.

*Client messages.* ``response.create`` carries the body of ``POST /v1/responses`` (minus
``stream``, implicit, and ``background``, refused as OpenAI refuses it) plus ``stream_id``,
the lane: requests of one lane run one after another, lanes side by side, and every event
of a response echoes its lane. ``response.steer`` is answered ``response.steer.failed``
(``steering_not_supported``). Anything else is an ``error`` event (status 400). An
``idempotency_key`` beside ``stream_id`` (lastevent's, as the ``Idempotency-Key`` header of
a POST) makes the same message sent again -- after a reconnect, when its
``response.created`` never came -- stream the same response from its start.

*Events.* A response's events are the JSON objects its SSE stream carries (the same bytes:
``data`` of each frame), with ``stream_id`` appended when the lane has one.

*Resume.* The server cannot know what a cut socket delivered, so the client says it when
it connects again: ``resume`` in the query, a comma-separated list of
``<response_id>:<last sequence_number seen>[:<stream_id>]`` (no number: from the start);
the socket first streams the rest of each named response in its lane.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import msgspec

RESUME_PARAM = "resume"
ENVELOPE = ("type", "stream_id", "idempotency_key")  # what is not the POST body
MAX_STREAM_ID = 256  # characters of a lane's name
MAX_RESUMED = 64  # responses one reconnect may name
TERMINAL = frozenset({"response.completed", "response.failed", "response.incomplete"})

_KEY = re.compile(r"[\x21-\x7e]{1,255}")  # as the Idempotency-Key header
_json = msgspec.json.Encoder()
_decode = msgspec.json.Decoder()


class ProtocolError(Exception):
    """A client message or cursor the server cannot act on: an ``error`` event (or, for
    the cursor, a refused handshake), status 400."""

    def __init__(self, message: str, *, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclasses.dataclass(frozen=True, slots=True)
class Create:
    """``response.create``: ``body`` is a ``POST /v1/responses`` body (``stream`` set)."""

    body: dict[str, Any]
    stream_id: str | None
    idempotency_key: str | None = None  # the same key and body again: the same response


@dataclasses.dataclass(frozen=True, slots=True)
class Steer:
    message: dict[str, Any]


@dataclasses.dataclass(frozen=True, slots=True)
class Resume:
    """The rest of a response a cut socket was streaming: after ``after`` (None: all)."""

    response_id: str
    after: int | None
    stream_id: str | None


def parse(data: str | bytes) -> Create | Steer:
    """One client message; ``ProtocolError`` for one that is not JSON, not an object, or
    of no type this server takes."""
    try:
        message = _decode.decode(data)
    except (msgspec.DecodeError, RecursionError):
        raise ProtocolError("the message is not valid JSON", code="invalid_json") from None
    if not isinstance(message, dict):
        raise ProtocolError("a client event is a JSON object", code="invalid_json")
    kind = message.get("type")
    if kind == "response.steer":
        return Steer(message)
    if kind != "response.create":
        shown = kind[:64] if isinstance(kind, str) else kind
        raise ProtocolError(
            f"unknown client event type {shown!r}: 'response.create' or 'response.steer'",
            param="type",
            code="invalid_event_type",
        )
    body = {k: v for k, v in message.items() if k not in ENVELOPE}
    if body.get("background") is not None and body["background"] is not False:
        raise ProtocolError("'background' is not supported over WebSocket", param="background")
    if body.get("stream") is False:
        raise ProtocolError("a WebSocket response always streams", param="stream")
    body.pop("background", None)
    body["stream"] = True
    key = message.get("idempotency_key")
    if key is not None and not (isinstance(key, str) and _KEY.fullmatch(key)):
        raise ProtocolError(
            "'idempotency_key' is 1 to 255 printable ASCII characters",
            param="idempotency_key",
            code="invalid_idempotency_key",
        )
    return Create(body, _lane(message.get("stream_id"), "stream_id"), key)


def _lane(value: object, param: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_STREAM_ID:
        message = f"'{param}' is a string of 1 to {MAX_STREAM_ID} characters"
        raise ProtocolError(message, param=param)
    return value


def parse_resume(values: list[str]) -> list[Resume]:
    """The cursors of every ``resume`` parameter; ``ProtocolError`` for a malformed one."""
    out: list[Resume] = []
    for value in values:
        out += [_resume_entry(entry) for entry in value.split(",") if entry]
    if len(out) > MAX_RESUMED:
        raise ProtocolError(f"at most {MAX_RESUMED} responses per reconnect", param=RESUME_PARAM)
    if len({r.response_id for r in out}) < len(out):
        raise ProtocolError("a response is named twice", param=RESUME_PARAM)
    return out


def _resume_entry(entry: str) -> Resume:
    rid, _, rest = entry.partition(":")
    number, _, lane = rest.partition(":")
    if not rid.startswith("resp_") or len(rid) > 128:
        raise ProtocolError(f"'{entry[:80]}' names no response id", param=RESUME_PARAM)
    if number and not (number.isascii() and number.isdigit() and len(number) <= 18):
        raise ProtocolError(
            f"'{entry[:80]}': the last sequence number seen is 0 or more (18 digits at most)",
            param=RESUME_PARAM,
            code="invalid_event_id",
        )
    return Resume(rid, int(number) if number else None, _lane(lane or None, RESUME_PARAM))


def event(data: bytes, stream_id: str | None) -> str:
    """A response's event (its SSE ``data``: a JSON object) as the socket sends it."""
    text = data.decode()
    if stream_id is None:
        return text
    return text[:-1] + ',"stream_id":' + _json.encode(stream_id).decode() + "}"


def event_type(data: bytes) -> str:
    """The ``type`` of an event's JSON."""
    kind = _decode.decode(data).get("type")
    return kind if isinstance(kind, str) else ""


def error(
    status: int,
    error_type: str,
    message: str,
    *,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    stream_id: str | None = None,
) -> str:
    """OpenAI's ``error`` event of the WebSocket mode (``ResponseWsError``)."""
    detail: dict[str, Any] = {"type": error_type, "code": code, "message": message, "param": param}
    if headers:
        detail["headers"] = {k.lower(): v for k, v in headers.items()}
    out: dict[str, Any] = {"type": "error", "status": status, "error": detail}
    if stream_id is not None:
        out["stream_id"] = stream_id
    return _json.encode(out).decode()


def refused(
    status: int, body: dict[str, Any], headers: dict[str, str], stream_id: str | None
) -> str:
    """An error the HTTP route answers with ``status`` and ``body`` (``{"error": {...}}``),
    as the socket's ``error`` event. A ``previous_response_id`` that names nothing is
    OpenAI's ``previous_response_not_found`` (status 400)."""
    detail = body["error"]
    code, param = detail.get("code"), detail.get("param")
    if param == "previous_response_id" and status == 404:
        status, code = 400, "previous_response_not_found"
        detail = {**detail, "type": "invalid_request_error"}
    return error(
        status,
        str(detail.get("type")),
        str(detail.get("message")),
        code=code,
        param=param,
        headers=headers,
        stream_id=stream_id,
    )


def protocol_error(exc: ProtocolError, stream_id: str | None = None) -> str:
    kind = "invalid_request_error"
    return error(400, kind, exc.message, code=exc.code, param=exc.param, stream_id=stream_id)


def steer_failed(steer: Steer) -> str:
    """``response.steer.failed``: steering is not supported here (its input back, to carry
    into the next ``response.create``)."""
    message = steer.message
    out = {
        "type": "response.steer.failed",
        "sequence_number": 0,
        "error": {
            "type": "invalid_request_error",
            "code": "steering_not_supported",
            "message": "response.steer is not supported by this server: send the input "
            "with the next response.create (previous_response_id chains it)",
        },
        "steer": {
            "input": message.get("input"),
            "previous_response_id": message.get("previous_response_id"),
        },
    }
    return _json.encode(out).decode()


def sse_data(chunk: bytes) -> list[bytes]:
    """The ``data`` of every event in a chunk of an SSE stream made of whole events (what a
    response reader yields); comment, ``retry:``, ``id:`` and ``event:`` lines dropped."""
    return [line[6:] for line in chunk.split(b"\n") if line.startswith(b"data: ")]
