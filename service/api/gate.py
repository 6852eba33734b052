"""The API's outermost ASGI layer: which Host names it answers, and how many requests it
takes at once -- probes always.

**Hosts** (``LASTEVENT_ALLOWED_HOSTS``). A web page on another site can make a browser
send requests to ``http://127.0.0.1:8000`` through a DNS name of its own that it points
at 127.0.0.1 (DNS rebinding): the browser then treats the API as the page's own origin.
Such requests carry the attacker's name in ``Host``; the gate answers them 400
(``host_not_allowed``) before anything else runs. Rules: exact names, ``*.example.com``
(its subdomains), ``[ip]`` (any IP address: a page cannot rebind an address) and ``*``
(anything). ``lastevent up`` answers loopback names and IP addresses unless told more.

**Load.** uvicorn's own cap (``limit_concurrency``) answers 503 to every request past it,
``/healthz`` included, and an orchestrator then restarts a pod that is only busy. The
gate refuses a request past ``max_in_flight`` with a 503 of its own and ``Retry-After``
-- but never a probe (``PROBES``); uvicorn's cap stays, far above, as the last guard.
A WebSocket handshake is a request here (its Host checked, counted while it is open).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

import msgspec

from service.api.metrics import REJECTED
from service.errors import ApiError, InvalidRequest, ServiceUnavailable

Scope = dict[str, Any]

PROBES = frozenset({"/healthz", "/readyz", "/health", "/metrics"})
IP = "[ip]"  # the rule for any IP address
LOCAL = f"localhost,*.localhost,{IP}"  # what `lastevent up` answers unless told more


@dataclasses.dataclass(frozen=True, slots=True)
class Hosts:
    names: frozenset[str]
    suffixes: tuple[str, ...]  # ".example.com" for "*.example.com"
    ips: bool
    any: bool

    @classmethod
    def parse(cls, text: str) -> Hosts:
        """``a.example,*.b.example,[ip]``; empty or ``*``: any host."""
        rules = [r.strip().lower().rstrip(".") for r in text.split(",") if r.strip()]
        return cls(
            names=frozenset(r for r in rules if not r.startswith("*") and r != IP),
            suffixes=tuple(r[1:] for r in rules if r.startswith("*.")),
            ips=IP in rules,
            any=not rules or "*" in rules,
        )

    def allow(self, host_header: str | None) -> bool:
        """Whether a request whose ``Host`` is this is answered (port and case aside)."""
        if self.any:
            return True
        host = _hostname(host_header or "")
        if not host:
            return False
        if host in self.names or any(host.endswith(s) for s in self.suffixes):
            return True
        return self.ips and _is_ip(host)


def _hostname(header: str) -> str:
    """``Host``'s name without its port: ``[::1]:8000`` -> ``::1``, ``a.b:80`` -> ``a.b``."""
    header = header.strip().lower()
    if header.startswith("["):  # an IPv6 address
        end = header.find("]")
        rest = header[end + 1 :] if end > 0 else ":x"
        if rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return ""
        return header[1:end]
    name, _, port = header.partition(":")
    if port and not port.isdigit():
        return ""
    return name.rstrip(".")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


class Gate:
    def __init__(self, app: Any, hosts: Hosts, max_in_flight: int) -> None:
        self.app = app
        self.hosts = hosts
        self.max_in_flight = max_in_flight
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):  # (lifespan)
            await self.app(scope, receive, send)
            return
        if not self.hosts.allow(_header(scope, b"host")):
            message = "this server does not answer that Host name"
            await _respond(scope, receive, send, InvalidRequest(message, code="host_not_allowed"))
            return
        probe = scope.get("path") in PROBES
        if not probe and self.in_flight >= self.max_in_flight:
            message = f"this API process has {self.in_flight} requests open; retry"
            busy = ServiceUnavailable(message, retry_after_s=1, code="server_busy")
            await _respond(scope, receive, send, busy)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return bytes(value).decode("latin-1")
    return None


async def _respond(scope: Scope, receive: Any, send: Any, error: ApiError) -> None:
    """The error as the app renders its own (body, headers, the rejections metric),
    before the app runs; a WebSocket handshake gets it as its HTTP answer (ASGI's denial
    response)."""
    REJECTED.labels(status=str(error.status_code), reason=error.code or error.error_type).inc()
    body = msgspec.json.encode(error.body())
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    kind = "http.response"
    if scope["type"] == "websocket":
        await receive()  # (websocket.connect)
        kind = "websocket.http.response"
    await send({"type": f"{kind}.start", "status": error.status_code, "headers": headers})
    await send({"type": f"{kind}.body", "body": body})
