"""Redis replies, decoded in one typed place.

redis-py answers ``bytes`` (or ``str`` with ``decode_responses``, or ``int`` from a
script), typed ``Any``; every reader of a reply goes through these instead of
``x.decode() if isinstance(x, bytes) else str(x)`` by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.store.keys import EVENT_FIELD


def text(raw: Any) -> str:
    """A reply as text (bytes are UTF-8)."""
    if isinstance(raw, bytes):
        return raw.decode()
    return str(raw)


def text_or_none(raw: Any) -> str | None:
    return None if raw is None else text(raw)


def integer(raw: Any, default: int = 0) -> int:
    """A reply as an int (``None`` -> ``default``); floats in text are truncated."""
    if raw is None:
        return default
    if isinstance(raw, int):
        return raw
    return int(float(text(raw)))


def texts(raw: Any) -> list[str]:
    """An array reply as a list of texts."""
    return [text(x) for x in raw or ()]


def field(mapping: Mapping[Any, Any], name: str) -> Any:
    """A hash field from ``HGETALL``'s reply, whichever type its keys have."""
    value = mapping.get(name.encode())
    return mapping.get(name) if value is None else value


# -- stream replies as Redis sent them (RESP2 lists or RESP3 maps: no dict per entry) --


def streams_of(reply: Any) -> list[tuple[Any, list[list[Any]]]]:
    """An XREAD reply as (stream name, entries) pairs (RESP2 list or RESP3 map)."""
    if isinstance(reply, dict):
        return list(reply.items())
    return list(reply or ())


def stream_field(fields: list[bytes] | dict[bytes, bytes], name: bytes) -> bytes | None:
    if isinstance(fields, dict):
        return fields.get(name)
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == name:
            return fields[i + 1]
    return None


def stream_fields(fields: list[bytes] | dict[bytes, bytes], name: bytes) -> list[bytes]:
    """Every value of field ``name`` in an entry's field list (a field may repeat there;
    in a RESP3 map only its last value is left)."""
    if isinstance(fields, dict):
        value = fields.get(name)
        return [] if value is None else [value]
    return [fields[i + 1] for i in range(0, len(fields) - 1, 2) if fields[i] == name]


def raw(response: Any, **_options: Any) -> Any:
    return response


def event_payload(fields: list[bytes] | dict[bytes, bytes]) -> bytes:
    """The event payload of an entry's field list (RESP2) or map (RESP3)."""
    value = stream_field(fields, EVENT_FIELD)
    if value is None:
        raise KeyError(EVENT_FIELD)
    return value
