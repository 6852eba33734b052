"""Every Redis key the project uses, and the field names of its stream entries.

Per-request keys share the hash tag ``{<request id>}`` so that a request's log
and meta live in one Redis Cluster slot (the Lua scripts touch both). Units are
in the names.
"""

from __future__ import annotations

import dataclasses

QUEUE_GROUP = "workers"  # the consumer group every worker joins
EVENT_FIELD = b"e"  # the one field of each log entry: a msgpack-encoded event
RECORDER_GROUP = "recorders"  # the consumer group that projects the outbox into Postgres
SUMMARY_FIELD = b"s"  # outbox entry: a msgpack-encoded Summary of the ended request
END_ID_FIELD = b"i"  # outbox entry: the terminal event's id
JOB_FIELD = b"j"  # the one field of each queue entry: a msgpack-encoded job


def principal(tenant: str, key_id: str | None) -> str:
    """What per-key limits are counted against: the key, or the tenant when there is none."""
    return f"k:{key_id}" if key_id else f"t:{tenant}"


@dataclasses.dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "le"

    @property
    def queue(self) -> str:
        """The request queue (a stream; consumer group ``workers``)."""
        return f"{self.prefix}:queue"

    def log(self, request_id: str) -> str:
        """The request's event log (a stream)."""
        return f"{self.prefix}:{{{request_id}}}:log"

    def meta(self, request_id: str) -> str:
        """The request's control hash: owner epoch, owner, state, last event id, cancel flag,
        resume grace (ms), detached flag, when the last reader left (ms), tokens delivered."""
        return f"{self.prefix}:{{{request_id}}}:meta"

    @property
    def orphans(self) -> str:
        """Started requests queued again for another worker to continue (a takeover or a
        handover): a sorted set, request id -> when to stop waiting for a worker (ms)."""
        return f"{self.prefix}:orphans"

    @property
    def outbox(self) -> str:
        """Terminal summaries, appended atomically with each terminal event (a stream;
        consumer group ``recorders``)."""
        return f"{self.prefix}:outbox"

    def scratch(self, request_id: str) -> str:
        """Where a terminal script copies the finished log to right-size it (never left set)."""
        return f"{self.prefix}:{{{request_id}}}:scratch"

    def readers(self, request_id: str) -> str:
        """The request's reader leases: a sorted set of reader tokens scored by expiry (ms)."""
        return f"{self.prefix}:{{{request_id}}}:readers"

    def control(self, worker_id: str) -> str:
        """A worker's pub/sub channel: ``cancel:<request id>`` / ``check:<request id>``."""
        return f"{self.prefix}:ctl:{worker_id}"

    @property
    def workers(self) -> str:
        """Worker heartbeats: worker id -> "<slots> <busy> <unix ms> <mean service ms>"."""
        return f"{self.prefix}:workers"

    def inflight_of(self, tenant: str, key_id: str | None) -> str:
        """The in-flight set a request of this tenant and key counts against."""
        return self.inflight(principal(tenant, key_id))

    def inflight(self, principal: str) -> str:
        """A key's (or tenant's) requests in flight: request id -> expiry (ms)."""
        return f"{self.prefix}:inflight:{principal}"

    def rate(self, principal: str, minute: int) -> str:
        """A key's (or tenant's) request count in one wall-clock minute."""
        return f"{self.prefix}:rate:{principal}:{minute}"

    @property
    def stream_token_secret(self) -> str:
        """The secret stream tokens are signed with, made once and shared by every API
        process (when LASTEVENT_STREAM_TOKEN_SECRET is not set)."""
        return f"{self.prefix}:stream-token-secret"

    def idempotency(self, principal: str, key: str) -> str:
        """An ``Idempotency-Key`` of a key (or tenant): "<request id> <body digest>"."""
        return f"{self.prefix}:idem:{principal}:{key}"

    def wake(self, process_id: str) -> str:
        """A per-API-process stream used to wake its multiplexed XREAD BLOCK."""
        return f"{self.prefix}:wake:{process_id}"
