"""The one retry policy for store calls (``service/store/pool.py``: ``Backoff``)."""

from __future__ import annotations

from service.store.pool import Backoff


def test_waits_double_up_to_the_cap_and_start_again_after_a_success() -> None:
    backoff = Backoff(0.05, 0.5)
    assert [backoff.failed() for _ in range(6)] == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5]
    backoff.succeeded()
    assert backoff.next_s == 0.05 == backoff.failed()


def test_the_clients_retry_is_the_same_policy() -> None:
    retry = Backoff(0.02, 0.25).client_retry(3)
    assert retry._retries == 3
    waits = [retry._backoff.compute(n) for n in range(1, 6)]
    assert waits == [0.04, 0.08, 0.16, 0.25, 0.25]
