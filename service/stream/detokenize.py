"""Incremental detokenization over ``tokenizers``' own streaming decoder.

A token can be half of a UTF-8 character, and byte-level tokenizers merge or
drop spaces depending on neighbours, so per-token decoding is wrong. The
tokenizer's ``DecodeStream`` keeps the per-request state and returns text only
once it is complete. At the end, ``finish()`` flushes whatever the stream still
holds (bytes that never became a valid character) so that the concatenated
output equals ``tokenizer.decode(all_ids)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class Detokenizer:
    """Per-request incremental decoder: ``step(ids) -> new text``; ``finish() -> rest``."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted: list[str] = []
        self._emitted_len = 0

    @property
    def token_ids(self) -> Sequence[int]:
        return self._ids

    def step(self, ids: Iterable[int]) -> str:
        """Feed new token ids; return the text they completed (may be empty)."""
        out: list[str] = []
        for token_id in ids:
            self._ids.append(token_id)
            chunk = self._stream.step(self._tokenizer, token_id)
            if chunk:
                out.append(chunk)
        text = "".join(out)
        if text:
            self._emitted.append(text)
            self._emitted_len += len(text)
        return text

    def finish(self) -> str:
        """Flush: the part of the full decode that the stream has not produced yet."""
        full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special)
        emitted = "".join(self._emitted)
        if not full.startswith(emitted):
            # The stream and the full decode disagree (should not happen for the
            # tokenizers we ship); never re-send text, the client already has it.
            return ""
        rest = full[self._emitted_len :]
        if rest:
            self._emitted = [full]
            self._emitted_len = len(full)
        return rest
