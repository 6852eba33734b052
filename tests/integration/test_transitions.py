"""The request state machine as the Lua scripts run it, against its table.

``lifecycle.TRANSITIONS`` says, for every state (none, queued, running, and the four
terminal ones) and every step a script takes, which states it may leave the request in;
a pair it does not name is refused. Here every script runs from every state in a real
Redis: a step the table allows must be accepted and end in one of its states; any
other must be refused and change nothing. The scripts that take no step (check, lease,
leave, resumed, follow) must change no state at all.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable

import pytest
from redis.asyncio import Redis

from service.settings import Settings
from service.store import replies, scripts
from service.store.keys import Keys
from service.store.log import Fenced, LogError, Owner, RedisLog, RequestExists
from service.store.owner import OwnerChannel
from service.store.queue import Job, RequestQueue, encode_job
from service.store.readers import Presence, Readers
from service.stream import endings
from service.stream import events as ev
from service.stream.lifecycle import TERMINAL_STATES, TRANSITIONS, Meta, Requeue, State, Step
from service.stream.params import SamplingParams

DEFAULTS = Settings()  # the numbers a process takes unless told (LASTEVENT_*)
LEASES = {"lease_ttl_s": DEFAULTS.lease_ttl_s, "refresh_s": DEFAULTS.lease_refresh_s}

pytestmark = pytest.mark.timeout(60)

STATES: list[State | None] = [None, *State]
FIRST = ev.Created(kind="chat", model="m", created=0, prompt_tokens=2)


class Request:
    """One request, brought to a state by the scripts themselves."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self.log = RedisLog(redis, keys)
        self.queue = RequestQueue(redis, keys)
        self.readers = Readers(redis, keys)
        self.owner = OwnerChannel(redis, keys)
        self.rid = f"chatcmpl-{uuid.uuid4().hex}"
        self.entry = b""

    async def make(self, state: State | None) -> None:
        await self.queue.ensure_group()
        if state is None:
            return
        job = encode_job(Job(self.rid, [1, 2], SamplingParams(max_tokens=4)))
        await self.log.create(self.rid, FIRST, 60, job=job)
        self.entry = replies.text(await self.redis.hget(self.keys.meta(self.rid), Meta.ENTRY))
        if state == State.QUEUED:
            return
        if state == State.CANCELLED:  # a queued request's cancel
            assert (await self.log.cancel(self.rid, queued(self.rid))).outcome == state
            return
        owner = await self.log.claim(self.rid, "w1", self.entry)
        assert owner is not None
        if state == State.PARKED:  # (no reader: the request was created without a lease)
            assert (await self.log.park(owner, self.entry, 0)).window_ms is not None
        if state in TERMINAL_STATES:
            await self.log.append(
                self.rid, owner.epoch, [end(state)], terminal_state=state, ttl_s=60
            )

    async def state(self) -> State | None:
        raw = await self.redis.hget(self.keys.meta(self.rid), Meta.STATE)
        return None if raw is None else State(replies.text(raw))

    async def epoch(self) -> int:
        return replies.integer(await self.redis.hget(self.keys.meta(self.rid), Meta.EPOCH) or 0)


def end(state: State) -> ev.End:
    reason = {State.FINISHED: "stop", State.CANCELLED: "cancelled", State.ABANDONED: "abandoned"}
    return ev.End(state, reason.get(state), 2, 0)  # type: ignore[arg-type]


def queued(rid: str) -> endings.Ending:
    return endings.cancelled_queued(endings.Request(rid, None, 2, 0))


# each step: the script's call from a request's state; True: accepted, False: refused
async def create(r: Request) -> bool:
    other = ev.Created(kind="text", model="m", created=1, prompt_tokens=3)
    try:
        await r.log.create(r.rid, other, 60)
    except RequestExists:
        return False
    return True


async def claim(r: Request) -> bool:
    return await r.log.claim(r.rid, "w2", r.entry) is not None


async def append(r: Request) -> bool:
    delta = ev.Delta(text="x", token_ids=[5], n=1)
    try:  # as the request's owner (whatever epoch it has): only the state may refuse
        await r.log.append(r.rid, await r.epoch(), [delta])
    except LogError:
        return False
    return True


def ending(state: State) -> Callable[[Request], Awaitable[bool]]:
    async def step(r: Request) -> bool:
        try:
            await r.log.append(r.rid, await r.epoch(), [end(state)], terminal_state=state, ttl_s=60)
        except LogError:
            return False
        return True

    return step


async def cancel(r: Request) -> bool:
    meta = await r.log.meta(r.rid)
    parked = endings.cancelled_parked(endings.Request(r.rid, None, 2, 0), 0)
    outcome = await r.log.cancel(r.rid, queued(r.rid), (parked, meta.events if meta else 0))
    # ended here (with its end's id), or flagged for its owner; else it answers the state
    return outcome.outcome == "cancelling" or (
        outcome.outcome == State.CANCELLED and outcome.detail is not None
    )


async def requeue(r: Request) -> bool:
    done = await r.queue.requeue(r.rid, r.entry, Requeue.LOST, max_takeovers=5)
    return done.entry_id is not None


async def park(r: Request) -> bool:
    try:  # as the request's owner (whatever epoch it has): only the state may refuse
        return (
            await r.log.park(Owner(r.rid, await r.epoch(), 0), r.entry, 0)
        ).window_ms is not None
    except Fenced:
        return False


async def unpark(r: Request) -> bool:
    """A reader comes (back) to it: the lease's script goes on with a parked request."""
    return (await Presence(r.readers, **LEASES).acquire(r.rid)).unparked


STEPS = [
    pytest.param(Step.CREATE, None, create, id="create"),
    pytest.param(Step.CLAIM, None, claim, id="claim"),
    pytest.param(Step.APPEND, None, append, id="append"),
    *(pytest.param(Step.END, s, ending(s), id=f"end-{s}") for s in sorted(TERMINAL_STATES)),
    pytest.param(Step.CANCEL, None, cancel, id="cancel"),
    pytest.param(Step.REQUEUE, None, requeue, id="requeue"),
    pytest.param(Step.PARK, None, park, id="park"),
    pytest.param(Step.UNPARK, None, unpark, id="unpark"),
]


@pytest.mark.parametrize("before", STATES, ids=str)
@pytest.mark.parametrize(("step", "to", "run"), STEPS)
async def test_every_step_from_every_state_follows_the_table(
    redis_url: str,
    key_prefix: str,
    before: State | None,
    step: Step,
    to: State | None,
    run: Callable[[Request], Awaitable[bool]],
) -> None:
    redis = Redis.from_url(redis_url)
    try:
        r = Request(redis, Keys(key_prefix))
        await r.make(before)
        assert await r.state() == before
        allowed = TRANSITIONS.get((before, step), frozenset())
        if to is not None:  # the terminal append names the state it goes to
            allowed = allowed & {to}
        accepted = await run(r)
        after = await r.state()
        if allowed:
            assert accepted, f"{step} from {before} was refused"
            assert after in allowed, f"{step} from {before} left it {after}"
        else:
            assert not accepted, f"{step} from {before} was accepted (the table refuses it)"
            assert after == before, f"a refused {step} from {before} changed it to {after}"
    finally:
        await redis.aclose()


@pytest.mark.parametrize("before", STATES, ids=str)
async def test_the_other_scripts_change_no_state(
    redis_url: str, key_prefix: str, before: State | None
) -> None:
    redis = Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    try:
        r = Request(redis, keys)
        await r.make(before)
        await r.owner.check([r.rid], park_after_ms=0)  # owner_verdicts.lua
        if before != State.PARKED:  # (lease_and_unpark.lua's unpark is a step of the table: above)
            lease = await Presence(r.readers, **LEASES).acquire(r.rid)  # lease_and_unpark.lua
            await lease.release()  # leave.lua
        with contextlib.suppress(Fenced):  # record_resume.lua: only a running request's owner
            await r.log.resumed(Owner(r.rid, await r.epoch(), 0), 3)
        follow = scripts.register(redis, "follow")
        wake = keys.wake(keys.partition(r.rid), "t")
        await follow(keys=[wake, keys.meta(r.rid), keys.tails(r.rid), keys.log(r.rid)], args=[1])
        assert await r.state() == before
    finally:
        await redis.aclose()
