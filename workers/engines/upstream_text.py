"""The upstream engine in text mode (``LASTEVENT_UPSTREAM_MODE=text``): the same calls,
faults and replicas as token mode (``upstream.py``), another request and reader."""

from __future__ import annotations

from typing import Any

from service.stream.params import SamplingParams
from workers.engines import upstream_wire as wire
from workers.engines.upstream import UpstreamEngine


class TextUpstreamEngine(UpstreamEngine):
    """Text mode (``LASTEVENT_UPSTREAM_MODE=text``): any OpenAI-compatible server, hosted
    APIs and Ollama included. It is sent the conversation (``Job.conversation``: the
    messages to ``/chat/completions``, a prompt's text to ``/completions``) and streams
    text: the runner holds back stop strings on it as usual; usage is the server's. An
    answer cannot be continued (the server takes no ids): a fault before its first text
    is tried again, one after it ends the request; another worker does not continue it
    (``continues``), and the worker never parks it."""

    name = "upstream-text"
    continues = False

    def _request(
        self,
        model: str,
        prompt: list[int],
        made: list[int],
        params: SamplingParams,
        left: int,
        conversation: bytes,
    ) -> tuple[str, dict[str, Any], wire.Reader]:
        path, body = wire.text_body(model, conversation, params, left)
        return path, body, wire.TextReader()

    def _goes_on(self, params: SamplingParams, made: list[int], first: int, sent: int) -> bool:
        return sent == 0
