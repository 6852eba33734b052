"""Stop-string holdback for several stop strings at once (OpenAI semantics).

The output is cut just before the first stop string to *complete*; the stop
string itself is never sent. Text is held back only while it could still become
(part of) a stop string: the longest suffix of pending text that is a proper
prefix of some stop string. Everything before it is released at once.
"""

from __future__ import annotations

from collections.abc import Sequence


class Holdback:
    """``feed(text) -> (releasable, stopped)``; ``finish() -> held text`` when no stop came."""

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    @property
    def pending(self) -> str:
        return self._pending

    def feed(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        pending = self._pending + text
        if not self._stops:
            self._pending = ""
            return pending, False
        hit = self._first_completed(pending)
        if hit is not None:
            start, stop = hit
            self.stopped, self.matched, self._pending = True, stop, ""
            return pending[:start], True
        keep = self._held_suffix_len(pending)
        cut = len(pending) - keep
        self._pending = pending[cut:]
        return pending[:cut], False

    def finish(self) -> str:
        """The generation ended without a stop string: the held text is output after all."""
        if self.stopped:
            return ""
        rest, self._pending = self._pending, ""
        return rest

    def _first_completed(self, pending: str) -> tuple[int, str] | None:
        """The stop string that completes earliest (ties: the one starting first)."""
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = pending.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _held_suffix_len(self, pending: str) -> int:
        for k in range(min(self._max_hold, len(pending)), 0, -1):
            suffix = pending[-k:]
            if any(stop.startswith(suffix) for stop in self._stops):
                return k
        return 0
