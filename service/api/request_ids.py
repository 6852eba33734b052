"""The request ids this server issues, and the one answer for every other id: a path's
id is checked before any store sees it, and another tenant's request is as unknown as
one that never existed."""

from __future__ import annotations

import re
import secrets

from service.api.auth import Principal
from service.errors import NotFound
from service.store.keys import LANE_MARK, model_lane
from service.stream.events import Created, Kind

REQUEST_ID_HEADER = "X-Request-Id"  # every answer about a request names it

# what ``new_request_id`` issues, and so all a per-request route may look up
# (and the ids of earlier versions, without a lane)
REQUEST_ID_RE = re.compile(
    rf"(?:(?:chatcmpl|cmpl)-|resp_)(?:{LANE_MARK}[0-9a-f]{{8}}[0-9a-f]{{24}}|[0-9a-f]{{32}})"
)
_PREFIX = {Kind.CHAT: "chatcmpl-", Kind.TEXT: "cmpl-", Kind.RESPONSE: "resp_"}
_SHOWN_ID_CHARS = 64


def new_request_id(kind: Kind, model: str) -> str:
    """The lane of the request's model (which queues it waits in: ``store/keys.py``), and
    96 random bits: unguessable."""
    return _PREFIX[kind] + LANE_MARK + model_lane(model) + secrets.token_hex(12)


def no_such_request(request_id: str) -> NotFound:
    """The one answer for an id that never existed, another tenant's request and a
    string that is not a request id at all: nothing tells them apart."""
    shown = request_id[:_SHOWN_ID_CHARS] + ("..." if len(request_id) > _SHOWN_ID_CHARS else "")
    return NotFound(f"no request '{shown}'", param="request_id", code="not_found")


def checked_request_id(request_id: str) -> str:
    """A path's request id, if this server could have issued it; otherwise the unknown
    id's 404. Call it before the first lookup: the stores must never see anything else
    (Postgres rejects a NUL in a text parameter, which would be a 500)."""
    if REQUEST_ID_RE.fullmatch(request_id) is None:
        raise no_such_request(request_id)
    return request_id


def owned(created: object, principal: Principal, request_id: str) -> Created:
    """The request's ``Created`` if it belongs to the caller's tenant. Another tenant's
    request gets the same 404 as one that never existed."""
    if not isinstance(created, Created) or created.tenant != principal.tenant:
        raise no_such_request(request_id)
    return created
