"""The worker's decisions, as plain functions: what a presence verdict asks for, and how
many of a request's tokens were wasted. The runner acts on them (vLLM's habit: the
core returns decisions, the caller aborts)."""

from __future__ import annotations

import dataclasses

from service.stream.lifecycle import VERDICT_STATE, State, Verdict


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    """Stop the engine now; the request ends in ``state``."""

    state: State


@dataclasses.dataclass(frozen=True, slots=True)
class RecheckIn:
    """No reader now: ask again when the grace period runs out."""

    seconds: float


def plan(verdict: int) -> Abort | RecheckIn | None:
    """What ``check.lua``'s answer for one running request asks of its owner."""
    if verdict in VERDICT_STATE:
        return Abort(VERDICT_STATE[Verdict(verdict)])
    if verdict < 0:
        return RecheckIn(-verdict / 1000)
    return None


def wasted_tokens(completion: int, covered: int | None, delivered: int | None) -> int:
    """Tokens generated that no reader got.

    ``covered``: tokens made before an abort decision (``None``: no abort, all count);
    ``delivered``: the most tokens any reader's connection was sent, when no reader is
    left at the end (``None``: a reader is still there and gets the rest)."""
    kept = completion if covered is None else covered
    if delivered is not None:
        kept = min(kept, delivered)
    return max(0, completion - kept)
