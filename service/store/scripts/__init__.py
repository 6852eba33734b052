"""The Lua scripts, and the one loader that gives them their names.

Every script is a package file here, ``<name>.lua``, with its typed face beside it,
``<name>.py``: the one place that builds its KEYS and ARGV and decodes its reply (into
its enum of ``codes.py``, or a small frozen struct). Only a face runs its script
(``tests/unit/test_layout.py`` fails otherwise). ``register`` prepends a prelude: the
request states, verdicts and meta-hash fields from ``service/stream/lifecycle.py``, the
reply codes from ``codes.py`` and the entry field names from ``service/store/keys.py``,
so a script never spells one of them itself (the layout test fails if it does).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from importlib import resources
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from service.store.keys import (
    END_ID_FIELD,
    EVENT_FIELD,
    JOB_FIELD,
    LOG_FIELD,
    QUEUE_GROUP,
    SUMMARY_FIELD,
    TAKEOVER_ENTRY,
    TAKEOVERS_SUFFIX,
    WAKE_BATCHED,
)
from service.store.scripts.codes import lua_table
from service.stream.lifecycle import lua_prelude

WAKE_MAXLEN = 10_000  # entries of a tail shard's wake stream, at most (about)

NAMES = (
    "admit",
    "append",
    "cancel",
    "claim",
    "create",
    "follow",
    "lease_and_unpark",
    "leave",
    "owner_verdicts",
    "park",
    "record_resume",
    "requeue",
    "unbind_idempotency",
)


@functools.cache
def prelude() -> str:
    fields = {
        "event": EVENT_FIELD,
        "summary": SUMMARY_FIELD,
        "end_id": END_ID_FIELD,
        "job": JOB_FIELD,
        "log": LOG_FIELD,
    }
    table = ", ".join(f"{name}='{value.decode()}'" for name, value in fields.items())
    group = (
        f"local QUEUE_GROUP = '{QUEUE_GROUP}'\nlocal WAKE_MAXLEN = {WAKE_MAXLEN}\n"
        f"local WAKE_BATCHED = '{WAKE_BATCHED}'\n"
    )
    takeovers = (
        f"local TAKEOVERS = '{TAKEOVERS_SUFFIX}'\n"
        f"local TAKEOVER_ENTRY = '{TAKEOVER_ENTRY.decode()}'\n"
    )
    return (
        lua_prelude()
        + lua_table()
        + f"local F = {{{table}}}\n"
        + group
        + takeovers
        + NOTIFY
        + ENTRIES
    )


# Tell the tail shards following a log that it changed: each shard's wake stream gets the
# log's key (``keys.py``: ``tails``, ``wake``). The wake streams are in the log's slot but
# not in KEYS (the caller cannot know them). A stream that is gone (its API process died,
# its TTL ran out) is forgotten rather than made again without a TTL (NOMKSTREAM). The cap
# bounds a stream whose shard fell behind or stopped; a shard makes up with its sweep.
# A script that changes many logs notes each (``wake_note``) and sends once
# (``wake_send``): one entry per wake stream naming all of its logs (``WAKE_BATCHED``
# streams; an older shard's stream, one entry per log) -- not one XADD per token.
WAKE_LOGS_PER_ENTRY = 1000
NOTIFY = f"""local function wakes() return {{order = {{}}, by = {{}}}} end
local function wake_note(w, tails_key, log_key)
  for _, wake in ipairs(redis.call('SMEMBERS', tails_key)) do
    local e = w.by[wake]
    if not e then
      e = {{logs = {{}}, tails = {{}}}}
      w.by[wake] = e
      w.order[#w.order + 1] = wake
    end
    e.logs[#e.logs + 1] = log_key
    e.tails[#e.tails + 1] = tails_key
  end
end
local function wake_add(wake, logs, from, to)
  local args = {{}}
  for i = from, to do
    args[#args + 1] = F.log
    args[#args + 1] = logs[i]
  end
  return redis.call('XADD', wake, 'NOMKSTREAM', 'MAXLEN', '~', WAKE_MAXLEN, '*', unpack(args))
end
local function wake_send(w)
  for _, wake in ipairs(w.order) do
    local e = w.by[wake]
    local per = 1
    if string.sub(wake, -#WAKE_BATCHED) == WAKE_BATCHED then per = {WAKE_LOGS_PER_ENTRY} end
    for from = 1, #e.logs, per do
      if not wake_add(wake, e.logs, from, math.min(from + per - 1, #e.logs)) then
        for _, tails_key in ipairs(e.tails) do redis.call('SREM', tails_key, wake) end
        break
      end
    end
  end
end
local function notify(tails_key, log_key)
  local w = wakes()
  wake_note(w, tails_key, log_key)
  wake_send(w)
end
"""


# A queue entry as the meta hash and callers name it: ``<id>`` in the partition's queue,
# ``t:<id>`` in its takeover queue (``keys.py``). ``entry_in`` finds it; ``requeue_job``
# adds a job to the takeover queue and returns its name.
ENTRIES = """local function entry_in(queue_key, entry)
  local n = #TAKEOVER_ENTRY
  if string.sub(entry, 1, n) == TAKEOVER_ENTRY then
    return queue_key .. TAKEOVERS, string.sub(entry, n + 1)
  end
  return queue_key, entry
end
local function job_of(queue_key, entry)
  local key, id = entry_in(queue_key, entry)
  local old = redis.call('XRANGE', key, id, id)[1]
  if not old then return nil end
  for i = 1, #old[2], 2 do
    if old[2][i] == F.job then return old[2][i + 1] end
  end
  return nil
end
local function ack_entry(queue_key, entry)
  local key, id = entry_in(queue_key, entry)
  redis.call('XACK', key, QUEUE_GROUP, id)
  redis.call('XDEL', key, id)
end
local function requeue_job(queue_key, job)
  return TAKEOVER_ENTRY .. redis.call('XADD', queue_key .. TAKEOVERS, '*', F.job, job)
end
"""


def body(name: str) -> str:
    """The script as written (without the prelude)."""
    return resources.files(__name__).joinpath(f"{name}.lua").read_text()


def source(name: str) -> str:
    """The script as Redis runs it."""
    return prelude() + body(name)


def register(redis: Redis, name: str) -> AsyncScript:
    return redis.register_script(source(name))


async def run_pipelined(
    redis: Redis, script: AsyncScript, calls: Sequence[tuple[Sequence[str], Sequence[Any]]]
) -> list[Any]:
    """EVALSHA each call in one pipeline (one round trip); load the script once if Redis
    lost it (a restart, ``SCRIPT FLUSH``). Raises the first error of any call."""
    results: list[Any] = []
    for _attempt in range(2):
        pipe = redis.pipeline(transaction=False)
        for keys, args in calls:
            # (as a plain command: a cluster pipeline refuses ``evalsha()``, but routes the
            # command by its keys, all of one slot)
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        results = list(await pipe.execute(raise_on_error=False))
        if not any(isinstance(r, NoScriptError) for r in results):
            break
        await redis.script_load(script.script)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return results
