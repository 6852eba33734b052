"""The engine protocol, modeled on vLLM's ``AsyncLLM``.

``generate`` is an async iterator that yields, per engine step, the *new* token ids
of one request (``RequestOutputKind.DELTA`` in vLLM terms). It returns when the
engine finished the request (EOS or max_tokens) and raises ``EngineError`` when
the engine failed. ``abort(request_id)`` stops a running request at the engine's
next step; its ``generate`` then returns (``StepOutput.aborted``).

Detokenization and stop strings are *not* the engine's job: the runner does both
so that every engine behaves the same. ``params`` is the request's
``SamplingParams`` exactly as the API accepted it; an engine stops on the model's
EOS ids, which it is given when it is built.

``generated``: the ids this request already produced elsewhere (a takeover: another
worker made them and is gone). The engine prefills the prompt followed by them and
continues as if it had made them itself: ``params.max_tokens`` counts them, and with
``temperature=0`` the steps are the rest of an uninterrupted run's.
``params`` beyond temperature/top_p/seed (penalties, top_k, min_p, min_tokens,
ignore_eos, logit_bias, stop_token_ids, logprobs, structured) are honoured by the
engine or listed in ``service.stream.params.UNSUPPORTED`` for it: the API refuses a
request that sets one an engine cannot honour, so an engine never ignores one.
``params.stop_token_ids`` end the request like EOS (``finish_reason`` ``stop``, the
id is the last one yielded); ``ignore_eos`` means EOS ids do not end it (but
``stop_token_ids`` still do); ``min_tokens``: neither may be sampled before that many.
Logprobs are the model's raw log-softmax (before temperature, penalties and biases,
as vLLM's default ``raw_logprobs``).
``images``: the prompt's images (PNG, JPEG, GIF or WebP bytes, checked by the API), one
per placeholder in the prompt's ids, in order: an engine whose model sees (``images``
True: vLLM's, for a multi-modal model) passes them to the model; any other raises
``EngineError`` (the API refused them first: the worker declared its ``images``).
``tests/engine_contract.py`` is the behaviour every engine must show.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

from service.stream.lifecycle import EngineFinish
from service.stream.logprobs import Sampled
from service.stream.params import SamplingParams


class EngineError(Exception):
    """The engine failed while running a request; the request ends ``errored``."""

    def __init__(self, message: str, code: str = "engine_error") -> None:
        super().__init__(message)
        self.code = code


def refuse_images(engine: str, images: Sequence[bytes]) -> None:
    """What an engine that takes no images does with some (the API refuses images for the
    models of a worker that does not see, so only a request made around it has them)."""
    if images:
        raise EngineError(f"the {engine} engine takes no images", "invalid_request")


@dataclasses.dataclass(frozen=True, slots=True)
class StepOutput:
    token_ids: list[int]  # new ids of this step (may be empty on the last step)
    finished: bool = False
    finish_reason: EngineFinish | None = None
    # one per id of ``token_ids`` when ``params.logprobs`` is not None, else None
    logprobs: list[Sampled] | None = None
    # an engine that streams text, not ids (an upstream in text mode): the step's text,
    # and on the last step the completion tokens the engine counted (None: not said)
    text: str | None = None
    completion_tokens: int | None = None
    # the prompt's tokens as the engine counted them, where that is not the job's ids
    # (vLLM: an image's placeholder is many tokens), said on some step (None: not said)
    prompt_tokens: int | None = None


class Engine(Protocol):
    name: str
    # it continues a request from the ids another worker made (False: an engine that
    # streams text only; such a request ends ``worker_lost`` and is never parked)
    continues: bool
    # it takes images with a prompt (a vision model under vLLM: its worker declares so)
    images: bool

    @property
    def available(self) -> bool:
        """Whether it can take a request now (an upstream that refuses connections: no;
        the worker claims nothing meanwhile and its heartbeat offers no slots)."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generated: Sequence[int] = (),
        *,
        adapter: str | None = None,  # a LoRA adapter the worker serves (None: the base)
        conversation: bytes = b"",  # a text-mode upstream's request (``Job.conversation``)
        images: Sequence[bytes] = (),  # the prompt's images, in order (``Job.images``)
    ) -> AsyncGenerator[StepOutput, None]: ...

    async def abort(self, request_id: str) -> None: ...
