"""Tool-call parsers: every split of an output into ``feed`` calls gives the content and
the calls the output was built from; arguments are the model's JSON text byte for byte.

The outputs are generated together with what they must parse into (content segments,
calls with their raw arguments text), so the properties check the real answer, not only
that chunking changes nothing. The last property goes the real path: ids from the
``tiny_model`` tokenizer, detokenized incrementally in random steps.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from service.stream.detokenize import Detokenizer
from service.stream.tool_prompts import detect_format, forced_schema, tool_system_prompt
from service.stream.tools import (
    CALL_END,
    CALL_START,
    PYTHON_TAG,
    Piece,
    ToolFormat,
    ToolFragment,
    ToolParser,
    parser_for,
)
from service.tokenize import ModelInfo
from tests.unit.conftest import CHAT_TEMPLATE

Call = tuple[str, str, str]  # id, name, arguments text
PROPS = settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def call_id(index: int) -> str:
    return f"call_{index}"


def parser(kind: str, name: str | None = None, parallel: bool = True) -> ToolParser:
    return parser_for(ToolFormat(kind, name, parallel), call_id)


def chunked(text: str, cuts: Sequence[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def _mergeable(a: Piece, b: Piece) -> bool:
    if isinstance(a, str) or isinstance(b, str):
        return isinstance(a, str) and isinstance(b, str)
    return a.call == b.call


def absorb(pieces: list[Piece], content: list[str], calls: list[list[str]]) -> None:
    """Checks what one feed returned (merged, well-formed fragments) and adds it up."""
    assert not any(_mergeable(a, b) for a, b in itertools.pairwise(pieces)), pieces
    for piece in pieces:
        if isinstance(piece, str):
            assert piece
            content.append(piece)
        elif piece.call == len(calls):  # a new call: it has its id and name
            assert piece.id == call_id(piece.call)
            assert piece.name is not None
            calls.append([piece.id, piece.name, piece.arguments])
        else:
            assert piece.call == len(calls) - 1, (piece, calls)
            assert piece.id is None and piece.name is None and piece.arguments
            calls[-1][2] += piece.arguments


def collect(p: ToolParser, chunks: Sequence[str]) -> tuple[str, list[Call]]:
    content: list[str] = []
    calls: list[list[str]] = []
    for chunk in chunks:
        absorb(p.feed(chunk), content, calls)
        assert p.calls == len(calls)
    absorb(p.finish(), content, calls)
    assert p.calls == len(calls)
    return "".join(content), [(c[0], c[1], c[2]) for c in calls]


# -- generated outputs ----------------------------------------------------------------

BITS = ["Zürich", "東京", "🤖", "👩‍👩‍👧", "a", " ", "\n", '"', "\\", "{", "}", ";", ","]
BITS += [CALL_START, CALL_END, "[", "]", "<", ":"]
strings = st.lists(st.sampled_from(BITS), max_size=5).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(-1e6, 1e6) | strings,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(strings, kids, max_size=3),
    max_leaves=6,
)
spaces = st.sampled_from(["", " ", "\n", "\n  ", "\t"])
names = st.sampled_from(["get_weather", "search", "Zürich_lookup", "東京", 'say "hi"', "a\\b"])


@st.composite
def arguments_texts(draw: st.DrawFn) -> str:
    """An arguments object as a model may write it: any spacing, escaped or raw UTF-8."""
    value = draw(st.dictionaries(strings, json_values, max_size=3))
    indent = draw(st.sampled_from([None, 2]))
    separators = draw(st.sampled_from([(", ", ": "), (",", ":"), (" , ", " : ")]))
    ensure_ascii = draw(st.booleans())
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators)


@st.composite
def call_objects(
    draw: st.DrawFn, keys: Sequence[str] = ("arguments", "parameters")
) -> tuple[str, tuple[str, str]]:
    """``{"name": ..., "arguments": ...}`` with its keys in any order, maybe an extra key."""
    name, args = draw(names), draw(arguments_texts())
    name_text = json.dumps(name, ensure_ascii=draw(st.booleans()))
    members = [
        f'"name":{draw(spaces)}{name_text}',
        f'"{draw(st.sampled_from(keys))}":{draw(spaces)}{args}',
    ]
    if draw(st.booleans()):
        members.append(f'"type"{draw(spaces)}:{draw(spaces)}{json.dumps(draw(json_values))}')
    members = draw(st.permutations(members))
    between = draw(st.sampled_from([", ", ",", ",\n  ", " ,"]))
    text = "{" + draw(spaces) + between.join(members) + draw(spaces) + "}"
    return text, (name, args)


CONTENT_BITS = ["Hello", " ", "\n", "<", "<tool", "<tool_calls>", "<tool box", CALL_END]
CONTENT_BITS += ["tool_call>", "Zürich", "東京", "🤖", "{", "}", "<|", "python_tag|>"]
contents = st.lists(st.sampled_from(CONTENT_BITS), max_size=5).map("".join)
cuts_st = st.lists(st.integers(0, 400), max_size=16)


@st.composite
def hermes_outputs(draw: st.DrawFn, parallel: bool = True) -> tuple[str, str, list[Call]]:
    """(output, the content it shows, its calls): content segments around blocks."""
    objects = draw(st.lists(call_objects(), max_size=3))
    segments = draw(st.lists(contents, min_size=len(objects) + 1, max_size=len(objects) + 1))
    assume(not any(CALL_START in s for s in segments))
    text = segments[0]
    for (obj, _), after in zip(objects, segments[1:], strict=True):
        text += CALL_START + draw(spaces) + obj + draw(spaces) + CALL_END + after
    if not objects:
        content = segments[0]
    elif not parallel:
        content = segments[0].rstrip()
    else:  # whitespace next to a block is not content
        middle = [s.strip() for s in segments[1:-1]]
        content = segments[0].rstrip() + "".join(middle) + segments[-1].lstrip()
    assume(CALL_START not in content)  # not "<" + a call + "tool_call>" either
    calls = [(call_id(i), name, args) for i, (_, (name, args)) in enumerate(objects)]
    return text, content, calls if parallel else calls[:1]


@PROPS
@given(data=st.data(), parallel=st.booleans(), cuts=cuts_st)
def test_hermes_any_split_gives_the_content_and_the_calls(
    data: st.DataObject, parallel: bool, cuts: list[int]
) -> None:
    text, content, calls = data.draw(hermes_outputs(parallel))
    whole = collect(parser("hermes", parallel=parallel), [text])
    assert whole == (content, calls)
    assert collect(parser("hermes", parallel=parallel), chunked(text, cuts)) == whole
    assert CALL_START not in whole[0]


@PROPS
@given(data=st.data(), parallel=st.booleans(), cuts=cuts_st)
def test_llama3_json_any_split_gives_the_calls(
    data: st.DataObject, parallel: bool, cuts: list[int]
) -> None:
    objects = data.draw(st.lists(call_objects(("parameters", "arguments")), min_size=1, max_size=3))
    text = data.draw(spaces) + data.draw(st.sampled_from(["", PYTHON_TAG]))
    for i, (obj, _) in enumerate(objects):
        text += (data.draw(spaces) + ";" + data.draw(spaces) if i else "") + obj
    calls = [(call_id(i), name, args) for i, (_, (name, args)) in enumerate(objects)]
    expected = ("", calls if parallel else calls[:1])
    p = parser("llama3_json", parallel=parallel)
    assert collect(p, chunked(text, cuts)) == expected
    assert collect(parser("llama3_json", parallel=parallel), [text]) == expected


@PROPS
@given(lead=spaces, body=contents, cuts=cuts_st)
def test_llama3_json_output_that_does_not_start_as_a_call_is_content(
    lead: str, body: str, cuts: list[int]
) -> None:
    start = body.lstrip()[:1]
    assume(start and start != "{" and not body.lstrip().startswith(PYTHON_TAG))
    text = lead + body
    assert collect(parser("llama3_json"), chunked(text, cuts)) == (text, [])


@PROPS
@given(lead=spaces, args=arguments_texts(), tail=contents, cuts=cuts_st)
def test_named_output_is_the_arguments_and_done_at_its_close(
    lead: str, args: str, tail: str, cuts: list[int]
) -> None:
    p = parser("named", name="get_weather")
    content: list[str] = []
    calls: list[list[str]] = []
    fed = ""
    for chunk in chunked(lead + args + tail, cuts):
        absorb(p.feed(chunk), content, calls)
        fed += chunk
        # done exactly once the object has closed (the tail cannot reopen it)
        assert p.done == (len(fed) >= len(lead + args))
    absorb(p.finish(), content, calls)
    assert (content, calls) == ([], [[call_id(0), "get_weather", args]])


@PROPS
@given(data=st.data(), parallel=st.booleans(), tail=contents, cuts=cuts_st)
def test_required_array_elements_are_the_calls(
    data: st.DataObject, parallel: bool, tail: str, cuts: list[int]
) -> None:
    objects = data.draw(st.lists(call_objects(("parameters",)), min_size=1, max_size=3))
    sep = data.draw(st.sampled_from([",", ", ", "\n,\n"]))
    array = "[" + data.draw(spaces) + sep.join(o for o, _ in objects) + data.draw(spaces) + "]"
    calls = [(call_id(i), name, args) for i, (_, (name, args)) in enumerate(objects)]
    p = parser("required", parallel=parallel)
    content: list[str] = []
    got: list[list[str]] = []
    for chunk in chunked(array + tail, cuts):
        absorb(p.feed(chunk), content, got)
    assert p.done  # the array closed
    absorb(p.finish(), content, got)
    assert ("".join(content), [tuple(c) for c in got]) == ("", calls if parallel else calls[:1])


@PROPS
@given(data=st.data(), steps=st.lists(st.integers(0, 200), max_size=20))
def test_hermes_over_incremental_detokenization(
    tiny_model: ModelInfo, data: st.DataObject, steps: list[int]
) -> None:
    """The real path: the worker's detokenizer releases text whole characters at a time,
    in steps of any number of tokens, markers and multi-byte characters cut anywhere."""
    text, content, calls = data.draw(hermes_outputs())
    ids = tiny_model.encode(text)
    points = sorted({s % (len(ids) + 1) for s in steps} | {0, len(ids)})
    detok = Detokenizer(tiny_model.tokenizer)
    chunks = [detok.step(ids[a:b]) for a, b in itertools.pairwise(points)] + [detok.finish()]
    assert "".join(chunks) == text
    assert collect(parser("hermes"), chunks) == (content, calls)


# -- hermes, case by case ---------------------------------------------------------------


def test_a_marker_cut_across_chunks_is_held_and_arguments_stream_before_the_end() -> None:
    p = parser("hermes")
    assert p.feed("Let me look.\n<tool") == ["Let me look."]
    assert p.feed("_ca") == []
    assert p.feed('ll>\n{"name": "get_weather", "arguments": {"city": "Zü') == [
        ToolFragment(0, "call_0", "get_weather", '{"city": "Zü')
    ]
    assert p.calls == 1
    assert p.feed('rich"}}\n</tool_call>\n') == [ToolFragment(0, arguments='rich"}')]
    assert p.feed('<tool_call>\n{"name": "search", "arguments": {"q": "東京 🤖"}}') == [
        ToolFragment(1, "call_1", "search", '{"q": "東京 🤖"}')
    ]
    assert p.feed("\n</tool_call>\nDone.") == ["Done."]
    assert p.finish() == []
    assert p.calls == 2


@pytest.mark.parametrize(
    ("chunks", "released"),
    [
        (["a <tool", " box"], ["a", " <tool box"]),
        (["<tool_calls>"], ["<tool_calls>"]),
        (["x <tool_call", "s> y"], ["x", " <tool_calls> y"]),
        (["stray </tool_call> end"], ["stray </tool_call> end"]),
        (["ends in <tool_ca"], ["ends in", " <tool_ca"]),  # the end decides: content
    ],
)
def test_lookalikes_of_the_marker_are_content(chunks: list[str], released: list[str]) -> None:
    p = parser("hermes")
    out = [p.feed(chunk) for chunk in chunks] + [p.finish()]
    assert ["".join(str(piece) for piece in pieces) for pieces in out if pieces] == released
    assert p.calls == 0


def test_arguments_written_before_the_name_wait_for_it() -> None:
    p = parser("hermes")
    assert p.feed('<tool_call>{"arguments": {"q": "東京"}, ') == []
    assert p.feed('"name": "caf\\u00e9"') == [ToolFragment(0, "call_0", "café", '{"q": "東京"}')]
    assert p.feed("}</tool_call>") == []
    assert p.calls == 1


@pytest.mark.parametrize(
    "block",
    [
        "<tool_call>not json</tool_call>",
        '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>',
        '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
        "<tool_call>{'name': 'f'}</tool_call>",
        '<tool_call>{"name": "f\\x"}</tool_call>',  # a bad escape
        '<tool_call>{"name" "f"}</tool_call>',
        '<tool_call>{"arguments": {"a": 1}, "name": "f',  # cut by the end inside the name
    ],
)
def test_a_block_that_is_not_a_call_is_content_raw(block: str) -> None:
    text = f"Before: {block} after."
    assert collect(parser("hermes"), [text]) == (text, [])
    assert collect(parser("hermes"), list(text)) == (text, [])


def test_a_call_after_a_block_that_is_not_one_is_call_0() -> None:
    text = '<tool_call>oops</tool_call>\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert collect(parser("hermes"), [text]) == (
        "<tool_call>oops</tool_call>",
        [("call_0", "f", "{}")],
    )


@pytest.mark.parametrize(
    ("text", "arguments"),
    [
        ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call> after', '{"a": 1}'),
        ('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call> after', '{"a": 1'),
        ('<tool_call>{"name": "f", "arguments": {"a": 1}} x}\n</tool_call>\n after', '{"a": 1}'),
    ],
)
def test_a_call_that_breaks_after_it_started_ends_and_the_block_is_dropped(
    text: str, arguments: str
) -> None:
    assert collect(parser("hermes"), [text]) == ("after", [("call_0", "f", arguments)])
    assert collect(parser("hermes"), list(text)) == ("after", [("call_0", "f", arguments)])


def test_a_call_cut_by_max_tokens_ends_with_the_arguments_that_came() -> None:
    p = parser("hermes")
    assert p.feed('Sure.<tool_call>\n{"name": "f", "arguments": {"city": "Par') == [
        "Sure.",
        ToolFragment(0, "call_0", "f", '{"city": "Par'),
    ]
    assert p.finish() == []
    assert p.calls == 1


def test_a_call_without_arguments_gets_an_empty_object() -> None:
    text = '<tool_call>{"name": "now"}</tool_call>'
    assert collect(parser("hermes"), [text]) == ("", [("call_0", "now", "{}")])


def test_not_parallel_is_done_when_the_first_call_closes_and_drops_the_rest() -> None:
    p = parser("hermes", parallel=False)
    assert p.feed('<tool_call>{"name": "f", "arguments": {"a": 1}') == [
        ToolFragment(0, "call_0", "f", '{"a": 1}')
    ]
    assert not p.done
    assert p.feed("}") == []
    assert p.done  # before its </tool_call>: the engine may stop now
    assert p.feed('</tool_call>\nMore <tool_call>{"name": "g", "arguments": {}}</tool_call>') == []
    assert p.finish() == []
    assert p.calls == 1


# -- the other formats, case by case ---------------------------------------------------


def test_llama3_json_calls_after_the_python_tag() -> None:
    p = parser("llama3_json")
    assert p.feed("  <|python_") == []
    assert p.feed('tag|>{"name": "f", "parameters": {"x": "Zürich"}}') == [
        ToolFragment(0, "call_0", "f", '{"x": "Zürich"}')
    ]
    assert p.feed('; {"name": "g", "arguments": {}}') == [ToolFragment(1, "call_1", "g", "{}")]
    assert not p.done
    assert p.finish() == []
    assert p.calls == 2


@pytest.mark.parametrize(
    "text",
    [
        "  Hello {",
        "  <|python",  # the end decides: not the tag
        '{"foo": 1, "bar": [2]} is the JSON you asked for',  # an object that is no call
        "{not json",
    ],
)
def test_llama3_json_content(text: str) -> None:
    assert collect(parser("llama3_json"), [text]) == (text, [])
    assert collect(parser("llama3_json"), list(text)) == (text, [])


def test_llama3_json_not_parallel_and_text_after_the_calls() -> None:
    p = parser("llama3_json", parallel=False)
    assert p.feed('{"name": "f", "parameters": {}}') == [ToolFragment(0, "call_0", "f", "{}")]
    assert p.done
    assert p.feed('; {"name": "g", "parameters": {}}') == []
    text = '{"name": "f", "parameters": {}} and some words; {"name": "g", "parameters": {}}'
    assert collect(parser("llama3_json"), [text]) == ("", [("call_0", "f", "{}")])


def test_named_first_piece_names_the_call_and_done_at_close() -> None:
    p = parser("named", name="get_weather")
    assert p.feed(" ") == []
    assert p.feed('{"city": ') == [ToolFragment(0, "call_0", "get_weather", '{"city": ')]
    assert p.calls == 1 and not p.done
    assert p.feed('"東京"} trailing') == [ToolFragment(0, arguments='"東京"}')]
    assert p.done
    assert p.feed("more") == []
    assert p.finish() == []


def test_named_with_no_output_still_names_the_call() -> None:
    p = parser("named", name="f")
    assert p.finish() == [ToolFragment(0, "call_0", "f", "")]
    assert p.calls == 1


def test_required_done_when_the_array_closes() -> None:
    p = parser("required")
    assert p.feed('[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "param') == [
        ToolFragment(0, "call_0", "f", '{"a": 1}'),
        ToolFragment(1, "call_1", "g", ""),
    ]
    assert p.feed('eters": [1]}') == [ToolFragment(1, arguments="[1]")]
    assert not p.done
    assert p.feed("]") == []
    assert p.done
    assert p.calls == 2


def test_required_not_parallel_is_done_after_the_first_element() -> None:
    p = parser("required", parallel=False)
    assert p.feed('[{"name": "f", "parameters": {}}') == [ToolFragment(0, "call_0", "f", "{}")]
    assert p.done
    assert p.feed(', {"name": "g", "parameters": {}}]') == []


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="pythonic"):
        parser("pythonic")


# -- templates, prompts, schemas -----------------------------------------------------------

QWEN = '{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}<tool_call>\\n{"name": ...'
LLAMA31 = "<|start_header_id|>ipython<|end_header_id|>{{- '<|python_tag|>' + tool_call.name }}"
LLAMA32 = (
    "<|start_header_id|>system<|end_header_id|>{%- if tools is not none %}Respond in the "
    'format {"name": function name, "parameters": dictionary of argument name and its value}'
)
LLAMA3_PLAIN = "<|start_header_id|>{{ message['role'] }}<|end_header_id|>{{ message['content'] }}"


@pytest.mark.parametrize(
    ("template", "kind"),
    [
        (QWEN, "hermes"),
        (LLAMA31, "llama3_json"),
        (LLAMA32, "llama3_json"),
        (LLAMA3_PLAIN, "hermes"),
        (CHAT_TEMPLATE, "hermes"),  # SmolLM2's: no tools at all
        ("", "hermes"),
    ],
)
def test_detect_format(template: str, kind: str) -> None:
    assert detect_format(template) == kind


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city, e.g. Zürich",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
NOW = {"type": "function", "function": {"name": "now"}}


def test_tool_system_prompt_lists_the_functions_and_the_call_form() -> None:
    prompt = tool_system_prompt([WEATHER, NOW])
    listed = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in listed.splitlines()] == [
        WEATHER["function"],
        NOW["function"],
    ]
    form = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    assert form in prompt


def test_forced_schema_for_a_named_function() -> None:
    assert forced_schema([WEATHER, NOW], "get_weather") == WEATHER["function"]["parameters"]
    assert forced_schema([WEATHER, NOW], "now") == {"type": "object"}
    with pytest.raises(ValueError, match="get_time"):
        forced_schema([WEATHER, NOW], "get_time")


def test_forced_schema_for_required() -> None:
    schema = forced_schema([WEATHER, NOW], None)
    assert schema["type"] == "array" and schema["minItems"] == 1
    each = schema["items"]["anyOf"]
    assert [e["properties"]["name"] for e in each] == [{"const": "get_weather"}, {"const": "now"}]
    assert [e["properties"]["parameters"] for e in each] == [
        WEATHER["function"]["parameters"],
        {"type": "object"},
    ]
    assert all(e["required"] == ["name", "parameters"] and e["type"] == "object" for e in each)
    assert list(each[0]["properties"]) == ["name", "parameters"]  # the name is written first
