"""The archive format of a finished log: its entries, byte for byte, compressed.

``pack`` keeps every entry id and the exact payload bytes, so a reader serving from
the archive renders the same SSE bytes, with the same ids, as the hot log did.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import msgspec

from service.stream import events as ev
from service.stream.ids import EventId

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(list[tuple[int, int, bytes]])


def pack(entries: Sequence[tuple[EventId, bytes]]) -> tuple[bytes, int]:
    """-> (compressed blob, uncompressed size)."""
    raw = _enc.encode([(e.ms, e.seq, payload) for e, payload in entries])
    return zlib.compress(raw, 6), len(raw)


def unpack_raw(blob: bytes) -> list[tuple[EventId, bytes]]:
    return [(EventId(ms, seq), payload) for ms, seq, payload in _dec.decode(zlib.decompress(blob))]


def unpack(blob: bytes) -> list[tuple[EventId, ev.Event]]:
    return [(eid, ev.decode(payload)) for eid, payload in unpack_raw(blob)]
