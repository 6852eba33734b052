"""The CPU engine's sampler: one request's logits, step by step, as vLLM samples them.
torch and xgrammar are imported where they are used (in the engine's decode thread)."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import Any

from service.stream.logprobs import Sampled
from service.stream.params import SamplingParams
from workers.engines.base import EngineError


class Sampler:
    """One request's logits, step by step, in vLLM's sampler order: the grammar's mask;
    the logprobs (log-softmax of what the model gave, that mask aside, as vLLM's raw
    logprobs); min_tokens; logit_bias; the penalties (repetition over prompt + output,
    frequency and presence over the output); then greedy, or temperature, min_p, top_k,
    top_p and a draw from the request's own generator.

    ``context`` is the prompt and ``generated`` the ids a takeover was handed (already
    at its end): they are counted and replayed through the grammar as if made here."""

    def __init__(
        self,
        params: SamplingParams,
        context: list[int],
        generated: Sequence[int],
        vocab: int,
        stops: frozenset[int],
        matcher: Any,
    ) -> None:
        import torch

        self.params = p = params
        self.produced = 0
        seed = p.seed if p.seed is not None else secrets.randbits(63)
        self.generator = torch.Generator().manual_seed(seed)
        self.stop_index = torch.tensor(sorted(stops), dtype=torch.long) if p.min_tokens else None
        self.bias = None
        if p.logit_bias:
            self.bias = torch.zeros(vocab)
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            self.bias[ids] = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
        self.seen = None  # repetition_penalty's ids: the prompt's and the output's
        if p.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab, dtype=torch.bool)
            self.seen[torch.tensor(context, dtype=torch.long)] = True
        self.counts = torch.zeros(vocab) if p.presence_penalty or p.frequency_penalty else None
        self.matcher = matcher
        self.bitmask = None
        if matcher is not None:
            import xgrammar

            self.bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        for token in generated:
            if not self._observe(token):
                raise EngineError(
                    "the generated ids do not follow the requested structure", "invalid_request"
                )

    def next(self, logits: Any) -> tuple[int, Sampled | None]:
        """The next id and, when asked, its logprob and the best alternatives'."""
        import torch

        if self.matcher is not None and not self.matcher.is_terminated():
            import xgrammar

            self.matcher.fill_next_token_bitmask(self.bitmask)
            xgrammar.apply_token_bitmask_inplace(logits, self.bitmask)
        raw = None if self.params.logprobs is None else torch.log_softmax(logits, dim=-1)
        token = self._draw(self._adjust(logits))
        self._observe(token)
        if raw is None:
            return token, None
        top = torch.topk(raw, self.params.logprobs) if self.params.logprobs else None
        pairs = (
            ()
            if top is None
            else tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True))
        )
        return token, Sampled(float(raw[token]), pairs)

    def _adjust(self, logits: Any) -> Any:
        import torch

        p = self.params
        if self.stop_index is not None and self.produced < p.min_tokens:
            logits[self.stop_index] = -math.inf
        if self.bias is not None:
            logits = logits + self.bias
        if self.seen is not None:
            rp = p.repetition_penalty
            logits = torch.where(
                self.seen, torch.where(logits > 0, logits / rp, logits * rp), logits
            )
        if self.counts is not None:
            logits = logits - p.frequency_penalty * self.counts
            logits = logits - p.presence_penalty * (self.counts > 0)
        return logits

    def _draw(self, logits: Any) -> int:
        """Greedy at temperature 0, else a draw from what min_p, top_k and top_p keep."""
        import torch

        p = self.params
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.min_p > 0:
            probs = torch.softmax(logits, dim=-1)
            logits = logits.masked_fill(probs < p.min_p * probs.max(), -math.inf)
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, -math.inf)
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < p.top_p
            sorted_probs = sorted_probs * keep
            choice = torch.multinomial(
                sorted_probs / sorted_probs.sum(), 1, generator=self.generator
            )
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _observe(self, token: int) -> bool:
        """Count ``token`` as produced; False if the grammar (still open) rejects it."""
        self.produced += 1
        if self.seen is not None:
            self.seen[token] = True
        if self.counts is not None:
            self.counts[token] += 1
        if self.matcher is None or self.matcher.is_terminated():
            return True  # as vLLM: the ids after a finished grammar are not constrained
        return bool(self.matcher.accept_token(token))
