"""Stream tokens: a short-lived credential for reading one request, for clients that cannot
send an ``Authorization`` header (a browser's ``EventSource``).

Every POST that creates a request answers ``X-Stream-Token``: an HMAC-signed (SHA-256)
token naming the tenant, the API key and the request, with an expiry. ``?token=`` on
``GET /v1/requests/{id}`` and ``/v1/requests/{id}/events`` is accepted instead of a key,
for that request only; nothing else accepts it. The secret is
``LASTEVENT_STREAM_TOKEN_SECRET``, or one made at random once and shared through Redis
(so every API replica accepts every other's tokens). Tokens never reach a log: the
access log shows ``token=[redacted]`` (``redact``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import time

import msgspec

from service.api.auth import Principal

HEADER = "X-Stream-Token"
QUERY = "token"
_VERSION = "st1"


class _Claims(msgspec.Struct, array_like=True):
    tenant: str
    key_id: str | None
    request_id: str
    expires: int  # unix seconds


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class StreamTokens:
    def __init__(self, secret: bytes, ttl_s: float) -> None:
        if len(secret) < 16:
            raise ValueError("the stream token secret must be at least 16 bytes")
        self._secret = secret
        self.ttl_s = ttl_s

    def issue(self, principal: Principal, request_id: str, *, now: float | None = None) -> str:
        expires = int((time.time() if now is None else now) + self.ttl_s)
        claims = _Claims(principal.tenant, principal.key_id, request_id, expires)
        body = _b64(msgspec.msgpack.encode(claims))
        return f"{_VERSION}.{body}.{self._sign(body)}"

    def verify(self, token: str, request_id: str, *, now: float | None = None) -> Principal | None:
        """The principal the token stands for, if it is ours, unexpired and for this
        request; otherwise None (the caller answers 401)."""
        parts = token.split(".")
        if len(parts) != 3 or parts[0] != _VERSION:
            return None
        _, body, sig = parts
        # (bytes: compare_digest refuses a str with non-ASCII characters -- a 500)
        if not hmac.compare_digest(sig.encode(), self._sign(body).encode()):
            return None
        try:
            claims = msgspec.msgpack.decode(_unb64(body), type=_Claims)
        except (ValueError, msgspec.DecodeError):
            return None
        if claims.request_id != request_id:
            return None
        if claims.expires < (time.time() if now is None else now):
            return None
        return Principal(tenant=claims.tenant, key_id=claims.key_id, role="stream")

    def _sign(self, body: str) -> str:
        mac = hmac.new(self._secret, f"{_VERSION}.{body}".encode(), hashlib.sha256)
        return _b64(mac.digest())


_TOKEN_IN_QUERY = re.compile(r"([?&]token=)[^&\s\"]*")


def redact(text: str) -> str:
    """A path or log line without the value of any ``token=`` query parameter."""
    return _TOKEN_IN_QUERY.sub(r"\1[redacted]", text)
