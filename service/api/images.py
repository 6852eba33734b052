"""A request's images, resolved: found in its messages (chat ``image_url`` parts) or its
input items (Responses ``input_image`` parts), refused with a 400 naming the part when
the model does not see (its worker declared no images), when there are too many, or
when one is not an image this server takes (``service/stream/images.py`` judges the
bytes); a remote URL fetched here when an operator allows it (``image_fetch``), a 400
otherwise. What comes out travels in the job, in the order the parts came.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import httpx

from service.api.context import Context
from service.api.schemas import ChatMessage, ImagePart
from service.errors import InvalidRequest
from service.settings import Settings
from service.stream.images import Bounds, ImageRefused, Remote, checked, parse_url

_UNTYPED = ("", "application/octet-stream", "binary/octet-stream")


@dataclasses.dataclass(frozen=True, slots=True)
class Found:
    """One image part: where it is (the 400s' ``param``), its URL, its message's role."""

    param: str
    url: str
    role: str


def in_messages(messages: list[ChatMessage]) -> list[Found]:
    """A chat request's image parts, in order."""
    return [
        Found(f"messages[{i}].content[{j}]", p.image_url.url, m.role)
        for i, m in enumerate(messages)
        if isinstance(m.content, list)
        for j, p in enumerate(m.content)
        if isinstance(p, ImagePart)
    ]


def in_items(items: list[dict[str, Any]], own_from: int = 0) -> list[Found]:
    """A response's ``input_image`` parts, in order; ``own_from``: where this request's
    own items start (those before are its ``previous_response_id`` chain's)."""
    out = []
    for i, item in enumerate(items):
        content = item.get("content") if item.get("type", "message") == "message" else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "input_image":
                where = (
                    f"input[{i - own_from}].content[{j}]"
                    if i >= own_from
                    else "previous_response_id"
                )
                url = part.get("image_url")
                out.append(Found(where, url if isinstance(url, str) else "", str(item.get("role"))))
    return out


def check_seen(found: list[Found], model: str, sees: bool, max_images: int) -> None:
    """The 400s decided before any image is decoded: a model that does not see, more
    images than allowed, an image outside a user message."""
    if not found:
        return
    first = found[0]
    if not sees:
        raise InvalidRequest(
            f"the model '{model}' does not accept images ({first.param} is an image); "
            "send text only, or choose a model whose worker serves images",
            param=first.param,
            code="image_input_not_supported",
        )
    if len(found) > max_images:
        raise InvalidRequest(
            f"the request has {len(found)} images; at most {max_images} are allowed",
            param=found[max_images].param,
            code="too_many_images",
        )
    for f in found:
        if f.role != "user":
            raise InvalidRequest(
                f"images are taken in user messages only ({f.param} is in a {f.role} message)",
                param=f.param,
            )


async def resolve(ctx: Context, found: list[Found], model: str) -> tuple[bytes, ...]:
    """The images' bytes, each checked (after ``check_seen``)."""
    settings = ctx.settings
    check_seen(found, model, ctx.catalog.sees(model), settings.max_images)
    out = []
    for f in found:
        try:
            image = parse_url(f.url, bounds(settings))
            if isinstance(image, Remote):
                image = await fetch(settings, image, f.param)
        except ImageRefused as exc:
            raise InvalidRequest(f"{f.param}: {exc}", param=f.param, code=exc.code) from None
        out.append(image)
    return tuple(out)


async def fetch(settings: Settings, remote: Remote, param: str) -> bytes:
    """A remote image, whole within ``image_fetch_timeout_s`` (a server that drips it
    slower is given up) and ``image_max_bytes``."""
    if not settings.image_fetch:
        raise InvalidRequest(
            f"{param}: this server takes images as data URLs only "
            "(data:image/png;base64,...); fetching remote URLs is off",
            param=param,
            code="image_url_not_allowed",
        )
    limit = settings.image_max_bytes
    timeout = httpx.Timeout(settings.image_fetch_timeout_s)
    try:
        async with (
            asyncio.timeout(settings.image_fetch_timeout_s),
            httpx.AsyncClient(timeout=timeout, follow_redirects=True, max_redirects=3) as client,
            client.stream("GET", remote.url) as resp,
        ):
            if resp.status_code != 200:
                raise ImageRefused(
                    f"fetching the image answered HTTP {resp.status_code}", "image_fetch_failed"
                )
            data = bytearray()
            async for chunk in resp.aiter_bytes():
                data += chunk
                if len(data) > limit:
                    raise ImageRefused(
                        f"the image is over {limit} bytes, the most allowed", "image_too_large"
                    )
            kind = resp.headers.get("content-type", "").split(";")[0].strip().lower()
    except TimeoutError:
        raise ImageRefused(
            f"fetching the image took over {settings.image_fetch_timeout_s:g} s",
            "image_fetch_timeout",
        ) from None
    except httpx.HTTPError as exc:
        raise ImageRefused(
            f"fetching the image failed ({type(exc).__name__})", "image_fetch_failed"
        ) from None
    # a server that does not say (or says only "bytes"): the bytes say what they are
    return checked(bytes(data), None if kind in _UNTYPED else kind, bounds(settings))


def bounds(settings: Settings) -> Bounds:
    return Bounds(settings.image_max_bytes, settings.image_max_pixels)
