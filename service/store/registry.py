"""The models workers declare (``keys.models``): every name a worker ever served -- a base
model, or an adapter with its base -- so that every API process knows an adapter's base
(whose tokenizer it uses) and can tell a model it knows but nobody serves now (a 503) from
one it never heard of (a 404). Which names are served now, the heartbeats say."""

from __future__ import annotations

import time

import msgspec
from redis.asyncio import Redis

from service.store.keys import Keys, model_lane


class Declared(msgspec.Struct, frozen=True):
    """What a worker said of a name it serves."""

    parent: str | None = None  # the base model, for an adapter
    owned_by: str = "lastevent"
    created: int = 0  # unix s: when it was first declared
    engine: str = ""  # the engine serving it (what it cannot honour: ``params.UNSUPPORTED``)
    images: bool = False  # it takes images (a vision model under an engine that passes them)


_enc = msgspec.json.Encoder()
_dec = msgspec.json.Decoder(Declared)


def parse_lora_modules(spec: str) -> dict[str, str]:
    """``LASTEVENT_LORA_MODULES``, as vLLM's ``--lora-modules`` takes them:
    ``name=path,name=path`` -> {name: path}."""
    out: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, sep, path = part.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"LASTEVENT_LORA_MODULES: {part!r} is not name=path")
        if name.strip() in out:
            raise ValueError(f"LASTEVENT_LORA_MODULES: {name.strip()!r} is named twice")
        out[name.strip()] = path.strip()
    return out


class ModelRegistry:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def declare(
        self,
        base: str,
        adapters: list[str],
        owned_by: str = "lastevent",
        engine: str = "",
        images: bool = False,
    ) -> None:
        """A worker's names: its base and its adapters (the first declaration of a name
        keeps its ``created``; a later one may move an adapter to another base)."""
        now = int(time.time())
        known = await self.declared()
        for name in [base, *adapters]:
            same = [k for k in known if k != name and model_lane(k) == model_lane(name)]
            if same:  # (one in ~4 billion pairs: rename one of them)
                raise ValueError(f"the models {name!r} and {same[0]!r} share a queue lane")
        pipe = self.redis.pipeline(transaction=False)
        for name, parent in [(base, None), *((a, base) for a in adapters)]:
            old = known.get(name)
            created = old.created if old is not None else now
            said = (parent, owned_by, engine, images)
            if old is None or (old.parent, old.owned_by, old.engine, old.images) != said:
                declared = Declared(parent, owned_by, created, engine, images)
                pipe.hset(self.keys.models, name, _enc.encode(declared))
        await pipe.execute()

    async def declared(self) -> dict[str, Declared]:
        raw = await self.redis.hgetall(self.keys.models)
        out = {}
        for name, data in raw.items():
            try:
                out[name.decode() if isinstance(name, bytes) else name] = _dec.decode(data)
            except msgspec.DecodeError:
                continue  # (not ours)
        return out
