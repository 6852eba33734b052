"""Log probabilities: what an engine reports per sampled id, what the log keeps, and
OpenAI's two shapes of them.

An engine reports ``Sampled`` (ids and floats) for each id it yields, when the request
asked (``SamplingParams.logprobs``). The worker turns them into ``Logprob``s -- the
token's text and bytes, so that rendering needs no tokenizer and replays byte for byte
-- and logs them in the ``Delta`` that carries their ids. A token can be part of a
UTF-8 character: its text is then what the tokenizer decodes it to alone (with
U+FFFD), its bytes are the token's own.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Sequence
from typing import Any

import msgspec
from tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True, slots=True)
class Sampled:
    """One sampled id's logprob, and the ``k`` most likely ids' (best first)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class Alternative(msgspec.Struct, array_like=True, gc=False, frozen=True):
    token: str
    raw: bytes
    logprob: float


class Logprob(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """One sampled token as the log keeps it."""

    token: str
    raw: bytes
    logprob: float
    top: list[Alternative] = []


class TokenText:
    """A tokenizer's id -> (text, bytes), cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
        self._byte_level = _has_byte_level(decoder)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one per model, lives as long
    def __call__(self, token_id: int) -> tuple[str, bytes]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        if self._byte_level:
            piece = self._tokenizer.id_to_token(token_id)
            if piece is not None and all(c in _UNICODE_TO_BYTE for c in piece):
                return text, bytes(_UNICODE_TO_BYTE[c] for c in piece)
        return text, text.encode("utf-8")

    def logprobs(self, ids: Sequence[int], sampled: Sequence[Sampled]) -> list[Logprob]:
        out = []
        for token_id, s in zip(ids, sampled, strict=True):
            text, raw = self(token_id)
            top = [Alternative(*self(t), lp) for t, lp in s.top]
            out.append(Logprob(text, raw, s.logprob, top))
        return out


def chat_logprobs(items: Sequence[Logprob]) -> dict[str, Any]:
    """OpenAI chat's ``logprobs`` object (``{"content": [...], "refusal": null}``)."""
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": list(lp.raw),
                "top_logprobs": [
                    {"token": a.token, "logprob": a.logprob, "bytes": list(a.raw)} for a in lp.top
                ],
            }
            for lp in items
        ],
        "refusal": None,
    }


def completion_logprobs(items: Sequence[Logprob], offset: int) -> dict[str, Any]:
    """OpenAI completions' ``logprobs`` object; ``offset``: the characters of the
    completion before the first of ``items`` (``text_offset`` counts from there)."""
    offsets = []
    for lp in items:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in items],
        "token_logprobs": [lp.logprob for lp in items],
        "top_logprobs": [{a.token: a.logprob for a in lp.top} for lp in items],
        "text_offset": offsets,
    }


def _has_byte_level(decoder: dict[str, Any]) -> bool:
    if decoder.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(d) for d in decoder.get("decoders") or [])


def _byte_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: each byte is written as one printable character
    (the printable Latin-1 bytes as themselves, the others shifted past U+0100)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: b for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + shift
            shift += 1
    return {chr(c): b for b, c in chars.items()}


_UNICODE_TO_BYTE = _byte_alphabet()
