"""The owner's watch over its running requests: cancels and readers that left.

Three ways a decision reaches the runner: a periodic check of every running request
(one pipelined round trip, every ``presence_check_s``), a message on the worker's
control channel (a cancel, or "the last reader just left"), and a timer set for the
moment a reader-less request is to be parked (or abandoned, when its resume window is
no longer than the park delay). ``owner_verdicts.lua`` answers; the
pure ``decide.plan`` says what the answer asks for; ``Runner.decide`` acts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection

from service.store.owner import OwnerChannel
from service.store.pool import STORE_ERRORS, survived
from service.stream.lifecycle import State
from workers.decide import Abort, RecheckIn, plan

log = logging.getLogger(__name__)


class OwnerWatch:
    def __init__(
        self,
        owner: OwnerChannel,
        worker_id: str,
        *,
        check_s: float,
        park_after_s: float = -1,
        silent_s: float,  # (Settings' redis_silent_s)
        undecided: Callable[[], Collection[str]],
        decide: Callable[[str, State], None],
    ) -> None:
        """``undecided()``: the running requests with no decision yet; ``decide``: abort one."""
        self.owner = owner
        self.worker_id = worker_id
        self.check_s = check_s
        self.silent_s = silent_s  # the control channel's node may be silent this long
        self.park_after_ms = -1 if park_after_s < 0 else int(park_after_s * 1000)
        self._undecided = undecided
        self._decide = decide
        self._timers: dict[str, asyncio.TimerHandle] = {}  # grace periods running out
        self._checks: set[asyncio.Task[None]] = set()

    def tasks(self) -> list[asyncio.Task[None]]:
        return [
            asyncio.create_task(self._poll(), name="presence-check"),
            asyncio.create_task(self._listen(), name="control"),
        ]

    def forget(self, rid: str) -> None:
        """``rid`` left the engine: no timer for it any more."""
        timer = self._timers.pop(rid, None)
        if timer is not None:
            timer.cancel()

    def act_on(self, rid: str, verdict: int) -> None:
        action = plan(verdict)
        if isinstance(action, Abort):
            self._decide(rid, action.state)
        elif isinstance(action, RecheckIn) and rid not in self._timers:
            loop = asyncio.get_running_loop()
            self._timers[rid] = loop.call_later(action.seconds, self._recheck, rid)

    async def check_one(self, rid: str) -> None:
        try:
            verdict = (await self.owner.check([rid], self.park_after_ms)).get(rid, 0)
        except STORE_ERRORS as exc:
            log.warning("presence check of %s failed: %s", rid, exc)
            return
        self.act_on(rid, verdict)

    def _recheck(self, rid: str) -> None:
        self._timers.pop(rid, None)
        if rid in self._undecided():
            task = asyncio.create_task(self.check_one(rid))
            self._checks.add(task)
            task.add_done_callback(self._checks.discard)

    async def _poll(self) -> None:
        """Every ``check_s``: one round trip asks about all running requests."""
        while True:
            await asyncio.sleep(self.check_s)
            try:
                verdicts = await self.owner.check(list(self._undecided()), self.park_after_ms)
            except Exception as exc:  # noqa: BLE001 - the watch must go on
                survived("a presence check", exc)
                continue
            for rid, verdict in verdicts.items():
                self.act_on(rid, verdict)

    async def _listen(self) -> None:
        """Cancels (and nudges) published to this worker's channel, acted on at once."""
        async for verb, rid in self.owner.messages(self.worker_id, silent_s=self.silent_s):
            if verb == "cancel":
                self._decide(rid, State.CANCELLED)
            elif verb == "check" and rid in self._undecided():
                await self.check_one(rid)
