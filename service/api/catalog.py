"""The models an API process answers for (``model`` in a request, ``/v1/models``): the
ones it has a tokenizer for (``LASTEVENT_MODEL_NAME`` and ``LASTEVENT_MODELS``), the
adapters workers declared on them, and which of all those a live worker serves now.

Refreshed from Redis in the background (every ``refresh_s``), so that a request's check
costs no round trip: a worker that starts serving a model is known within that time, one
whose heartbeat went stale is no longer listed.
"""

from __future__ import annotations

import asyncio
import logging

from service.errors import ModelNotFound
from service.store.heartbeats import Heartbeats
from service.store.keys import model_lane
from service.store.queue import RequestQueue
from service.store.registry import Declared, ModelRegistry
from service.tokenize import ModelInfo

log = logging.getLogger(__name__)

_SHOWN = 64
_NONE = Declared()


class Catalog:
    def __init__(
        self,
        local: dict[str, ModelInfo],
        default: str,
        registry: ModelRegistry,
        heartbeats: Heartbeats,
        stale_s: float,
        refresh_s: float = 0.5,
    ) -> None:
        self.local = local
        self.default = default
        self.registry = registry
        self.heartbeats = heartbeats
        self.stale_s = stale_s
        self.refresh_s = refresh_s
        self.declared: dict[str, Declared] = {}
        self.live: frozenset[str] = frozenset()  # names a fresh heartbeat serves
        self._queues: list[RequestQueue] = []

    def follow(self, queue: RequestQueue) -> None:
        """Keep ``queue`` looking at every known model's lanes (the sweeper's)."""
        self._queues.append(queue)
        queue.lanes = self.lanes()

    async def refresh(self) -> None:
        self.declared = await self.registry.declared()
        beats = await self.heartbeats.live(self.stale_s)
        self.live = frozenset(m for b in beats for m in b.models)
        for queue in self._queues:
            queue.lanes = self.lanes()

    async def run(self) -> None:
        failing = False
        while True:
            try:
                await self.refresh()
                failing = False
            except Exception as exc:  # noqa: BLE001 - the last view stands meanwhile
                if not failing:
                    log.warning("the models' view is not refreshed: %s", exc)
                failing = True
            await asyncio.sleep(self.refresh_s)

    def base_of(self, name: str) -> str | None:
        """The model whose tokenizer a name uses: itself, or an adapter's base; ``None``
        for a name this process does not know."""
        if name in self.local:
            return name
        declared = self.declared.get(name)
        if declared is not None and declared.parent in self.local:
            return declared.parent
        return None

    def info(self, name: str | None) -> ModelInfo:
        """A request's model (``None``: the default): its tokenizer and template, or the
        404 ``model_not_found`` of a name nobody declared."""
        name = self.default if name is None else name
        base = self.base_of(name)
        if base is None:
            raise unknown_model(name)
        info = self.local[base]
        return info if info.name == name else info.renamed(name)

    def engine_of(self, name: str) -> str | None:
        """The engine a worker declared for ``name`` (None: not said, an older worker)."""
        return self.declared.get(name, _NONE).engine or None

    def sees(self, name: str) -> bool:
        """Whether the worker serving ``name`` declared it takes images."""
        return self.declared.get(name, _NONE).images

    def lanes(self) -> tuple[str, ...]:
        """Every known name's lane, and the plain queue of earlier versions ('')."""
        names = {*self.local, *self.declared}
        return ("", *sorted(model_lane(n) for n in names))

    def listed(self) -> list[tuple[str, Declared]]:
        """The names a live worker serves and this process can take, bases first."""
        out = []
        for name in sorted(self.live, key=lambda n: (self.declared.get(n, _NONE).parent or "", n)):
            if self.base_of(name) is not None:
                out.append((name, self.declared.get(name, _NONE)))
        return out


def unknown_model(name: str) -> ModelNotFound:
    shown = name[:_SHOWN] + ("..." if len(name) > _SHOWN else "")
    return ModelNotFound(
        f"the model '{shown}' does not exist", param="model", code="model_not_found"
    )
