"""One sampling-parameters struct from the request schema to the engine."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.api.schemas import ChatCompletionRequest, CompletionRequest
from service.store.queue import Job, decode_job, encode_job
from service.stream.params import REQUEST_FIELDS, RESOLVED_BY_API, SamplingParams

SCHEMAS = (ChatCompletionRequest, CompletionRequest)
PARAM_FIELDS = {f.name for f in msgspec.structs.fields(SamplingParams)}


@pytest.mark.parametrize("schema", SCHEMAS)
def test_every_sampling_parameter_is_a_request_field(schema: type[msgspec.Struct]) -> None:
    names = {f.name for f in msgspec.structs.fields(schema)}
    # max_tokens, stop and logprobs are declared by the schemas themselves; structured
    # comes from response_format / tool_choice
    assert names >= PARAM_FIELDS - {"structured"}
    assert set(REQUEST_FIELDS) == PARAM_FIELDS - RESOLVED_BY_API


def test_null_means_the_default_and_given_values_travel() -> None:
    body = msgspec.json.decode(
        b'{"model": "m", "messages": [], "temperature": null, "top_p": 0.5, "seed": 7}',
        type=ChatCompletionRequest,
    )
    params = SamplingParams.from_request(body, max_tokens=3, stop=("x",))
    assert params == SamplingParams(max_tokens=3, stop=("x",), top_p=0.5, seed=7)
    assert params.temperature == SamplingParams(max_tokens=1).temperature


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 2.5),
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("seed", 1.5),
    ],
)
def test_the_bounds_are_the_schemas(field: str, value: object) -> None:
    raw = msgspec.json.encode({"model": "m", "prompt": "p", field: value})
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.json.decode(raw, type=CompletionRequest)


@given(
    st.integers(1, 10_000),
    st.floats(0, 2),
    st.floats(0.01, 1),
    st.none() | st.integers(-(2**63), 2**63 - 1),
    st.lists(st.text(min_size=1, max_size=5), max_size=4),
)
def test_the_job_carries_them_unchanged(
    max_tokens: int, temperature: float, top_p: float, seed: int | None, stop: list[str]
) -> None:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=tuple(stop)
    )
    job = Job(request_id="r", prompt_token_ids=[1, 2], params=params)
    assert decode_job(encode_job(job)).params == params
