"""The Responses API renderer (``service/stream/responses.py``) over logs built by hand.

A log is generated from a *plan* (text segments and calls, what the answer is) cut
arbitrarily into deltas, so the properties check the real answer -- the text, the
arguments, the items -- not only that the cutting changes nothing. A small accumulator
in the manner of the SDK's stream state rebuilds the response from the events alone.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.stream.events import Created, Delta, End, Error, Event
from service.stream.logprobs import Alternative, Logprob
from service.stream.response_events import Frame, ResponsesRenderer, frames_after
from service.stream.response_items import item_id
from service.stream.toolscan import Piece, ToolFragment

PROPS = settings(max_examples=80, deadline=None)
SPICE = ["é", "€", "日本語", "🤖", "👩‍👩‍👧", " ", "\n", "\u2028", '"', "\\", "ab", "\u0301"]
ARGS = ['{"city": ', '"Paris"', ', "n": 1', "}", '"é🤖"', "[1, 2]", " ", "\\n"]
RID = "resp_0123"
CREATED = Created(kind="responses", model="tiny", created=1_700_000_000, prompt_tokens=7)
STOP = End("finished", "stop", 7, 0)

texts = (
    st.lists(st.one_of(st.sampled_from(SPICE), st.text(max_size=4)), min_size=1, max_size=6)
    .map("".join)
    .filter(bool)
)
segments = st.one_of(
    st.tuples(st.just("text"), texts),
    st.tuples(st.sampled_from(["get_weather", "f", "日本"]), st.lists(st.sampled_from(ARGS))).map(
        lambda t: (t[0], "".join(t[1]))
    ),
)
plans = st.lists(segments, max_size=6)
cuts_st = st.lists(st.integers(0, 10_000), max_size=30)
breaks_st = st.lists(st.booleans(), min_size=1, max_size=12)
blanks_st = st.lists(st.integers(0, 50), max_size=3)

Plan = list[tuple[str, str]]  # ("text", text) or (function name, arguments text)


def chunked(text: str, cuts: Sequence[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def pieces(plan: Plan, cuts: Sequence[int]) -> list[Piece]:
    """The plan's text and calls as the parser would log them, each cut at ``cuts``."""
    out: list[Piece] = []
    calls = 0
    for kind, body in plan:
        parts = chunked(body, cuts)
        if kind == "text":
            out += parts
            continue
        first, *rest = parts or [""]
        out.append(ToolFragment(calls, f"call_{calls}", kind, first))
        out += [ToolFragment(calls, arguments=p) for p in rest]
        calls += 1
    return out


def log(
    plan: Plan,
    cuts: Sequence[int] = (),
    breaks: Sequence[bool] = (True,),
    blanks: Sequence[int] = (),
    end: End = STOP,
) -> list[Event]:
    """Created, the pieces packed into deltas (text before a delta's calls, a new delta
    where ``breaks`` says), token-only deltas at ``blanks``, then ``end``."""
    groups: list[tuple[list[str], list[ToolFragment]]] = []
    for i, p in enumerate(pieces(plan, cuts)):
        if not groups or breaks[i % len(breaks)] or (isinstance(p, str) and groups[-1][1]):
            groups.append(([], []))
        if isinstance(p, str):
            groups[-1][0].append(p)
        else:
            groups[-1][1].append(p)
    for b in blanks:
        groups.insert(b % (len(groups) + 1), ([], []))
    deltas = [
        Delta("".join(t), [k], k + 1, tools=tools or None) for k, (t, tools) in enumerate(groups)
    ]
    tail = End(end.state, end.finish_reason, end.prompt_tokens, len(deltas))
    return [CREATED, *deltas, tail]


def expected_output(plan: Plan) -> list[tuple[str, str]]:
    """The items the plan makes: adjacent text segments are one message."""
    out: list[tuple[str, str]] = []
    for kind, body in plan:
        if kind == "text" and out and out[-1][0] == "message":
            out[-1] = ("message", out[-1][1] + body)
        else:
            out.append(("message", body) if kind == "text" else (f"call:{kind}", body))
    return out


def render(events: Sequence[Event], params: dict[str, Any] | None = None) -> list[Frame]:
    return frames_after(ResponsesRenderer(RID, CREATED, params or {}), events, None)


def items_of(response: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for item in response["output"]:
        if item["type"] == "message":
            out.append(("message", item["content"][0]["text"]))
        else:
            out.append((f"call:{item['name']}", item["arguments"]))
    return out


def accumulate(frames: list[Frame]) -> dict[str, Any]:
    """The response rebuilt from the events alone, as the SDK's stream state does it,
    checking on the way that each event refers to the item that is open."""
    snapshot: dict[str, Any] = json.loads(frames[0].json())["response"]
    open_index: int | None = None
    for f in frames[1:]:
        d = json.loads(f.json())
        if f.type == "response.output_item.added":
            assert open_index is None, "an item was added while another was open"
            assert d["output_index"] == len(snapshot["output"])
            snapshot["output"].append(d["item"])
            open_index = d["output_index"]
        elif f.type == "response.output_item.done":
            assert d["output_index"] == open_index
            snapshot["output"][open_index] = d["item"]
            open_index = None
        elif "item_id" in d:
            assert d["output_index"] == open_index
            item = snapshot["output"][open_index]
            assert d["item_id"] == item["id"]
            if f.type == "response.content_part.added":
                item["content"].append(d["part"])
            elif f.type == "response.output_text.delta":
                item["content"][d["content_index"]]["text"] += d["delta"]
            elif f.type == "response.function_call_arguments.delta":
                item["arguments"] += d["delta"]
            elif f.type == "response.output_text.done":
                assert d["text"] == item["content"][0]["text"]
            elif f.type == "response.function_call_arguments.done":
                assert (d["name"], d["arguments"]) == (item["name"], item["arguments"])
    assert open_index is None
    return snapshot


@PROPS
@given(plan=plans, cuts=cuts_st, breaks=breaks_st, blanks=blanks_st)
def test_a_well_formed_stream(
    plan: Plan, cuts: list[int], breaks: list[bool], blanks: list[int]
) -> None:
    """Sequence numbers 0..k-1, each frame's type in its data, one final event, last."""
    frames = render(log(plan, cuts, breaks, blanks))
    assert [f.sequence_number for f in frames] == list(range(len(frames)))
    assert all(json.loads(f.json())["type"] == f.type for f in frames)
    assert [f.type for f in frames[:2]] == ["response.created", "response.in_progress"]
    finals = [f for f in frames if f.type == "response.completed"]
    assert finals == [frames[-1]]


@PROPS
@given(plan=plans, cuts=cuts_st, breaks=breaks_st, blanks=blanks_st)
def test_the_deltas_join_to_the_done_events_and_the_final_items(
    plan: Plan, cuts: list[int], breaks: list[bool], blanks: list[int]
) -> None:
    frames = render(log(plan, cuts, breaks, blanks))
    final = frames[-1].data["response"]
    rebuilt = accumulate(frames)  # the deltas, joined; checked against each .done
    assert items_of(rebuilt) == items_of(final) == expected_output(plan)
    done = [f.data["item"] for f in frames if f.type == "response.output_item.done"]
    assert done == final["output"] == rebuilt["output"]
    assert all(item["status"] == "completed" for item in done)


@PROPS
@given(
    plan=plans,
    a=st.tuples(cuts_st, breaks_st, blanks_st),
    b=st.tuples(cuts_st, breaks_st, blanks_st),
)
def test_any_split_gives_the_same_response(
    plan: Plan,
    a: tuple[list[int], list[bool], list[int]],
    b: tuple[list[int], list[bool], list[int]],
) -> None:
    """Where the deltas fall is invisible in the response (bar the token count)."""
    end = End("finished", "stop", 7, 5)
    ra, rb = (ResponsesRenderer(RID, CREATED, {}) for _ in range(2))
    fa = frames_after(ra, [*log(plan, *a)[:-1], end], None)
    fb = frames_after(rb, [*log(plan, *b)[:-1], end], None)
    assert fa[-1].type == fb[-1].type == "response.completed"
    same = [json.dumps(f[-1].data["response"], ensure_ascii=False).encode() for f in (fa, fb)]
    assert same[0] == same[1]
    assert ra.response_object() == rb.response_object() == fa[-1].data["response"]
    assert items_of(ra.response_object()) == expected_output(plan)


@PROPS
@given(plan=plans, cuts=cuts_st, breaks=breaks_st)
def test_resume_after_any_sequence_number_is_the_rest_of_the_stream(
    plan: Plan, cuts: list[int], breaks: list[bool]
) -> None:
    events = log(plan, cuts, breaks)
    whole = [f.json() for f in render(events)]
    for after in range(-1, len(whole) + 1):
        rest = frames_after(ResponsesRenderer(RID, CREATED, {}), events, after)
        assert [f.json() for f in rest] == whole[after + 1 :]


def test_frames_after_needs_a_fresh_renderer() -> None:
    renderer = ResponsesRenderer(RID, CREATED, {})
    renderer.feed(CREATED)
    with pytest.raises(ValueError, match="rendered nothing yet"):
        frames_after(renderer, log([("text", "hi")])[1:], 3)


@PROPS
@given(plan=plans, cuts=cuts_st, breaks=breaks_st)
def test_rendering_twice_gives_the_same_bytes(
    plan: Plan, cuts: list[int], breaks: list[bool]
) -> None:
    params = {"metadata": {"k": "v"}, "tools": [{"type": "function", "name": "f"}]}
    events = log(plan, cuts, breaks)
    first, second = render(events, params), render(events, params)
    assert b"\n".join(f.json() for f in first) == b"\n".join(f.json() for f in second)
    assert all(json.loads(f.json()) == f.data for f in first)


ENDINGS = [
    # state, finish_reason, final event, status, item status, incomplete_details
    ("finished", "stop", "response.completed", "completed", "completed", None),
    ("finished", "tool_calls", "response.completed", "completed", "completed", None),
    ("finished", "length", "response.incomplete", "incomplete", "incomplete", "max_output_tokens"),
    ("cancelled", "cancelled", "response.cancelled", "cancelled", "incomplete", None),
    ("abandoned", "abandoned", "response.cancelled", "cancelled", "incomplete", None),
    ("errored", None, "response.failed", "failed", "incomplete", None),
]


@pytest.mark.parametrize(("state", "reason", "event", "status", "item", "why"), ENDINGS)
def test_each_ending_has_its_event_and_status(
    state: str, reason: str | None, event: str, status: str, item: str, why: str | None
) -> None:
    events = log(
        [("text", "Hé"), ("f", '{"a": 1'), ("text", "🤖")], [1], end=End(state, reason, 7, 0)
    )
    if state == "errored":
        events.insert(-1, Error("engine_error", "the engine failed"))
    frames = render(events)
    response = frames[-1].data["response"]
    assert (frames[-1].type, response["status"]) == (event, status)
    assert [o["status"] for o in response["output"]] == ["completed", "completed", item]
    assert response["incomplete_details"] == (why and {"reason": why})
    expected_error = {"code": "engine_error", "message": "the engine failed"}
    assert response["error"] == (expected_error if state == "errored" else None)
    assert response["usage"] == {
        "input_tokens": 7,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 12,
    }
    assert "output_text" not in response


def test_an_errored_end_without_its_error_still_fails_with_one() -> None:
    frames = render([CREATED, End("errored", None, 7, 0)])
    assert frames[-1].type == "response.failed"
    assert frames[-1].data["response"]["error"]["code"] == "server_error"


def test_a_tool_call_after_text_closes_the_message_first() -> None:
    events: list[Event] = [
        CREATED,
        Delta("Let me ", [1], 1),
        Delta("look.", [2], 2, tools=[ToolFragment(0, "call_a", "get_weather", '{"city"')]),
        Delta("", [3], 3, tools=[ToolFragment(0, arguments=': "Paris"}')]),
        End("finished", "tool_calls", 7, 3),
    ]
    assert [(f.type, f.data.get("output_index")) for f in render(events)] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.output_text.delta", 0),
        ("response.output_text.delta", 0),
        ("response.output_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1),
        ("response.output_item.done", 1),
        ("response.completed", None),
    ]
    call = render(events)[-1].data["response"]["output"][1]
    assert call == {
        "id": item_id(RID, 1, "fc"),
        "type": "function_call",
        "status": "completed",
        "arguments": '{"city": "Paris"}',
        "call_id": "call_a",
        "name": "get_weather",
    }


def test_item_ids_come_from_the_response_and_the_place() -> None:
    events = log([("text", "a"), ("f", "{}"), ("g", "{}"), ("text", "b")])
    ids = [o["id"] for o in render(events)[-1].data["response"]["output"]]
    assert [i.split("_")[0] for i in ids] == ["msg", "fc", "fc", "msg"]
    assert len(set(ids)) == 4
    assert ids == [item_id(RID, k, p) for k, p in enumerate(["msg", "fc", "fc", "msg"])]
    other = frames_after(ResponsesRenderer("resp_other", CREATED, {}), events, None)
    assert not set(ids) & {o["id"] for o in other[-1].data["response"]["output"]}


def test_a_background_response_is_queued_until_its_first_delta() -> None:
    frames = render(log([("text", "hi")]), {"background": True})
    assert [(f.type, f.data.get("response", {}).get("status")) for f in frames[:4]] == [
        ("response.created", "queued"),
        ("response.queued", "queued"),
        ("response.in_progress", "in_progress"),
        ("response.output_item.added", None),
    ]
    cancelled = render([CREATED, End("cancelled", "cancelled", 7, 0)], {"background": True})
    assert [f.type for f in cancelled] == [
        "response.created",
        "response.queued",
        "response.cancelled",
    ]
    assert cancelled[-1].data["response"]["output"] == []


def test_the_response_echoes_the_params_with_openai_defaults() -> None:
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    params = {"tools": tools, "temperature": 0.2, "metadata": {"k": "v"}, "prompt_cache_key": "x"}
    response = render(log([("text", "hi")]), params)[0].data["response"]
    # the spec's FunctionTool: every field, null where the request left it out
    echoed = [{**tools[0], "description": None, "strict": None}]
    assert response["tools"] == echoed and response["temperature"] == 0.2
    assert response["completed_at"] is None and response["safety_identifier"] is None
    assert response["presence_penalty"] == 0.0 and response["frequency_penalty"] == 0.0
    assert response["metadata"] == {"k": "v"} and response["prompt_cache_key"] == "x"
    assert response["model"] == "tiny" and response["created_at"] == CREATED.created
    assert response["top_p"] == 1.0 and response["tool_choice"] == "auto"
    assert response["text"] == {"format": {"type": "text"}}
    assert response["parallel_tool_calls"] is True and response["background"] is False
    assert response["usage"] is None and response["output"] == []
    assert render(log([]), {"model": "alias"})[0].data["response"]["model"] == "alias"
    with pytest.raises(ValueError, match="status"):
        ResponsesRenderer(RID, CREATED, {"status": "completed"})


def _lp(token: str) -> Logprob:
    return Logprob(token, token.encode(), -0.5, [Alternative("x", b"x", -1.0)])


def test_logprobs_go_with_the_text_that_carries_them() -> None:
    events: list[Event] = [
        CREATED,
        Delta("", [1], 1, logprobs=[_lp("H")]),  # its text held back: waits for the next
        Delta("Hé", [2], 2, logprobs=[_lp("é")]),
        Delta("", [3], 3, logprobs=[_lp("{")], tools=[ToolFragment(0, "c", "f", "{}")]),
        Delta("!", [4], 4, logprobs=[_lp("!")]),
        Delta("", [5], 5, logprobs=[_lp("?")]),  # the last tokens, at the end
        End("finished", "stop", 7, 5),
    ]
    frames = render(events)
    deltas = [f.data for f in frames if f.type == "response.output_text.delta"]
    assert [(d["delta"], [lp["token"] for lp in d["logprobs"]]) for d in deltas] == [
        ("Hé", ["H", "é"]),
        ("!", ["!"]),
        ("", ["?"]),
    ]
    assert deltas[0]["logprobs"][0] == {
        "token": "H",
        "logprob": -0.5,
        "top_logprobs": [{"token": "x", "logprob": -1.0}],
    }
    done = [f.data for f in frames if f.type == "response.output_text.done"]
    assert [[lp["token"] for lp in d["logprobs"]] for d in done] == [["H", "é"], ["!", "?"]]
    part = frames[-1].data["response"]["output"][0]["content"][0]
    assert part["logprobs"][1] == {
        "token": "é",
        "bytes": list("é".encode()),
        "logprob": -0.5,
        "top_logprobs": [{"token": "x", "bytes": [120], "logprob": -1.0}],
    }


def test_a_log_the_responses_api_cannot_show_is_refused() -> None:
    def feed_all(events: list[Event]) -> None:
        renderer = ResponsesRenderer(RID, CREATED, {})
        for event in events:
            renderer.feed(event)

    cases: list[tuple[list[Event], str]] = [
        ([CREATED, Delta("a", [1], 1, index=1)], "one output"),
        ([Delta("a", [1], 1)], "starts with Created"),
        ([CREATED, CREATED], "second Created"),
        ([CREATED, STOP, Delta("a", [1], 1)], "after its End"),
        ([CREATED, Delta("", [1], 1, tools=[ToolFragment(0, arguments="{")])], "not the open"),
        ([CREATED, Delta("", [1], 1, tools=[ToolFragment(0, "c", None, "")])], "no name"),
        ([CREATED, End("finished", None, 7, 0)], "finish_reason"),
        ([CREATED, End("running", None, 7, 0)], "non-terminal"),
        ([CREATED, Error("e", "m"), STOP], "an Error, then"),
        ([CREATED, Error("e", "m"), Delta("a", [1], 1)], "only the End"),
    ]
    for events, message in cases:
        with pytest.raises(ValueError, match=message):
            feed_all(events)
    with pytest.raises(ValueError, match="n=2"):
        ResponsesRenderer(RID, Created("responses", "tiny", 0, 1, n=2), {})
