"""Tool parsers on hand-written model outputs: what the whole output parses into (content and
calls), and the streamed deltas, fed at every character boundary and in random pieces,
concatenating to exactly that; and the JSON schemas that force a tool call (required,
named), checked against outputs that must and must not validate."""

from __future__ import annotations

import json
import random

import jsonschema_rs
import pytest

from pagedjax.errors import InvalidInputError
from pagedjax.server.constraints import request_constraint, tool_choice_schema
from pagedjax.server.protocol_tools import (
    ChatCompletionTool,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsRequest,
)
from pagedjax.server.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStreamer,
)

WEATHER_ARGS = '{"city": "Paris", "days": [1, {"note": "a } and a ]"}], "unit": "c\\"x"}'

# (parser, model output, expected content, expected [(name, arguments)])
CASES = [
    (
        HermesToolParser(),
        f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_ARGS}}}\n'
        '</tool_call>\n<tool_call>\n{"arguments": {}, "name": "now"}\n</tool_call>',
        "Let me look.\n",
        [("get_weather", WEATHER_ARGS), ("now", "{}")],
    ),
    (
        HermesToolParser(),
        '<tool_call>{"name": "f", "arguments": {"x": 1.5e3}}</tool_call>',
        None,
        [("f", '{"x": 1.5e3}')],
    ),
    (HermesToolParser(), "No tools needed: 1 < 2 <tool", "No tools needed: 1 < 2 <tool", []),
    (  # a finished output may omit the closing tag
        HermesToolParser(),
        '<tool_call>\n{"name": "f", "arguments": {"q": "<tool_call>"}}',
        None,
        [("f", '{"q": "<tool_call>"}')],
    ),
    (
        Llama3JsonToolParser(),
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {}}',
        None,
        [("f", '{"x": 1}'), ("g", "{}")],
    ),
    (
        Llama3JsonToolParser(),
        '  {"name": "f", "parameters": {"a": [true, null]}}',
        None,
        [("f", '{"a": [true, null]}')],
    ),
    (Llama3JsonToolParser(), "The answer is {x}.", "The answer is {x}.", []),
    (
        RequiredToolParser(),
        '[{"name": "f", "parameters": {"x": "]"}}, {"name": "g", "parameters": {}}]',
        None,
        [("f", '{"x": "]"}'), ("g", "{}")],
    ),
    (NamedToolParser("f"), '{"x": [1, 2], "y": "}"}', None, [("f", '{"x": [1, 2], "y": "}"}')]),
]

# outputs whose calls do not parse: all content, no calls
MALFORMED = [
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {"x": }}</tool_call>'),
    (HermesToolParser(), '<tool_call>{"arguments": {"x": 1}}</tool_call>'),  # no name
    (HermesToolParser(), '<tool_call>{"name": "f", "arguments": {"x": 1'),  # cut off
    (HermesToolParser(), '<tool_call>["f"]</tool_call>'),
    (Llama3JsonToolParser(), '{"name": "f", "parameters": [1]}'),  # arguments not an object
    (RequiredToolParser(), '[{"name": "f", "parameters": {"x": 1}'),  # cut off (length)
]


def _ids(cases):
    return [f"{c[0].name}-{i}" for i, c in enumerate(cases)]


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=_ids(CASES))
def test_whole_output_parses_into_content_and_calls(parser, text, content, calls):
    got_content, got_calls = parser.extract(text)
    assert got_content == content
    assert [(c.function.name, c.function.arguments) for c in got_calls] == calls
    for c in got_calls:
        assert c.id.startswith("chatcmpl-tool-") and c.type == "function"
        assert isinstance(json.loads(c.function.arguments), dict)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("parser,text", MALFORMED, ids=_ids(MALFORMED))
def test_calls_that_do_not_parse_leave_the_output_as_content(parser, text):
    assert parser.extract(text) == (text, [])


def _stream(parser, text: str, cuts: list[int]):
    """Feeds the output cut at `cuts` (the last piece final); returns (content, calls as
    [name, arguments]) rebuilt from the deltas, checking OpenAI's delta order."""
    streamer = ToolCallStreamer(parser)
    content, calls = "", []
    for j in [*cuts, len(text)]:
        for c, tool in streamer.update(text[:j], final=j == len(text)):
            if tool is None:
                assert c
                content += c
                continue
            if tool.id is not None:  # the header: index, id, type, name, arguments ""
                assert tool.index == len(calls) and tool.type == "function"
                assert tool.function.name and tool.function.arguments == ""
                calls.append([tool.function.name, ""])
            else:
                assert tool.function.name is None and tool.function.arguments
                assert tool.index == len(calls) - 1 or tool.index < len(calls)
                calls[tool.index][1] += tool.function.arguments
    return content, calls


@pytest.mark.parametrize("parser,text,content,calls", CASES, ids=_ids(CASES))
def test_streamed_deltas_concatenate_to_the_whole_output_at_every_boundary(
    parser, text, content, calls
):
    expected = (content or "", [list(c) for c in calls])
    # every character boundary at once (one character per step) ...
    assert _stream(parser, text, list(range(len(text)))) == expected
    # ... each boundary alone (two pieces) ...
    for k in range(len(text) + 1):
        assert _stream(parser, text, [k]) == expected, k
    # ... and random pieces
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text)), min(len(text), rng.randint(1, 8))))
        assert _stream(parser, text, cuts) == expected, cuts


def test_a_stream_holds_back_a_possible_start_tag_and_releases_it_at_the_end():
    streamer = ToolCallStreamer(HermesToolParser())
    assert streamer.update("Hi <tool", final=False) == [("Hi ", None)]
    assert streamer.update("Hi <tool", final=True) == [("<tool", None)]
    assert not streamer.tools_called


def _tools(*specs) -> list[ChatCompletionTool]:
    return [
        ChatCompletionTool.model_validate(
            {"type": "function", "function": {"name": n, "parameters": p}}
        )
        for n, p in specs
    ]


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
SEARCH = {
    "type": "object",
    "properties": {"q": {"$ref": "#/$defs/Query"}},
    "required": ["q"],
    "$defs": {"Query": {"type": "string", "minLength": 1}},
}


def test_required_schema_accepts_exactly_arrays_of_valid_calls():
    tools = _tools(("weather", WEATHER), ("search", SEARCH), ("now", None))
    schema = tool_choice_schema(tools, "required")
    v = jsonschema_rs.validator_for(schema)
    good = [
        [{"name": "weather", "parameters": {"city": "Oslo", "unit": "c"}}],
        [{"name": "search", "parameters": {"q": "x"}}, {"name": "now", "parameters": {}}],
    ]
    bad = [
        [],  # at least one call
        [{"name": "weather", "parameters": {"unit": "c"}}],  # city is required
        [{"name": "weather", "parameters": {"city": "Oslo", "unit": "k"}}],  # enum
        [{"name": "search", "parameters": {"q": ""}}],  # the hoisted $defs apply
        [{"name": "other", "parameters": {}}],  # not a tool
        [{"name": "now", "parameters": {}, "extra": 1}],
        {"name": "now", "parameters": {}},  # not an array
    ]
    assert all(v.is_valid(x) for x in good)
    assert not any(v.is_valid(x) for x in bad)
    one = jsonschema_rs.validator_for(tool_choice_schema(tools, "required", False))
    assert one.is_valid(good[0]) and not one.is_valid(good[1])


def test_named_schema_is_the_functions_parameters():
    tools = _tools(("weather", WEATHER), ("now", None))
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "weather"}})
    assert tool_choice_schema(tools, named) == WEATHER
    now = NamedToolChoice.model_validate({"function": {"name": "now"}})
    assert tool_choice_schema(tools, now) == {"type": "object", "properties": {}}
    missing = NamedToolChoice.model_validate({"function": {"name": "nope"}})
    with pytest.raises(InvalidInputError) as e:
        tool_choice_schema(tools, missing)
    assert e.value.param == "tool_choice" and "'weather'" in str(e.value)


def test_conflicting_definitions_are_refused():
    other = {**SEARCH, "$defs": {"Query": {"type": "integer"}}}
    with pytest.raises(InvalidInputError) as e:
        tool_choice_schema(_tools(("a", SEARCH), ("b", other)), "required")
    assert e.value.param == "tools"


def test_request_fields_map_to_one_constraint():
    rf = ResponseFormat.model_validate
    so = StructuredOutputsRequest.model_validate
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p, src = request_constraint(
        rf({"type": "json_schema", "json_schema": {"schema": schema}}), None
    )
    assert (p.json, p.kind, src) == (schema, "json", "response_format")
    p, src = request_constraint(rf({"type": "json_object"}), None)
    assert (p.kind, src) == ("json_object", "response_format")
    assert request_constraint(rf({"type": "text"}), None) == (None, None)
    p, _ = request_constraint(None, so({"json": json.dumps(schema)}))
    assert p.json == schema  # JSON text is parsed
    p, _ = request_constraint(None, so({"regex": "[a-z]+", "whitespace_pattern": " ?"}))
    assert (p.regex, p.whitespace_pattern) == ("[a-z]+", " ?")
    p, _ = request_constraint(None, so({"choice": ["yes", "no"]}))
    assert p.choice == ["yes", "no"]
    p, _ = request_constraint(None, so({"grammar": 'start: "a"'}))
    assert p.grammar == 'start: "a"'
    p, src = request_constraint(None, None, _tools(("f", WEATHER)), "required")
    assert src == "tool_choice" and p.json["type"] == "array"
    assert request_constraint(None, None, _tools(("f", WEATHER)), "auto") == (None, None)
    for bad, param in [
        ((rf({"type": "json_object"}), so({"regex": "a"})), "structured_outputs"),
        ((rf({"type": "json_schema", "json_schema": {"name": "x"}}), None), "response_format"),
        ((None, so({"regex": "a", "choice": ["b"]})), "structured_outputs"),
        ((None, so({})), "structured_outputs"),
        ((None, so({"json": "{not json"})), "structured_outputs"),
        ((None, so({"choice": []})), "structured_outputs"),
    ]:
        with pytest.raises(InvalidInputError) as e:
            request_constraint(*bad)
        assert e.value.param == param, bad


# a "required" output with three calls, and where each call's object ends in it
REQUIRED_CALLS = [("get_weather", WEATHER_ARGS), ("now", "{}"), ("get_weather", '{"city": "Oslo"}')]
REQUIRED_PIECES = [f'{{"name": "{n}", "parameters": {a}}}' for n, a in REQUIRED_CALLS]
REQUIRED_TEXT = "[" + ", ".join(REQUIRED_PIECES) + "]"
REQUIRED_ENDS = [
    len("[" + ", ".join(REQUIRED_PIECES[: k + 1])) for k in range(len(REQUIRED_PIECES))
]


def test_a_required_output_cut_by_length_keeps_its_complete_calls_at_every_cut():
    """Cut at every character (finish_reason "length"): the calls whose objects closed before
    the cut, exactly what the stream of that prefix sent (each call whole); none closed: all
    content, in the stream too. (Before calls were streamed whole, the stream had also sent
    the start of the unfinished call.)"""
    parser = RequiredToolParser()
    for n in range(len(REQUIRED_TEXT) + 1):
        text = REQUIRED_TEXT[:n]
        expected = [c for c, end in zip(REQUIRED_CALLS, REQUIRED_ENDS, strict=True) if end <= n]
        content, calls = parser.extract(text, cut=True)
        assert [(c.function.name, c.function.arguments) for c in calls] == expected, n
        assert content == (None if expected else text or None), n
        # the stream sent exactly those calls, or the same content
        streamed_content, streamed = _stream(parser, text, list(range(n)))
        assert [tuple(c) for c in streamed] == expected, n
        assert streamed_content == (content or ""), n
    # two complete calls and the third cut after its name: exactly the two
    text = REQUIRED_TEXT[: REQUIRED_ENDS[1]] + ', {"name": "get_weather", "parameters": {"ci'
    content, calls = parser.extract(text, cut=True)
    assert content is None
    assert [(c.function.name, c.function.arguments) for c in calls] == REQUIRED_CALLS[:2]
    assert _stream(parser, text, [len(text) // 2]) == ("", [list(c) for c in REQUIRED_CALLS[:2]])
    # not cut (finish_reason "stop"), the same prefix is not the forced format: content
    assert parser.extract(text) == (text, [])


def test_a_cut_output_of_other_parsers_is_read_as_before():
    """A named call cut inside its arguments, and an "auto" (unforced) output cut inside a
    call, stay content; a named call whose object closed is its call."""
    named = NamedToolParser("f")
    assert named.extract('{"x": [1, 2', cut=True) == ('{"x": [1, 2', [])
    content, calls = named.extract('{"x": 1}', cut=True)
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        ("f", '{"x": 1}')
    ]
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "a'
    assert HermesToolParser().extract(text, cut=True) == (text, [])
