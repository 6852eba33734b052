"""vLLM's prompt for a job: its token ids and, for a model that sees, its images as
multi-modal data -- decoded here (Pillow, off the event loop), without importing vllm.

The ids already hold one placeholder per image, where the model's chat template put it
(the API rendered the conversation); vLLM's processor for the model widens each into
the image's feature tokens and computes the features from the pixels.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Sequence
from typing import Any

from workers.engines.base import EngineError


async def prompt(token_ids: list[int], images: Sequence[bytes], sees: bool) -> dict[str, Any]:
    """vLLM's ``TokensPrompt`` (a dict), with ``multi_modal_data`` when there are images
    (``sees``: the model takes them; the API refuses them otherwise, so does this)."""
    out: dict[str, Any] = {"prompt_token_ids": token_ids}
    if images and not sees:
        raise EngineError("this model takes no images", "invalid_request")
    if images:
        out["multi_modal_data"] = {"image": await asyncio.to_thread(pictures, images)}
    return out


def pictures(images: Sequence[bytes]) -> list[Any]:
    """Each image as an RGB Pillow image (what vLLM's image processors take)."""
    from PIL import Image, UnidentifiedImageError

    out = []
    for i, data in enumerate(images):
        try:
            with Image.open(io.BytesIO(data)) as image:
                out.append(image.convert("RGB"))
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
            raise EngineError(f"image {i} does not decode: {exc}", "invalid_image") from None
    return out
