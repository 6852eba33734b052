"""Failed credentials per client address (the authenticator's throttle), over generated
sequences of failures and checks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from service.api.throttle import FailureLimit

STEPS = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c"]), st.floats(0, 30), st.booleans()), max_size=200
)


@given(st.integers(1, 20), STEPS)
def test_an_address_is_refused_only_after_its_own_failures_fill_a_minute(
    per_minute: int, steps: list[tuple[str, float, bool]]
) -> None:
    limit = FailureLimit(per_minute)
    now = 0.0
    failures: dict[str, list[float]] = {}
    for address, dt, fails in steps:
        now += dt
        wait = limit.retry_after(address, now)
        own = failures.get(address, [])
        window = [t for t in own if t >= own_window_start(own, now)]
        if len(window) < per_minute:
            assert wait == 0
        else:
            assert 1 <= wait <= 60
        if fails and wait == 0:
            limit.failed(address, now)
            failures.setdefault(address, []).append(now)


def own_window_start(times: list[float], now: float) -> float:
    """The start of the address's current fixed window (the model's own bookkeeping)."""
    start = None
    for t in times:
        if start is None or t - start >= 60:
            start = t
    return now + 1 if start is None or now - start >= 60 else start


def test_zero_is_unlimited_and_addresses_are_bounded() -> None:
    assert FailureLimit(0).retry_after("a", 0) == 0
    limit = FailureLimit(1, max_addresses=3)
    for i in range(10):
        limit.failed(f"10.0.0.{i}", 0)
    assert limit.retry_after("10.0.0.9", 1) > 0
    assert limit.retry_after("10.0.0.0", 1) == 0  # forgotten: the oldest go first
    assert len(limit._windows) == 3
