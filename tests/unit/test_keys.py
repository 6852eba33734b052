"""The partitioned keyspace: a request's keys and its partition's queue, outbox, orphans
and wake streams share one Redis Cluster slot; partitions spread over the slot range."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from service.store.keys import MAX_PARTITIONS, Keys, partition_tags

ids = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=60).filter(
    lambda s: "{" not in s and "}" not in s
)


def slot(key: str) -> int:
    return key_slot(key.encode())


@given(rid=ids, partitions=st.integers(1, 64), prefix=st.sampled_from(["le", "t1234", "x:y"]))
def test_every_key_of_a_request_is_in_its_partitions_slot(
    rid: str, partitions: int, prefix: str
) -> None:
    keys = Keys(prefix, partitions)
    p = keys.partition(rid)
    assert 0 <= p < partitions
    one = {
        slot(k)
        for k in (
            keys.log(rid),
            keys.meta(rid),
            keys.readers(rid),
            keys.scratch(rid),
            keys.queue(p),
            keys.queue_of(rid),
            keys.outbox(p),
            keys.outbox_of(rid),
            keys.orphans(p),
            keys.orphans_of(rid),
            keys.wake(p, "proc"),
        )
    }
    assert len(one) == 1
    # and the partition is a function of the id alone: every process agrees
    assert Keys("other", partitions).partition(rid) == p


@pytest.mark.parametrize("partitions", [1, 2, 3, 6, 7, 16, 100])
def test_partition_p_lies_in_the_pth_share_of_the_slot_range(partitions: int) -> None:
    tags = partition_tags(partitions)
    assert len(set(tags)) == partitions
    for p, tag in enumerate(tags):
        s = slot(f"x:{{{tag}}}:queue")
        assert p * REDIS_CLUSTER_HASH_SLOTS // partitions <= s
        assert s < (p + 1) * REDIS_CLUSTER_HASH_SLOTS // partitions


def test_three_primaries_get_two_of_six_partitions_each() -> None:
    """What `redis-cli --cluster create` makes of three primaries: even, contiguous ranges."""
    keys = Keys("le", 6)
    ranges = [(i * 16384 // 3, (i + 1) * 16384 // 3) for i in range(3)]
    owners = [
        next(i for i, (lo, hi) in enumerate(ranges) if lo <= slot(keys.queue(p)) < hi)
        for p in keys.all_partitions
    ]
    assert sorted(owners) == [0, 0, 1, 1, 2, 2]


@given(ids)
def test_one_partition_is_partition_zero(rid: str) -> None:
    assert Keys("le", 1).partition(rid) == 0


def test_requests_spread_evenly() -> None:
    keys = Keys("le", 8)
    counts = [0] * 8
    for i in range(8000):
        counts[keys.partition(f"chatcmpl-{i:032x}")] += 1
    assert min(counts) > 800  # (1,000 each if even)


def test_admission_counters_share_a_slot() -> None:
    keys = Keys("le", 4)
    assert slot(keys.inflight("k:abc")) == slot(keys.rate("k:abc", 29_000_000))


@pytest.mark.parametrize("partitions", [0, -1, MAX_PARTITIONS + 1])
def test_a_partition_count_out_of_range_is_refused(partitions: int) -> None:
    with pytest.raises(ValueError, match="partitions"):
        Keys("le", partitions)


@given(rid=ids, partitions=st.integers(1, 64), prefix=st.sampled_from(["le", "t1234", "x:y"]))
def test_an_appends_keys_are_the_requests_own(rid: str, partitions: int, prefix: str) -> None:
    keys = Keys(prefix, partitions)
    assert keys.appended(rid) == (
        keys.meta(rid),
        keys.log(rid),
        keys.readers(rid),
        keys.scratch(rid),
        keys.tails(rid),
    )
