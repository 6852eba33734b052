"""Failed credentials per client address: a pure counter the authenticator consults
before it asks Postgres about a key (``auth.py``).

A client that keeps sending keys that are not valid (guessing, or a flood of random
well-formed ones, each a Postgres lookup) is refused with 429 after ``per_minute``
failures, until the minute that began with its first failure has passed. Windows are
fixed (one counter per address, no list of times); at most ``max_addresses`` are kept,
the oldest window forgotten first.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(slots=True)
class _Window:
    start: float
    failures: int


class FailureLimit:
    def __init__(
        self, per_minute: int, *, window_s: float = 60.0, max_addresses: int = 100_000
    ) -> None:
        self.per_minute = per_minute
        self.window_s = window_s
        self.max_addresses = max_addresses
        self._windows: dict[str, _Window] = {}  # oldest window first

    def retry_after(self, address: str, now: float) -> int:
        """0 if the address may try a credential now; else whole seconds to wait."""
        if self.per_minute <= 0:
            return 0
        window = self._windows.get(address)
        if window is None or now - window.start >= self.window_s:
            return 0
        if window.failures < self.per_minute:
            return 0
        return max(1, math.ceil(window.start + self.window_s - now))

    def failed(self, address: str, now: float) -> None:
        if self.per_minute <= 0:
            return
        window = self._windows.get(address)
        if window is None or now - window.start >= self.window_s:
            self._windows.pop(address, None)  # a new window goes to the end
            self._windows[address] = _Window(now, 1)
            while len(self._windows) > self.max_addresses:
                del self._windows[next(iter(self._windows))]
            return
        window.failures += 1
