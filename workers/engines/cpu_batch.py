"""The CPU engine's continuous batching, on its decode thread: requests join and leave
the running batch between steps.

A step is up to a chunk of joining prompts (``prefill_chunk`` tokens; each prompt with
its own KV cache, batch of one: a long prompt never stalls the running ones for more than
a chunk; when nothing is decoding, every joining prompt at once), then one decode step of
every running request together -- one forward pass whose weights are read once
for all of them, which is what a decode step on a CPU costs (a 135M-parameter model
reads half a gigabyte of weights per step, and multiplies little). A request whose
prefill is done joins the running batch: its cache is put beside the others', the
shorter ones padded on the left and masked (``attention_mask``), each row with its own
positions (``position_ids``), so a sequence's attention sees exactly its own tokens. A
request that ends, is aborted or whose consumer walked away leaves at the next step;
columns every row pads are cut off.

Each sequence keeps its own sampler (temperature, penalties, bias, seed, logprobs) and
grammar matcher (``cpu_sampling.Sampler``). torch is imported here only, on the thread.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from service.stream.lifecycle import EngineFinish
from workers.engines.base import StepOutput


@dataclasses.dataclass(slots=True, eq=False)
class Seq:
    """One request on the decode thread: what is left to prefill, then what it decodes."""

    request: Any  # cpu._Request
    sampler: Any  # cpu_sampling.Sampler
    ends: frozenset[int]  # the ids that finish it (stop, EOS unless ignored)
    budget: int  # tokens it may still make
    tokens: list[int]  # prompt + what a takeover was handed: prefilled in chunks
    fed: int = 0  # of ``tokens``, prefilled so far
    cache: Any = None  # its own KV cache while it prefills
    produced: int = 0
    pending: int = -1  # the last sampled id, fed at the next decode step
    length: int = 0  # positions in the KV cache that are its own

    @property
    def stopped(self) -> bool:
        return bool(self.request.stop.is_set())

    def take(self, logits: Any) -> bool:
        """Sample the next id from ``logits`` and hand it over; whether it finished."""
        token, sampled = self.sampler.next(logits)
        self.produced += 1
        logprobs = None if sampled is None else [sampled]
        if token in self.ends or self.produced == self.budget:
            reason = EngineFinish.STOP if token in self.ends else EngineFinish.LENGTH
            self.request.emit(
                StepOutput([token], finished=True, finish_reason=reason, logprobs=logprobs)
            )
            return True
        self.request.emit(StepOutput([token], logprobs=logprobs))
        self.pending = token
        return False


# forward(input_ids, cache, attention_mask, position_ids) -> (last logits [B, V], cache)
Forward = Callable[[Any, Any, Any, Any], tuple[Any, Any]]


class Running:
    """The running batch: its rows and one KV cache for all of them, left-padded."""

    def __init__(self, forward: Forward) -> None:
        self.forward = forward
        self.rows: list[Seq] = []
        self.pads: list[int] = []  # per row: masked positions on the left
        self.cache: Any = None
        self.width = 0  # the cache's positions (padding included)

    def join(self, seqs: list[Seq], cache: Any, pads: list[int], width: int) -> None:
        """Put ``seqs`` (prefilled together: ``cache`` their rows, left-padded by
        ``pads`` to ``width`` positions) beside the running rows."""
        if not self.rows:
            self.rows, self.pads, self.cache, self.width = list(seqs), list(pads), cache, width
            return
        both = max(self.width, width)
        self._pad(self.cache, both - self.width)
        self._pad(cache, both - width)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = _cat(mine.keys, theirs.keys)
            mine.values = _cat(mine.values, theirs.values)
        self.pads = [p + both - self.width for p in self.pads] + [p + both - width for p in pads]
        self.rows += seqs
        self.width = both

    def leave(self, gone: set[Seq]) -> None:
        """Drop the rows of ``gone``, and the left columns every remaining row pads."""
        if not gone:
            return
        keep = [i for i, s in enumerate(self.rows) if s not in gone]
        if not keep:
            self.rows, self.pads, self.cache, self.width = [], [], None, 0
            return
        cut = min(self.pads[i] for i in keep)
        self.select(self.cache, keep, cut)
        self.rows = [self.rows[i] for i in keep]
        self.pads = [self.pads[i] - cut for i in keep]
        self.width -= cut

    def step(self) -> set[Seq]:
        """One decode step of every row: feed each its pending id, sample its next; the
        rows that finished."""
        import torch

        rows = self.rows
        ids = torch.tensor([[s.pending] for s in rows], dtype=torch.long)
        positions = torch.tensor([[s.length] for s in rows], dtype=torch.long)
        mask = None
        if any(self.pads):  # masked where a row is padded; a batch with no padding needs none
            mask = torch.ones(len(rows), self.width + 1, dtype=torch.long)
            for i, pad in enumerate(self.pads):
                mask[i, :pad] = 0
        logits, self.cache = self.forward(ids, self.cache, mask, positions)
        self.width += 1
        done = set()
        for i, seq in enumerate(rows):
            seq.length += 1
            if seq.take(logits[i]):
                done.add(seq)
        return done

    @staticmethod
    def select(cache: Any, rows: list[int], cut: int = 0) -> None:
        """Keep only ``rows`` of ``cache`` (in place), less its first ``cut`` positions."""
        import torch

        index = torch.tensor(rows, dtype=torch.long)
        for layer in cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, cut:].contiguous()
            layer.values = layer.values.index_select(0, index)[:, :, cut:].contiguous()

    @staticmethod
    def _pad(cache: Any, n: int) -> None:
        if n <= 0:
            return
        import torch

        for layer in cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                zeros = torch.zeros(t.shape[0], t.shape[1], n, t.shape[3], dtype=t.dtype)
                setattr(layer, name, torch.cat([zeros, t], dim=2))


def _cat(a: Any, b: Any) -> Any:
    import torch

    return torch.cat([a, b], dim=0)


class Scheduler:
    """The decode thread's loop: admit, prefill a chunk, decode a step; sleep when idle.

    ``admit(request)`` (on the thread) checks a request and makes its ``Seq``, or hands
    it its error or its end and returns None."""

    def __init__(
        self,
        forward: Forward,
        admit: Callable[[Any], Seq | None],
        *,
        max_batch: int,
        prefill_chunk: int,
    ) -> None:
        self.forward = forward
        self.admit = admit
        self.max_batch = max(1, max_batch)
        self.prefill_chunk = max(1, prefill_chunk)
        self.running = Running(forward)
        self.joining: collections.deque[Seq] = collections.deque()
        self.incoming: collections.deque[Any] = collections.deque()
        self.wake = threading.Condition()
        self.closed = False
        self.prefill_passes = 0  # forward passes of prompts (a group's is one)

    def submit(self, request: Any) -> None:
        """From the event loop: queue a request for the thread."""
        with self.wake:
            self.incoming.append(request)
            self.wake.notify()

    def poke(self) -> None:
        """From the event loop: something was stopped, or the engine closes."""
        with self.wake:
            self.wake.notify()

    def run(self) -> None:
        """The thread's body, until ``closed``."""
        while True:
            with self.wake:
                while not self.closed and not self._has_work():
                    self.wake.wait()
                if self.closed:
                    return
            self.step()

    def _has_work(self) -> bool:
        return bool(self.running.rows or self.joining or self.incoming)

    def step(self) -> None:
        self._take_incoming()
        self.running.leave({s for s in self.running.rows if s.stopped})
        while self.joining and self.joining[0].stopped:
            self.joining.popleft()
        try:
            # up to a chunk of joining prompts per step while others decode (they wait that
            # long at most); all of them when nobody is decoding (a burst)
            busy, spent = bool(self.running.rows), 0
            while self.joining and not (busy and spent >= self.prefill_chunk):
                budget = self.prefill_chunk - spent if busy else self.prefill_chunk
                spent += self._prefill(budget)
            if self.running.rows:
                self.running.leave(self.running.step())
        except BaseException as exc:  # noqa: BLE001 - every request in the step learns of it
            self._fail_all(exc)

    def _take_incoming(self) -> None:
        while True:
            with self.wake:
                room = len(self.running.rows) + len(self.joining) < self.max_batch
                request = self.incoming.popleft() if self.incoming and room else None
            if request is None:
                return
            if request.stop.is_set():
                continue
            seq = self.admit(request)
            if seq is not None:
                self.joining.append(seq)

    def _prefill(self, budget: int) -> int:
        """Prefill within ``budget`` tokens: the next joining prompts that fit it whole,
        together in one forward pass (left-padded, as the running batch); else a chunk of
        the next one, alone. The tokens it took."""
        group: list[Seq] = []
        for seq in self.joining:
            if seq.fed or sum(len(s.tokens) for s in group) + len(seq.tokens) > budget:
                break
            group.append(seq)
        if len(group) > 1:
            self._prefill_together(group)
            return sum(len(s.tokens) for s in group)
        return self._prefill_chunk(self.joining[0], budget)

    def _prefill_chunk(self, seq: Seq, most: int) -> int:
        """Up to ``most`` more tokens of ``seq``'s prompt; at its end, its first id, then
        the batch."""
        import torch

        chunk = seq.tokens[seq.fed : seq.fed + max(1, most)]
        self.prefill_passes += 1
        try:
            ids = torch.tensor([chunk], dtype=torch.long)
            logits, seq.cache = self.forward(ids, seq.cache, None, None)
            seq.fed += len(chunk)
            if seq.fed < len(seq.tokens):
                return len(chunk)
            self.joining.popleft()
            seq.length = seq.fed
            cache, seq.cache = seq.cache, None
            if not seq.take(logits[0]):
                self.running.join([seq], cache, [0], seq.length)
        except BaseException as exc:  # noqa: BLE001 - its request learns of it, alone
            if self.joining and self.joining[0] is seq:
                self.joining.popleft()
            seq.request.emit(exc)
        return len(chunk)

    def _prefill_together(self, group: list[Seq]) -> None:
        """Whole prompts in one forward pass, each row left-padded and masked to the
        longest and with its own positions; then each its first id, and the batch."""
        import torch

        for _ in group:
            self.joining.popleft()
        width = max(len(s.tokens) for s in group)
        pads = [width - len(s.tokens) for s in group]
        ids = torch.tensor([[0] * p + s.tokens for p, s in zip(pads, group, strict=True)])
        mask = torch.tensor([[0] * p + [1] * (width - p) for p in pads])
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        self.prefill_passes += 1
        try:
            logits, cache = self.forward(ids, None, mask, positions)
        except BaseException as exc:  # noqa: BLE001 - its requests learn of it
            for seq in group:
                seq.request.emit(exc)
            return
        keep = []
        for i, seq in enumerate(group):
            seq.fed = seq.length = len(seq.tokens)
            if not seq.take(logits[i]):
                keep.append(i)
        if len(keep) < len(group):
            self.running.select(cache, keep)
        if keep:
            self.running.join([group[i] for i in keep], cache, [pads[i] for i in keep], width)

    def _fail_all(self, exc: BaseException) -> None:
        for seq in self.running.rows:
            seq.request.emit(exc)
        self.running.leave(set(self.running.rows))
