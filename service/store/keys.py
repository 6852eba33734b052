"""Every Redis key the project uses, and the field names of its stream entries.

Requests are spread over ``partitions`` (``LASTEVENT_PARTITIONS``; 1 by default): a
request's partition is a hash of its id, and every key of a partition -- its requests'
logs, metas, reader leases, and the partition's queue, outbox, orphans and wake streams
-- carries the partition's hash tag, so that it lives in one Redis Cluster slot. Each
Lua script touches one partition only, a worker's flush is one script call per
partition it writes to, and an API process tails each partition with one ``XREAD``.
The tags are chosen so that partition ``p`` of ``P`` hashes into the ``p``-th ``P``-th of
the slot range: a cluster made with ``--cluster create`` (contiguous, even slot ranges)
gets the partitions spread evenly over its primaries. A key's admission counters share
a tag of their own (``admit.lua`` touches both). Units are in the names.

The partition count must be the same in every process of a deployment, and changed
only with no request in flight (a request's keys are found by its partition).

Each model (a base model or an adapter, by the name requests give) has a queue of its own
in every partition, named by its *lane* (``model_lane``: 8 hex digits of a hash of the
name), and a request id carries its model's lane (``lane_of``), so that every process
finds a request's queue from its id alone, as it finds its partition. Only workers that
serve a model read its lanes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import re
import zlib

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

QUEUE_GROUP = "workers"  # the consumer group every worker joins
EVENT_FIELD = b"e"  # the one field of each log entry: a msgpack-encoded event
RECORDER_GROUP = "recorders"  # the consumer group that projects the outbox into Postgres
SUMMARY_FIELD = b"s"  # outbox entry: a msgpack-encoded Summary of the ended request
END_ID_FIELD = b"i"  # outbox entry: the terminal event's id
JOB_FIELD = b"j"  # the one field of each queue entry: a msgpack-encoded job
LOG_FIELD = b"k"  # a tail shard's wake entry: the log key that changed (none: just a wake)
# A wake stream whose name ends so takes one entry per script call naming every log it
# changed (``LOG_FIELD`` repeated); any other (an older API process's shard) one per log.
WAKE_BATCHED = ":batched"
# A partition's takeover queue is its queue's key plus this: the jobs queued again (a lost
# or stopping worker's, a parked request's continuation), read ahead of fresh work. Its
# entries are named ``TAKEOVER_ENTRY + <stream id>`` wherever an entry is kept or passed
# (the meta hash, the scripts, a worker's acks), so that an entry says which queue it is in.
TAKEOVERS_SUFFIX = ":takeovers"
TAKEOVER_ENTRY = b"t:"


MAX_PARTITIONS = 1024

LANE_MARK = "m"  # a request id whose body starts with it carries a lane: m<lane><random>
LANE_DIGITS = 8
_LANED = re.compile(rf"(?:chatcmpl-|cmpl-|resp_){LANE_MARK}([0-9a-f]{{{LANE_DIGITS}}})")


@functools.cache
def model_lane(model: str) -> str:
    """A model's lane: the part of its queues' names (and of its requests' ids) that is
    the model's; the same in every process."""
    return hashlib.blake2b(model.encode(), digest_size=LANE_DIGITS // 2).hexdigest()


def lane_of(request_id: str) -> str:
    """The lane a request id carries ('' for an id without one: its queue is the
    partition's plain one)."""
    found = _LANED.match(request_id)
    return found.group(1) if found else ""


@functools.cache
def partition_tags(partitions: int) -> tuple[str, ...]:
    """Partition ``p``'s hash tag: the first ``p<p>.<n>`` whose slot is in the ``p``-th
    ``partitions``-th of the slot range."""
    if not 1 <= partitions <= MAX_PARTITIONS:
        raise ValueError(f"partitions must be 1..{MAX_PARTITIONS}, not {partitions}")
    tags = []
    for p in range(partitions):
        lo = p * REDIS_CLUSTER_HASH_SLOTS // partitions
        hi = (p + 1) * REDIS_CLUSTER_HASH_SLOTS // partitions
        n = 0
        while not lo <= key_slot(f"p{p}.{n}".encode()) < hi:
            n += 1
        tags.append(f"p{p}.{n}")
    return tuple(tags)


def principal(tenant: str, key_id: str | None) -> str:
    """What per-key limits are counted against: the key, or the tenant when there is none."""
    return f"k:{key_id}" if key_id else f"t:{tenant}"


@dataclasses.dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "le"
    partitions: int = 1

    def __post_init__(self) -> None:
        partition_tags(self.partitions)  # (validates the count)

    @property
    def all_partitions(self) -> range:
        return range(self.partitions)

    def partition(self, request_id: str) -> int:
        """The partition a request's keys live in."""
        if self.partitions == 1:
            return 0
        return zlib.crc32(request_id.encode()) % self.partitions

    def _p(self, partition: int) -> str:
        return f"{self.prefix}:{{{partition_tags(self.partitions)[partition]}}}"

    def _r(self, request_id: str) -> str:
        return f"{self._p(self.partition(request_id))}:r:{request_id}"

    def queue(self, partition: int, lane: str = "") -> str:
        """A partition's request queue of one lane (a stream; consumer group ``workers``)."""
        return f"{self._p(partition)}:queue" + (f":{lane}" if lane else "")

    def queue_of(self, request_id: str) -> str:
        return self.queue(self.partition(request_id), lane_of(request_id))

    def queues(self, partition: int, lane: str = "") -> tuple[str, str]:
        """A partition's takeover queue and its queue of one lane, in the order workers
        read them."""
        return self.takeovers(partition, lane), self.queue(partition, lane)

    def takeovers(self, partition: int, lane: str = "") -> str:
        """A partition's takeover queue of one lane (a stream; the same group):
        continuations and jobs queued again, read before the lane's queue."""
        return f"{self.queue(partition, lane)}{TAKEOVERS_SUFFIX}"

    def takeovers_of(self, request_id: str) -> str:
        return self.takeovers(self.partition(request_id), lane_of(request_id))

    def appended(self, request_id: str) -> tuple[str, str, str, str, str]:
        """The keys an append writes (``append.lua``'s, per request): meta, log, readers,
        scratch, tails -- the request's prefix worked out once (a worker's flush names
        them for every request it runs)."""
        r = self._r(request_id)
        return f"{r}:meta", f"{r}:log", f"{r}:readers", f"{r}:scratch", f"{r}:tails"

    def log(self, request_id: str) -> str:
        """The request's event log (a stream)."""
        return f"{self._r(request_id)}:log"

    def meta(self, request_id: str) -> str:
        """The request's control hash: owner epoch, owner, state, last event id, cancel flag,
        resume grace (ms), detached flag, when the last reader left (ms), tokens delivered."""
        return f"{self._r(request_id)}:meta"

    def orphans(self, partition: int) -> str:
        """A partition's started requests queued again for another worker to continue (a
        takeover or a handover): a sorted set, request id -> when to stop waiting (ms)."""
        return f"{self._p(partition)}:orphans"

    def orphans_of(self, request_id: str) -> str:
        return self.orphans(self.partition(request_id))

    def parked(self, partition: int) -> str:
        """Parked requests of the partition (sorted set: request id -> when its resume
        window is over, ms): the sweeper ends them abandoned then."""
        return f"{self._p(partition)}:parked"

    def parked_of(self, request_id: str) -> str:
        return self.parked(self.partition(request_id))

    def parking(self, request_id: str) -> list[str]:
        """The keys of parking a request and of taking it back (``park.lua``'s and
        ``lease_and_unpark.lua``'s KEYS, in order: all in its partition's slot)."""
        return [
            self.meta(request_id),
            self.readers(request_id),
            self.queue_of(request_id),
            self.parked_of(request_id),
            self.log(request_id),
            self.tails(request_id),
            self.orphans_of(request_id),
        ]

    def outbox(self, partition: int) -> str:
        """A partition's terminal summaries, appended atomically with each terminal event
        (a stream; consumer group ``recorders``)."""
        return f"{self._p(partition)}:outbox"

    def outbox_of(self, request_id: str) -> str:
        return self.outbox(self.partition(request_id))

    def commit(self, partition: int) -> str:
        """A counter in the partition's slot that readers bump as a commit barrier
        (``commit.py``): what they read before it is committed once it is."""
        return f"{self._p(partition)}:commit"

    def scratch(self, request_id: str) -> str:
        """Where a terminal script copies the finished log to right-size it (never left set)."""
        return f"{self._r(request_id)}:scratch"

    def readers(self, request_id: str) -> str:
        """The request's reader leases: a sorted set of reader tokens scored by expiry (ms)."""
        return f"{self._r(request_id)}:readers"

    def tails(self, request_id: str) -> str:
        """The tail shards following the request's log: a set of their wake streams, each
        of which every append to the log notifies (so a shard reads only changed logs)."""
        return f"{self._r(request_id)}:tails"

    def control(self, worker_id: str) -> str:
        """A worker's pub/sub channel: ``cancel:<request id>`` / ``check:<request id>``."""
        return f"{self.prefix}:ctl:{worker_id}"

    @property
    def workers(self) -> str:
        """Worker heartbeats: worker id -> its ``Heartbeat`` (``queue.py``)."""
        return f"{self.prefix}:workers"

    @property
    def models(self) -> str:
        """Every model a worker ever declared: name -> JSON (its base for an adapter, who
        owns it, when first seen). Which of them are served now, the heartbeats say."""
        return f"{self.prefix}:models"

    def alive(self, worker_id: str) -> str:
        """The sharded pub/sub channel a worker's named connection subscribes to while it
        lives: in the heartbeats' slot (the hash tag is that key's name), so the node that
        holds the heartbeats counts its subscribers (``store/liveness.py``)."""
        return f"{{{self.workers}}}:alive:{worker_id}"

    def inflight_of(self, tenant: str, key_id: str | None) -> str:
        """The in-flight set a request of this tenant and key counts against."""
        return self.inflight(principal(tenant, key_id))

    def inflight(self, principal: str) -> str:
        """A key's (or tenant's) requests in flight: request id -> expiry (ms). Freed at a
        request's end by the process that wrote the end, and again by the recorder (the
        writer may die in between); an entry lapses at its expiry at the latest."""
        return f"{self.prefix}:{{a:{principal}}}:inflight"

    def rate(self, principal: str, minute: int) -> str:
        """A key's (or tenant's) request count in one wall-clock minute."""
        return f"{self.prefix}:{{a:{principal}}}:rate:{minute}"

    @property
    def stream_token_secret(self) -> str:
        """The secret stream tokens are signed with, made once and shared by every API
        process (when LASTEVENT_STREAM_TOKEN_SECRET is not set)."""
        return f"{self.prefix}:stream-token-secret"

    def idempotency(self, principal: str, key: str) -> str:
        """An ``Idempotency-Key`` of a key (or tenant): "<request id> <body digest>"."""
        return f"{self.prefix}:idem:{principal}:{key}"

    def wake(self, partition: int, process_id: str) -> str:
        """A stream of one tail shard of an API process, in the partition the shard follows:
        appends to the logs it follows add the log's key (``LOG_FIELD``), a new reader an
        entry that just wakes its ``XREAD BLOCK``. (Named ``WAKE_BATCHED``: an append that
        changes many of its logs adds one entry naming them all.)"""
        return f"{self._p(partition)}:wake:{process_id}{WAKE_BATCHED}"
