"""What every handler gets: the process's clients and stores, built once in the lifespan."""

from __future__ import annotations

import asyncio
import dataclasses

from redis.asyncio import Redis

from service.api.admission import Admission
from service.api.auth import Authenticator
from service.api.catalog import Catalog
from service.api.rendering import Renderer
from service.api.seats import Seats
from service.api.tokens import StreamTokens
from service.ledger.audit import Audit
from service.ledger.ledger import Ledger
from service.settings import Settings
from service.store.admission import IdempotencyKeys
from service.store.log import RedisLog
from service.store.readers import Presence, stream_token_secret
from service.store.tail import LogTailer
from service.tokenize import ModelInfo


class Drain:
    """Set when the API process starts to shut down: readers tell their clients to
    reconnect (elsewhere) and close, so the process can exit within its drain time."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self.future: asyncio.Future[None] | None = None  # one for all readers: no task each

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.future = loop.create_future()

    def start(self) -> None:
        """Safe to call from a signal handler."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._set)

    def _set(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(None)


@dataclasses.dataclass(slots=True)
class Context:
    settings: Settings
    redis: Redis
    log: RedisLog
    tailer: LogTailer
    model: ModelInfo  # the default model (a request without ``model``)
    catalog: Catalog  # every model this process answers for
    ledger: Ledger | None
    presence: Presence
    auth: Authenticator
    admission: Admission
    drain: Drain
    idempotency: IdempotencyKeys
    audit: Audit | None = None  # the ledger's lookups (None: no Postgres configured)
    renderer: Renderer = dataclasses.field(default_factory=Renderer)  # templates, tokenizers
    seats: Seats = dataclasses.field(default_factory=lambda: Seats(0, 0))  # readers' (seats.py)
    _tokens: StreamTokens | None = None

    def context_length(self, model: ModelInfo | None = None) -> int:
        """The longest prompt + answer a request of ``model`` (the default) may ask for."""
        return min((model or self.model).max_model_len, self.settings.max_model_len)

    async def stream_tokens(self) -> StreamTokens:
        """The stream-token signer (its secret from the settings, or shared via Redis and
        read once, when first needed: the API starts while Redis is away)."""
        if self._tokens is None:
            secret = self.settings.stream_token_secret
            raw = (
                secret.encode() if secret else await stream_token_secret(self.redis, self.log.keys)
            )
            self._tokens = StreamTokens(raw, self.settings.stream_token_ttl_s)
        return self._tokens
