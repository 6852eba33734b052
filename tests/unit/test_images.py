"""Images in a request: data URLs decoded and checked, remote URLs told apart, the parts
found in chat messages and Responses items, and the 400s decided before any decoding
(``service/stream/images.py``, ``service/api/images.py``)."""

from __future__ import annotations

import base64
import contextlib
import io
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from service.api.images import Found, check_seen, in_items, in_messages
from service.api.response_input import chat_body
from service.api.schemas import ChatCompletionRequest, ImagePart, ResponsesRequest, message_dicts
from service.errors import InvalidRequest
from service.stream.images import (
    MEDIA_TYPES,
    Bounds,
    ImageRefused,
    Remote,
    checked,
    decode_data_url,
    dimensions,
    parse_url,
    sniff,
)

FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/gif": "GIF", "image/webp": "WEBP"}


def encoded(media: str, size: tuple[int, int] = (3, 2), **options: Any) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(out, FORMATS[media], **options)
    return out.getvalue()


SAMPLES = {media: encoded(media) for media in FORMATS}
PNG, JPEG, GIF = SAMPLES["image/png"], SAMPLES["image/jpeg"], SAMPLES["image/gif"]
BIG = Bounds(1 << 20, 1 << 24)


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


@pytest.mark.parametrize("media", list(MEDIA_TYPES))
def test_a_data_url_of_each_accepted_kind_decodes_to_its_bytes(media: str) -> None:
    data = SAMPLES[media]
    assert sniff(data) == media
    assert parse_url(data_url(data, media), BIG) == data
    assert decode_data_url(data_url(data, media.upper()), BIG) == data  # (case-insensitive)


@given(st.binary(max_size=256), st.sampled_from(sorted(MEDIA_TYPES)))
def test_any_image_bytes_round_trip_through_a_data_url(tail: bytes, media: str) -> None:
    data = SAMPLES[media] + tail
    assert decode_data_url(data_url(data, media), BIG) == data


@given(st.binary(min_size=1, max_size=64), st.integers(min_value=1, max_value=4096))
def test_the_decoded_size_is_bounded(tail: bytes, limit: int) -> None:
    data = PNG + tail
    if len(data) <= limit:
        assert decode_data_url(data_url(data), Bounds(limit, 100)) == data
    else:
        with pytest.raises(ImageRefused) as err:
            decode_data_url(data_url(data), Bounds(limit, 100))
        assert err.value.code == "image_too_large"


def test_an_oversized_payload_is_refused_before_it_is_decoded() -> None:
    url = "data:image/png;base64," + "A" * 4_000_000  # ~3 MB, bound 1 KB
    with pytest.raises(ImageRefused) as err:
        decode_data_url(url, Bounds(1024, 100))
    assert err.value.code == "image_too_large"


@pytest.mark.parametrize(
    ("url", "code", "words"),
    [
        ("data:image/png;base64," + "!!!!", "invalid_image", "does not decode"),
        ("data:image/png," + "abc", "invalid_image", "must be base64"),
        ("data:image/png;base64", "invalid_image_url", "no ','"),
        ("data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode(), None, "svg"),
        ("data:text/plain;base64," + base64.b64encode(PNG).decode(), None, "text/plain"),
        (data_url(b"not an image at all"), "invalid_image", "not such an image"),
        (data_url(JPEG, "image/png"), "invalid_image", "said to be image/png"),
        ("ftp://example.com/a.png", "invalid_image_url", "data URL"),
        ("x", "invalid_image_url", "data URL"),
        ("https://example.com/" + "a" * 3000, "invalid_image_url", "characters"),
    ],
)
def test_what_is_not_an_accepted_image_is_refused_with_a_reason(
    url: str, code: str | None, words: str
) -> None:
    with pytest.raises(ImageRefused) as err:
        parse_url(url, BIG)
    assert words in str(err.value)
    assert err.value.code == (code or "unsupported_image_type")


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(sorted(FORMATS)),
    st.integers(min_value=1, max_value=700),
    st.integers(min_value=1, max_value=700),
)
def test_the_header_says_the_size_pillow_made(media: str, width: int, height: int) -> None:
    assert dimensions(encoded(media, (width, height)), media) == (width, height)


@pytest.mark.parametrize(
    ("media", "options"),
    [("image/webp", {"lossless": True}), ("image/jpeg", {"progressive": True})],
)
def test_the_other_encodings_headers_too(media: str, options: dict[str, Any]) -> None:
    assert dimensions(encoded(media, (300, 17), **options), media) == (300, 17)
    alpha = io.BytesIO()
    Image.new("RGBA", (33, 44)).save(alpha, "WEBP")  # (an extended, VP8X, header)
    assert dimensions(alpha.getvalue(), "image/webp") == (33, 44)


def test_a_huge_picture_in_a_small_file_is_refused_by_its_pixels() -> None:
    data = encoded("image/png", (4000, 3000))  # (one colour: a few KB)
    assert len(data) < 100_000
    with pytest.raises(ImageRefused) as err:
        checked(data, None, Bounds(1 << 20, 4000 * 3000 - 1))
    assert err.value.code == "image_too_large" and "4000x3000" in str(err.value)
    assert checked(data, None, Bounds(1 << 20, 4000 * 3000)) == data


@given(st.sampled_from(sorted(FORMATS)), st.binary(max_size=200), st.data())
def test_any_bytes_are_an_image_or_refused_never_a_crash(
    media: str, junk: bytes, data: st.DataObject
) -> None:
    """Whatever follows a kind's magic (or is spliced into a real header), the check
    answers the bytes or ``ImageRefused`` -- never an IndexError or a 500."""
    whole = SAMPLES[media]
    at = data.draw(st.integers(min_value=0, max_value=len(whole)))
    for candidate in (MEDIA_TYPES[media][0] + junk, whole[:at] + junk):
        with contextlib.suppress(ImageRefused):
            assert checked(candidate, None, BIG) == candidate


@pytest.mark.parametrize("media", sorted(FORMATS))
def test_a_header_cut_short_is_refused(media: str) -> None:
    whole = SAMPLES[media]
    cut = whole[: {"image/png": 20, "image/gif": 8, "image/webp": 22, "image/jpeg": 30}[media]]
    assert sniff(cut) == media
    with pytest.raises(ImageRefused) as err:
        checked(cut, media, BIG)
    assert "cut short or malformed" in str(err.value)


def test_a_remote_url_is_named_for_the_api_to_fetch() -> None:
    assert parse_url("https://example.com/cat.png", BIG) == Remote("https://example.com/cat.png")
    assert parse_url("HTTP://example.com/cat.png", BIG) == Remote("HTTP://example.com/cat.png")


def test_fetched_bytes_are_judged_as_a_data_urls_are() -> None:
    assert checked(GIF, None, BIG) == GIF
    assert checked(GIF, "image/gif", BIG) == GIF
    with pytest.raises(ImageRefused):
        checked(GIF, "image/png", BIG)
    with pytest.raises(ImageRefused):
        checked(b"<html>", None, BIG)


# -- the parts, in a chat request and in a response's input -------------------------------


def chat(content: Any, role: str = "user") -> ChatCompletionRequest:
    messages = [{"role": "system", "content": "be brief"}, {"role": role, "content": content}]
    body = {"model": "m", "messages": messages}
    return msgspec.convert(body, ChatCompletionRequest)


def test_chat_image_parts_are_found_in_order_and_named() -> None:
    req = chat(
        [
            {"type": "text", "text": "compare"},
            {"type": "image_url", "image_url": {"url": "data:a", "detail": "low"}},
            {"type": "image_url", "image_url": {"url": "data:b"}},
        ]
    )
    assert in_messages(req.messages) == [
        Found("messages[1].content[1]", "data:a", "user"),
        Found("messages[1].content[2]", "data:b", "user"),
    ]
    part = req.messages[1].content[1]  # type: ignore[index]
    assert isinstance(part, ImagePart) and part.image_url.detail == "low"


def test_a_template_is_given_hugging_faces_parts_for_a_message_with_images() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:a"}}
    req = chat([image, {"type": "text", "text": "?"}])
    assert message_dicts(req.messages)[1]["content"] == [
        {"type": "image"},
        {"type": "text", "text": "?"},
    ]
    text_only = chat([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert message_dicts(text_only.messages)[1]["content"] == "ab"  # (as before)


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:a", "detail": "medium"}},
        {"type": "image_url", "image_url": {"url": ""}},
        {"type": "image_url", "image_url": {"url": "data:a", "colour": "red"}},
        {"type": "image_url"},
        {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
    ],
)
def test_a_malformed_part_fails_the_schema(part: dict[str, Any]) -> None:
    with pytest.raises(msgspec.ValidationError):
        chat([part])


def response(input: Any, **extra: Any) -> ResponsesRequest:
    return msgspec.convert({"model": "m", "input": input, **extra}, ResponsesRequest)


def test_responses_input_image_becomes_a_chat_image_part() -> None:
    items = [
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "what is this?"},
                {"type": "input_image", "image_url": "data:x", "detail": "auto"},
            ],
        }
    ]
    body = response(items, instructions="be brief")
    req = msgspec.convert(chat_body(body, items), ChatCompletionRequest)
    assert in_messages(req.messages) == [Found("messages[1].content[1]", "data:x", "user")]
    assert in_items(items) == [Found("input[0].content[1]", "data:x", "user")]
    # an earlier response's images are the chain's
    assert in_items(items + items, own_from=1) == [
        Found("previous_response_id", "data:x", "user"),
        Found("input[0].content[1]", "data:x", "user"),
    ]


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "input_image", "file_id": "file-1"}, "input.0.content.0.image_url"),
        ({"type": "input_image", "image_url": "data:x", "size": 3}, "input.0.content.0.size"),
        ({"type": "input_file", "file_id": "file-1"}, "input.0.content.0.type"),
    ],
)
def test_what_responses_cannot_take_of_an_image_is_named(part: dict[str, Any], param: str) -> None:
    items = [{"type": "message", "role": "user", "content": [part]}]
    with pytest.raises(InvalidRequest) as err:
        chat_body(response(items), items)
    assert err.value.param == param


# -- the 400s before any decoding ---------------------------------------------------------

TWO = [Found("messages[0].content[1]", "data:a", "user"), Found("input[2].content[0]", "", "user")]


def test_a_model_that_does_not_see_is_named_with_the_first_image() -> None:
    with pytest.raises(InvalidRequest) as err:
        check_seen(TWO, "SmolLM2-135M-Instruct", sees=False, max_images=8)
    assert err.value.param == "messages[0].content[1]"
    assert err.value.code == "image_input_not_supported"
    assert "'SmolLM2-135M-Instruct' does not accept images" in err.value.message
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_no_images_no_check_and_a_model_that_sees_takes_them() -> None:
    check_seen([], "m", sees=False, max_images=0)
    check_seen(TWO, "m", sees=True, max_images=2)


def test_more_images_than_allowed_names_the_first_over() -> None:
    with pytest.raises(InvalidRequest) as err:
        check_seen(TWO, "m", sees=True, max_images=1)
    assert (err.value.param, err.value.code) == ("input[2].content[0]", "too_many_images")


def test_images_outside_a_user_message_are_refused() -> None:
    with pytest.raises(InvalidRequest) as err:
        check_seen([Found("messages[0].content[0]", "", "system")], "m", True, 8)
    assert err.value.param == "messages[0].content[0]"


# -- the worker's side: the job carries the bytes, vLLM's prompt gets the pictures ---------


def test_a_job_carries_its_images_and_an_older_job_has_none() -> None:
    from service.store.queue import Job, decode_job, encode_job
    from service.stream.params import SamplingParams

    job = Job("r", [1, 2], SamplingParams(max_tokens=3), images=(PNG, GIF))
    assert decode_job(encode_job(job)).images == (PNG, GIF)
    older = msgspec.msgpack.encode(["r", [1, 2], SamplingParams(max_tokens=3)])
    assert decode_job(older).images == ()


async def test_vllms_prompt_has_the_pictures_in_order() -> None:
    import io

    from PIL import Image

    from workers.engines.base import EngineError
    from workers.engines.vllm_prompt import prompt

    def encoded(colour: tuple[int, int, int], kind: str) -> bytes:
        out = io.BytesIO()
        Image.new("RGB", (3, 2), colour).save(out, kind)
        return out.getvalue()

    assert await prompt([5, 6], (), sees=False) == {"prompt_token_ids": [5, 6]}
    made = await prompt([5], [encoded((255, 0, 0), "PNG"), encoded((0, 0, 255), "GIF")], True)
    pictures = made["multi_modal_data"]["image"]
    assert [p.mode for p in pictures] == ["RGB", "RGB"]
    assert [p.getpixel((0, 0)) for p in pictures] == [(255, 0, 0), (0, 0, 255)]
    with pytest.raises(EngineError) as err:
        await prompt([5], [PNG[:40]], sees=True)  # (a PNG's header, no image behind it)
    assert err.value.code == "invalid_image"
    with pytest.raises(EngineError) as err:
        await prompt([5], [PNG], sees=False)
    assert err.value.code == "invalid_request"
