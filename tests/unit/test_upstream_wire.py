"""Token mode's side of ``upstream_wire`` (no I/O): ``Retry-After`` read as
delta-seconds or an HTTP date, ``token_id:N`` both ways, a streamed chunk as a step
(well-formed ones exactly, malformed ones only ever as ``EngineError``), the body of a
call for any sampling parameters, and which answers may be continued."""

from __future__ import annotations

import datetime
import email.utils
import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.stream.params import MAX_LOGPROBS, SamplingParams, Structured
from workers.engines import upstream_wire as wire
from workers.engines.base import EngineError

NOW = 1_800_000_000.0  # a whole second: HTTP dates have no finer ones
ids = st.lists(st.integers(0, 200_000), max_size=6)
logprob = st.floats(-1e4, 0.0, allow_nan=False)
structures = st.none() | st.sampled_from(
    [
        Structured(kind="json_object"),
        Structured(kind="json_schema", schema=json.dumps({"type": "object"})),
    ]
)
params_strategy = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 4096),
    temperature=st.floats(0.0, 2.0),
    top_p=st.floats(0.01, 1.0),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    presence_penalty=st.sampled_from([0.0, 0.5, -2.0]),
    frequency_penalty=st.sampled_from([0.0, 1.0]),
    repetition_penalty=st.floats(0.1, 2.0),
    top_k=st.integers(-1, 100),
    min_p=st.floats(0.0, 1.0),
    min_tokens=st.integers(0, 64),
    ignore_eos=st.booleans(),
    logit_bias=st.none() | st.dictionaries(st.integers(0, 50_000), st.floats(-100, 100)),
    stop_token_ids=st.lists(st.integers(0, 50_000), max_size=4).map(tuple),
    logprobs=st.none() | st.integers(0, MAX_LOGPROBS),
    structured=structures,
)


# -- Retry-After -----------------------------------------------------------------------


@given(st.integers(0, 10**7) | st.floats(0, 1e7, allow_nan=False))
def test_retry_after_in_seconds_is_capped(seconds: float) -> None:
    headers = httpx.Headers({"Retry-After": f" {seconds} "})
    assert wire.retry_after(headers) == min(float(seconds), wire.MAX_RETRY_AFTER_S)


@given(st.integers(-(10**6), 10**6))
def test_retry_after_as_an_http_date_counts_from_now(offset: int) -> None:
    when = datetime.datetime.fromtimestamp(NOW + offset, tz=datetime.UTC)
    headers = httpx.Headers({"retry-after": email.utils.format_datetime(when, usegmt=True)})
    want = min(max(float(offset), 0.0), wire.MAX_RETRY_AFTER_S)
    assert wire.retry_after(headers, now=NOW) == want


@given(st.text(max_size=40))
def test_retry_after_of_anything_is_none_or_within_bounds(raw: str) -> None:
    try:
        headers = httpx.Headers({"retry-after": raw})
    except (UnicodeEncodeError, httpx.LocalProtocolError):
        return  # (not a header value httpx would hand over)
    value = wire.retry_after(headers, now=NOW)
    assert value is None or 0.0 <= value <= wire.MAX_RETRY_AFTER_S


def test_retry_after_absent_negative_or_not_a_number() -> None:
    assert wire.retry_after(httpx.Headers()) is None
    assert wire.retry_after(httpx.Headers({"retry-after": "-5"})) == 0.0
    assert wire.retry_after(httpx.Headers({"retry-after": "nan"})) is None
    assert wire.retry_after(httpx.Headers({"retry-after": "soon"})) is None


# -- token_id:N ------------------------------------------------------------------------


@given(st.integers(0, 2**40))
def test_token_id_round_trips(n: int) -> None:
    assert wire.token_id(f"token_id:{n}") == n


@given(st.text(max_size=20))
def test_a_token_not_spelled_token_id_n_is_an_engine_error(token: str) -> None:
    well_formed = token.startswith("token_id:") and token[9:].isascii() and token[9:].isdigit()
    if well_formed:
        assert wire.token_id(token) == int(token[9:])
    else:
        with pytest.raises(EngineError) as raised:
            wire.token_id(token)
        assert raised.value.code == wire.FAILED


@pytest.mark.parametrize("token", ["token_id:²", "token_id:-3", "token_id:", "id:4", "4"])
def test_token_id_refuses_what_is_not_a_plain_id(token: str) -> None:
    with pytest.raises(EngineError):
        wire.token_id(token)


# -- chunks ------------------------------------------------------------------------------


@st.composite
def chunks(draw: st.DrawFn) -> tuple[dict[str, Any], list[int], str | None, int | None]:
    """A vLLM completions chunk in token mode: its ids, finish reason and logprobs (k)."""
    token_ids = draw(ids)
    reason = draw(st.sampled_from([None, "stop", "length", "abort"]))
    k = draw(st.none() | st.integers(0, 5))
    choice: dict[str, Any] = {"index": 0, "text": "x", "token_ids": token_ids}
    choice |= {"finish_reason": reason, "stop_reason": None, "logprobs": None}
    if k is not None:
        tops = []
        for t in token_ids:
            top = draw(st.dictionaries(st.integers(0, 200_000), logprob, max_size=k))
            top[t] = draw(logprob)  # (vLLM lists the sampled id among them)
            tops.append({f"token_id:{i}": v for i, v in top.items()})
        choice["logprobs"] = {
            "tokens": [f"token_id:{t}" for t in token_ids],
            "token_logprobs": [next(iter(t.values())) for t in tops],
            "top_logprobs": tops,
            "text_offset": [0] * len(token_ids),
        }
    return {"object": "text_completion", "choices": [choice]}, token_ids, reason, k


@given(chunks())
def test_a_well_formed_chunk_is_its_step(case: Any) -> None:
    chunk, token_ids, reason, k = case
    step = wire.step_of(chunk, SamplingParams(max_tokens=8, logprobs=k))
    assert step is not None
    assert step.token_ids == token_ids
    assert step.finished == (reason is not None)
    assert step.finish_reason == (None if reason is None else reason)
    if k is None:
        assert step.logprobs is None
        return
    assert step.logprobs is not None and len(step.logprobs) == len(token_ids)
    tops = chunk["choices"][0]["logprobs"]["top_logprobs"]
    for sampled, top in zip(step.logprobs, tops, strict=True):
        values = [v for _, v in sampled.top]
        assert len(sampled.top) == min(k, len(top))
        assert values == sorted(values, reverse=True)  # best first
        assert all(top[f"token_id:{i}"] == v for i, v in sampled.top)
        assert math.isfinite(sampled.logprob)


def test_chunks_without_a_choice_or_with_an_error() -> None:
    params = SamplingParams(max_tokens=8)
    assert wire.step_of({"choices": [], "usage": {"completion_tokens": 3}}, params) is None
    for error in ({"message": "boom", "code": 500}, "boom"):
        with pytest.raises(EngineError, match="boom") as raised:
            wire.step_of({"error": error}, params)
        assert raised.value.code == wire.FAILED
    with pytest.raises(EngineError, match="token mode"):  # a server that only streams text
        wire.step_of({"choices": [{"text": "hi", "finish_reason": None}]}, params)
    unknown = wire.step_of({"choices": [{"token_ids": [], "finish_reason": "odd"}]}, params)
    assert unknown is not None and unknown.finished and unknown.finish_reason == "abort"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
choice_like = st.fixed_dictionaries(
    {},
    optional={
        "token_ids": json_values | st.lists(st.integers(-5, 10) | json_values, max_size=3),
        "finish_reason": json_values,
        "logprobs": json_values,
    },
)
malformed = json_values | st.fixed_dictionaries(
    {}, optional={"choices": json_values | st.lists(choice_like | json_values, max_size=2)}
)


@given(malformed, st.none() | st.integers(0, 3))
def test_a_malformed_chunk_is_a_step_or_an_engine_error_never_another_exception(
    chunk: Any, k: int | None
) -> None:
    try:
        step = wire.step_of(chunk, SamplingParams(max_tokens=8, logprobs=k))
    except EngineError as exc:
        assert exc.code == wire.FAILED
        return
    if step is not None:
        assert all(type(t) is int and t >= 0 for t in step.token_ids)


@given(st.integers(0, 4), st.integers(0, 4))
def test_logprobs_for_another_count_of_ids_are_an_engine_error(given_: int, count: int) -> None:
    logprobs = {"token_logprobs": [-0.5] * given_, "top_logprobs": [{"token_id:1": -0.5}] * given_}
    if given_ == count:
        assert len(wire.sampled(logprobs, 1, count)) == count
    else:
        with pytest.raises(EngineError):
            wire.sampled(logprobs, 1, count)


# -- the body of a call ---------------------------------------------------------------------


@given(
    params_strategy,
    st.lists(st.integers(0, 50_000), min_size=1, max_size=8),
    st.integers(1, 4096),
    st.integers(0, 4096),
    st.lists(st.integers(0, 50_000), max_size=2),
)
def test_the_token_body_asks_vllm_for_exactly_the_request(
    params: SamplingParams, prompt: list[int], left: int, generated: int, eos: list[int]
) -> None:
    body = wire.token_body("m", prompt, params, left, generated, eos)
    assert json.loads(json.dumps(body)) == body  # (plain JSON, string keys)
    assert body["model"] == "m" and body["prompt"] == prompt and body["max_tokens"] == left
    assert body["stream"] is True and body["return_token_ids"] is True
    assert "stop" not in body  # stop strings stay with the project's holdback
    assert body["min_tokens"] == min(max(params.min_tokens - generated, 0), left)
    assert body["top_k"] == (params.top_k if params.top_k > 0 else -1)
    for name in ("temperature", "top_p", "min_p", "ignore_eos", "repetition_penalty"):
        assert body[name] == getattr(params, name)
    stops = body["stop_token_ids"]
    assert len(stops) == len(set(stops))
    assert set(stops) == set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    assert body.get("seed") == params.seed
    assert {int(t): v for t, v in body.get("logit_bias", {}).items()} == (params.logit_bias or {})
    assert body.get("logprobs") == params.logprobs
    assert body.get("return_tokens_as_token_ids", False) == (params.logprobs is not None)
    s = params.structured
    want = None if s is None else {"json_object": True} if s.schema is None else {"json": s.schema}
    assert body.get("structured_outputs") == want


@given(params_strategy, ids)
def test_only_what_counts_output_ids_is_not_continuable(
    params: SamplingParams, generated: list[int]
) -> None:
    counts_output = bool(
        params.presence_penalty or params.frequency_penalty or params.structured is not None
    )
    assert wire.continuable(params, generated) == (not generated or not counts_output)


@given(st.integers(400, 599), st.binary(max_size=2000))
def test_a_refusal_names_the_status_and_says_rejected_for_4xx(status: int, body: bytes) -> None:
    error = wire.refusal(status, body)
    assert error.code == (wire.REJECTED if status < 500 else wire.FAILED)
    assert str(status) in str(error) and len(str(error)) < 700
