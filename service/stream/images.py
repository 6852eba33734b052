"""Images in a request -- chat ``image_url`` parts and Responses ``input_image`` parts --
told apart and checked without I/O: a ``data:`` URL decoded (its media type one of
``MEDIA_TYPES``, its bytes that kind of image, within ``Bounds``: its bytes, and its
pixels as its header says them -- a small file can be a huge picture, which the worker
would decode), a remote ``http(s)`` URL named for the API to fetch (or refuse), anything
else refused. The same check judges fetched bytes. ``ImageRefused`` says why, with an
OpenAI error code; the API turns it into a 400 naming the part.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re

# the kinds of image accepted, and how each one's bytes start
MEDIA_TYPES: dict[str, tuple[bytes, ...]] = {
    "image/png": (b"\x89PNG\r\n\x1a\n",),
    "image/jpeg": (b"\xff\xd8\xff",),
    "image/gif": (b"GIF87a", b"GIF89a"),
    "image/webp": (b"RIFF",),  # then 4 bytes of size and b"WEBP" (``sniff``)
}
MAX_URL_CHARS = 2048  # a remote URL's length

_DATA = re.compile(r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*),", re.ASCII)


@dataclasses.dataclass(frozen=True, slots=True)
class Bounds:
    max_bytes: int  # the image's bytes (decoded)
    max_pixels: int  # width x height, as its header says


class ImageRefused(ValueError):
    """An image this server does not take; ``code``: OpenAI's error code for it."""

    def __init__(self, message: str, code: str = "invalid_image") -> None:
        super().__init__(message)
        self.code = code


@dataclasses.dataclass(frozen=True, slots=True)
class Remote:
    """An ``http(s)`` URL: the API fetches it (when an operator allows it) and checks
    the bytes with ``checked``."""

    url: str


def parse_url(url: str, bounds: Bounds) -> bytes | Remote:
    """An image URL: a ``data:`` URL's image bytes, or the remote URL to fetch."""
    head = url[:16].lower()
    if head.startswith("data:"):
        return decode_data_url(url, bounds)
    if head.startswith(("http://", "https://")):
        if len(url) > MAX_URL_CHARS:
            raise ImageRefused(
                f"the image URL is {len(url)} characters; at most {MAX_URL_CHARS} are allowed",
                "invalid_image_url",
            )
        return Remote(url)
    raise ImageRefused(
        "an image URL must be a data URL (data:image/png;base64,...) or an http(s) URL",
        "invalid_image_url",
    )


def decode_data_url(url: str, bounds: Bounds) -> bytes:
    """``data:<media type>;base64,<data>`` -> the image's bytes, checked (``checked``)."""
    match = _DATA.match(url)
    if match is None:
        raise ImageRefused("the data URL has no ',' after its media type", "invalid_image_url")
    media = match["type"].strip().lower()
    params = [p.strip().lower() for p in match["params"].split(";") if p.strip()]
    if "base64" not in params:
        raise ImageRefused("an image data URL must be base64 (data:image/png;base64,...)")
    _check_media(media)
    payload = url[match.end() :]
    # bounded before decoding: base64 makes 3 bytes of every 4 characters
    if len(payload) // 4 * 3 > bounds.max_bytes + 2:
        raise _too_large(len(payload) // 4 * 3, bounds.max_bytes)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageRefused("the data URL's base64 does not decode") from None
    return checked(data, media, bounds)


def checked(data: bytes, media: str | None, bounds: Bounds) -> bytes:
    """Image bytes within ``bounds``, of an accepted kind, and of the kind ``media``
    says when it says one (a data URL's media type, a response's Content-Type)."""
    if len(data) > bounds.max_bytes:
        raise _too_large(len(data), bounds.max_bytes)
    if media is not None:
        _check_media(media)
    found = sniff(data)
    if found is None:
        accepted = ", ".join(MEDIA_TYPES)
        raise ImageRefused(f"the image is none of {accepted} (its bytes are not such an image)")
    if media is not None and media != found:
        raise ImageRefused(f"the image is said to be {media} but its bytes are {found}")
    size = dimensions(data, found)
    if size is None or 0 in size:
        raise ImageRefused(f"the image's {found} header is cut short or malformed")
    if size[0] * size[1] > bounds.max_pixels:
        raise ImageRefused(
            f"the image is {size[0]}x{size[1]} pixels; at most {bounds.max_pixels} are allowed",
            "image_too_large",
        )
    return data


def sniff(data: bytes) -> str | None:
    """The accepted media type ``data`` is an image of, from its first bytes."""
    for media, magics in MEDIA_TYPES.items():
        if any(data.startswith(m) for m in magics):
            if media == "image/webp" and data[8:12] != b"WEBP":
                continue
            return media
    return None


def dimensions(data: bytes, media: str) -> tuple[int, int] | None:
    """(width, height) from an image's header (None: cut short or malformed)."""
    if media == "image/png":  # the IHDR chunk comes first
        if data[12:16] != b"IHDR" or len(data) < 24:
            return None
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if media == "image/gif":  # the logical screen
        return (_le(data, 6, 2), _le(data, 8, 2)) if len(data) >= 10 else None
    if media == "image/webp":
        return _webp(data)
    return _jpeg(data)


def _le(data: bytes, at: int, n: int) -> int:
    return int.from_bytes(data[at : at + n], "little")


def _webp(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        return _le(data, 26, 2) & 0x3FFF, _le(data, 28, 2) & 0x3FFF
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = _le(data, 21, 4)
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    if chunk == b"VP8X" and len(data) >= 30:
        return 1 + _le(data, 24, 3), 1 + _le(data, 27, 3)
    return None


# the JPEG frame headers (SOF0-SOF15 but DHT, JPG and DAC, which share the range)
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg(data: bytes) -> tuple[int, int] | None:
    """The first frame header's size, the segments before it skipped by their lengths."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # (fill)
            i += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD8:  # (no length)
            i += 2
        elif marker in _SOF:
            if i + 9 > len(data):
                return None
            return int.from_bytes(data[i + 7 : i + 9], "big"), int.from_bytes(
                data[i + 5 : i + 7], "big"
            )
        elif marker in (0xD9, 0xDA):  # the end, or the scan, before any frame header
            return None
        else:
            i += 2 + int.from_bytes(data[i + 2 : i + 4], "big")
    return None


def _check_media(media: str) -> None:
    if media not in MEDIA_TYPES:
        accepted = ", ".join(MEDIA_TYPES)
        shown = media[:64] or "(none)"
        raise ImageRefused(
            f"the image's media type is {shown}; accepted: {accepted}", "unsupported_image_type"
        )


def _too_large(size: int, max_bytes: int) -> ImageRefused:
    return ImageRefused(
        f"the image is {size} bytes; at most {max_bytes} are allowed", "image_too_large"
    )
