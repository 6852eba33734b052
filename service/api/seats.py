"""Open readers per request and per API key in one API process: what one client may
hold of what every tenant shares (connections, the tailer, ``max_streams``).

A stream token is enough to open a reader, and a client could open hundreds of one
request; each is a connection and a subscription here. ``Seats.take`` refuses a reader
past ``per_request`` readers of its request or ``per_key`` of its key (0: no limit);
the route answers 429 with ``Retry-After`` before the stream starts. A seat is given
back when its stream ends -- or, for a stream never started, when it is collected.
"""

from __future__ import annotations

import collections
import dataclasses


class SeatsFull(Exception):
    def __init__(self, what: str, limit: int) -> None:
        super().__init__(f"{limit} readers of this {what} are open (the limit)")
        self.what = what
        self.limit = limit


@dataclasses.dataclass(slots=True, eq=False)
class Seat:
    seats: Seats
    request_id: str
    key: str
    held: bool = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.seats._free(self)


class Seats:
    def __init__(self, per_request: int, per_key: int) -> None:
        self.per_request = per_request
        self.per_key = per_key
        self.by_request: collections.Counter[str] = collections.Counter()
        self.by_key: collections.Counter[str] = collections.Counter()

    def take(self, request_id: str, key: str) -> Seat:
        if self.per_request and self.by_request[request_id] >= self.per_request:
            raise SeatsFull("request", self.per_request)
        if self.per_key and self.by_key[key] >= self.per_key:
            raise SeatsFull("API key", self.per_key)
        self.by_request[request_id] += 1
        self.by_key[key] += 1
        return Seat(self, request_id, key)

    def _free(self, seat: Seat) -> None:
        for counter, name in ((self.by_request, seat.request_id), (self.by_key, seat.key)):
            counter[name] -= 1
            if counter[name] <= 0:
                del counter[name]
