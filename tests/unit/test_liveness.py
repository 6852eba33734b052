"""The connection judge (``service/store/liveness.py``), without Redis: a worker is judged
gone exactly when one unbroken view saw it connected and then, for a grace, not."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from service.store.liveness import Judge

GRACE, GAP = 0.25, 1.0
WORKERS = ("a", "b", "c")


@dataclasses.dataclass(frozen=True)
class Poll:
    dt: float  # since the previous poll
    asked: frozenset[str]
    connected: frozenset[str]  # (of the asked ones)
    reset: bool  # the view broke before this poll (a failed poll, a new connection)


polls = st.lists(
    st.builds(
        lambda dt, asked, connected, reset: Poll(dt, asked, connected & asked, reset),
        st.sampled_from([0.05, 0.1, 0.1, 0.1, 0.2, 1.5]),
        st.frozensets(st.sampled_from(WORKERS)),
        st.frozensets(st.sampled_from(WORKERS)),
        st.sampled_from([False] * 7 + [True]),
    ),
    max_size=40,
)


def run(history: list[Poll]) -> tuple[list[float], list[list[str]]]:
    judge, now, times, verdicts = Judge(GRACE, GAP), 0.0, [], []
    for poll in history:
        now += poll.dt
        if poll.reset:
            judge.reset()
        times.append(now)
        verdicts.append(judge.observe(now, poll.asked, poll.connected))
    return times, verdicts


def unbroken(history: list[Poll], k: int, n: int) -> bool:
    """No reset and no late poll in polls k+1..n."""
    return all(not history[i].reset and history[i].dt <= GAP for i in range(k + 1, n + 1))


@settings(max_examples=400, deadline=None)
@given(polls)
def test_gone_only_after_a_grace_of_absence_in_one_unbroken_view(history: list[Poll]) -> None:
    times, verdicts = run(history)
    for n, gone in enumerate(verdicts):
        for w in gone:
            # the last poll that saw it connected, and every poll since asked about it
            # and saw it without its connection, within one unbroken view
            seen = [k for k in range(n) if w in history[k].connected]
            assert seen, f"{w} judged gone at poll {n} without ever being seen"
            k = seen[-1]
            assert unbroken(history, k, n)
            assert all(
                w in history[i].asked and w not in history[i].connected for i in range(k + 1, n + 1)
            )
            assert times[n] - times[k + 1] >= GRACE
            # once per disappearance
            assert not any(w in verdicts[i] for i in range(k + 1, n))


@settings(max_examples=400, deadline=None)
@given(polls)
def test_a_gone_worker_is_judged_gone_once_its_grace_is_over(history: list[Poll]) -> None:
    times, verdicts = run(history)
    for w in WORKERS:
        for k, poll in enumerate(history):
            if w not in poll.connected:
                continue
            # seen at k (after any reset at k); absent since, asked at every poll
            n = k + 1
            while (
                n < len(history)
                and w in history[n].asked
                and w not in history[n].connected
                and unbroken(history, k, n)
            ):
                if times[n] - times[k + 1] >= GRACE:
                    assert any(w in verdicts[i] for i in range(k + 1, n + 1)), (w, k, n)
                    break
                n += 1


def test_a_blip_shorter_than_the_grace_is_forgiven() -> None:
    judge = Judge(GRACE, GAP)
    assert judge.observe(0.0, {"a"}, {"a"}) == []
    assert judge.observe(0.1, {"a"}, set()) == []  # its connection is being made again
    assert judge.observe(0.2, {"a"}, {"a"}) == []  # back
    assert judge.observe(0.3, {"a"}, set()) == []
    assert judge.observe(0.4, {"a"}, set()) == []
    assert judge.observe(0.55, {"a"}, set()) == ["a"]  # 0.25 s without it
    assert judge.observe(0.65, {"a"}, set()) == []  # once


def test_a_store_that_was_away_judges_nobody() -> None:
    """A Redis restart drops every worker's connection at once, and the observer's: the
    observer starts again (``reset``) and judges only workers it sees again."""
    judge = Judge(GRACE, GAP)
    judge.observe(0.0, {"a", "b"}, {"a", "b"})
    judge.reset()  # the observer's connection failed
    for t in (0.1, 0.2, 0.5, 1.0):
        assert judge.observe(t, {"a", "b"}, {"b"}) == []  # "a" never seen since: heartbeat's
    # a stall (Redis asleep 3 s, or the observer's process frozen): polls far apart
    assert judge.observe(4.0, {"b"}, set()) == []
    assert judge.observe(4.3, {"b"}, set()) == []  # not seen since the stall
