"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, in vLLM's shapes, so that tools
written against a vLLM server (GuideLLM, ``vllm bench serve``) count tokens here as
there. A conversation renders through the model's chat template exactly as
``/v1/chat/completions`` renders it: its count is that request's ``prompt_tokens``.

Unlike vLLM, a field these routes do not declare is a 400 naming it (vLLM logs it and
carries on).
"""

from __future__ import annotations

import functools
from typing import Annotated

import msgspec
from litestar import Controller, post
from msgspec import Meta

from service.api import images, sizes
from service.api.auth import Principal
from service.api.context import Context
from service.api.contract import render_conversation
from service.api.intake import check_model
from service.api.rendering import weight
from service.api.schemas import ChatMessage, error_responses
from service.errors import InvalidRequest
from service.tokenize import ModelInfo


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's two request shapes in one struct: ``prompt`` (text) or ``messages`` (a
    conversation), exactly one of them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: true for a prompt; false for messages (the template writes them)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None  # messages only; default true
    return_token_strs: bool | None = None


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[Annotated[int, Meta(ge=0)]]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


def chat_prompt(model: ModelInfo, messages: list[ChatMessage], generation_prompt: bool) -> str:
    """The text /v1/chat/completions tokenizes for ``messages``."""
    if not messages:
        raise InvalidRequest("'messages' must not be empty", param="messages")
    try:
        return render_conversation(model, messages, None, generation_prompt=generation_prompt)
    except Exception as exc:  # noqa: BLE001 - the template rejects the conversation
        raise InvalidRequest(f"invalid messages: {exc}", param="messages") from None


def token_ids(model: ModelInfo, data: TokenizeRequest) -> list[int]:
    if (data.prompt is None) == (data.messages is None):
        raise InvalidRequest(
            "send exactly one of 'prompt' (text) and 'messages' (a conversation)",
            param="prompt" if data.prompt is not None else "messages",
        )
    if data.messages is None:
        if data.add_generation_prompt is not None:
            raise InvalidRequest(
                "'add_generation_prompt' applies to 'messages' only",
                param="add_generation_prompt",
            )
        text = data.prompt or ""
        special = True if data.add_special_tokens is None else data.add_special_tokens
    else:
        generation = True if data.add_generation_prompt is None else data.add_generation_prompt
        text = chat_prompt(model, data.messages, generation)
        special = bool(data.add_special_tokens)
    return model.encode(text, add_special_tokens=special)  # (False: what completions use)


class VllmCompatController(Controller):
    tags = ("vllm",)

    @post(
        "/tokenize",
        status_code=200,
        summary="Tokenize a prompt or a conversation (vLLM's)",
        responses=error_responses(400, 401, 403, 404, 413),
    )
    async def tokenize(
        self, ctx: Context, principal: Principal, data: TokenizeRequest
    ) -> TokenizeResponse:
        model = check_model(ctx, data.model, principal)
        messages = data.messages or []
        sizes.check_count("messages", len(messages))  # (before the template runs)
        # an image is its placeholder here (one token; vLLM widens it when it runs)
        found = images.in_messages(messages)
        images.check_seen(found, model.name, ctx.catalog.sees(model.name), ctx.settings.max_images)
        size = weight(messages, data.prompt)
        ids = await ctx.renderer.run(size, functools.partial(token_ids, model, data))
        strs = None
        if data.return_token_strs:
            strs = [model.tokenizer.id_to_token(i) or "" for i in ids]
        return TokenizeResponse(
            count=len(ids), max_model_len=ctx.context_length(model), tokens=ids, token_strs=strs
        )

    @post(
        "/detokenize",
        status_code=200,
        summary="Text of token ids (vLLM's)",
        responses=error_responses(400, 401, 403, 404, 413),
    )
    async def detokenize(
        self, ctx: Context, principal: Principal, data: DetokenizeRequest
    ) -> DetokenizeResponse:
        """Special tokens are kept (vLLM's: the text of exactly these ids)."""
        model = check_model(ctx, data.model, principal)
        vocab = model.tokenizer.get_vocab_size()
        bad = [t for t in data.tokens if t >= vocab]
        if bad:
            raise InvalidRequest(
                f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="tokens"
            )
        return DetokenizeResponse(prompt=model.decode(data.tokens, skip_special_tokens=False))
