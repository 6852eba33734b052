"""The Lua side of the state machine is the Python side: the prelude that every script
gets, evaluated by a real Redis, names the same states, verdicts, meta fields and entry
fields as ``service/stream/lifecycle.py`` and ``service/store/keys.py``."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from service.store import replies, scripts
from service.store.keys import END_ID_FIELD, EVENT_FIELD, JOB_FIELD, SUMMARY_FIELD, Keys
from service.store.log import RedisLog
from service.stream import endings
from service.stream import events as ev
from service.stream.lifecycle import TERMINAL_STATES, Meta, State, Verdict

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def lua(redis: Redis, expression: str) -> list[str]:
    reply = await redis.eval(scripts.prelude() + f"return {expression}", 0)
    return replies.texts(reply)


async def test_states_verdicts_and_fields_are_the_same_in_lua(redis: Redis) -> None:
    names = ", ".join(f"S.{s.name}" for s in State)
    assert await lua(redis, f"{{{names}}}") == [s.value for s in State]
    meta = ", ".join(f"M.{m.name.lower()}" for m in Meta)
    assert await lua(redis, f"{{{meta}}}") == [m.value for m in Meta]
    verdicts = ", ".join(f"V.{v.name}" for v in Verdict)
    assert [int(v) for v in await lua(redis, f"{{{verdicts}}}")] == [v.value for v in Verdict]
    fields = await lua(redis, "{F.event, F.summary, F.end_id, F.job}")
    assert fields == [f.decode() for f in (EVENT_FIELD, SUMMARY_FIELD, END_ID_FIELD, JOB_FIELD)]
    for state in State:
        terminal = await redis.eval(
            scripts.prelude() + "if TERMINAL[ARGV[1]] then return 1 end return 0", 0, state.value
        )
        assert bool(terminal) == (state in TERMINAL_STATES), state


async def test_the_scripts_write_the_python_names(redis: Redis, key_prefix: str) -> None:
    """What create/claim/cancel write into the meta hash reads back as ``Meta``/``State``."""
    keys = Keys(key_prefix)
    log = RedisLog(redis, keys)
    rid = uuid.uuid4().hex
    try:
        first = ev.Created(kind="chat", model="m", created=0, prompt_tokens=1)
        await log.create(rid, first, 60)
        raw = await redis.hgetall(keys.meta(rid))
        assert {replies.text(k) for k in raw} <= {m.value for m in Meta}
        assert replies.text(replies.field(raw, Meta.STATE)) == State.QUEUED
        queued = endings.cancelled_queued(endings.Request(rid, None, 1, 0))
        outcome = await RedisLog(redis, keys).cancel(rid, queued)
        assert outcome.outcome == State.CANCELLED
        meta = await log.meta(rid)
        assert meta is not None and meta.state == State.CANCELLED
    finally:
        await redis.delete(keys.meta(rid), keys.log(rid), keys.outbox(0), keys.readers(rid))
