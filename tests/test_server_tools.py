"""`response_format`, `structured_outputs` and tool calling through the HTTP app, in process,
on a stub engine that records each request's SamplingParams and answers with a scripted
text (streamed a few characters per output): what constraint reaches the engine, how the
reply is read into `message.tool_calls` (whole and streamed, through the `openai` client,
including `chat.completions.parse` with a pydantic model), the chat template's rendering of
tools and tool-call history (the 400s: `test_server_tool_errors.py`). Whether the engine
enforces the constraint is tested where the engine is (the end-to-end tests with the tiny model)."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import BaseModel

from pagedjax.server.constraints import tool_choice_schema
from pagedjax.server.protocol_tools import ChatCompletionTool
from tests.server_tools_stub import (
    CHAT,
    COMP,
    MSG,
    TOOL_TEMPLATE,
    TOOLS,
    WEATHER,
    _app,
    _client_run,
    _post,
    stub_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return stub_tokenizer(tmp_path_factory)


def test_response_format_and_structured_outputs_reach_the_engine(tokenizer):
    engine, app = _app(tokenizer)
    engine.reply = '{"a": 1}'
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    rf = {"type": "json_schema", "json_schema": {"name": "A", "schema": schema, "strict": True}}
    cases = [
        ({"response_format": rf}, "json", schema),
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        ({"response_format": {"type": "text"}}, None, None),
        ({"structured_outputs": {"json": schema}}, "json", schema),
        ({"structured_outputs": {"json": json.dumps(schema)}}, "json", schema),
        ({"structured_outputs": {"regex": "[0-9]{3}"}}, "regex", "[0-9]{3}"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
        ({"structured_outputs": {"grammar": 'start: "a"+'}}, "grammar", 'start: "a"+'),
        ({"structured_outputs": {"json_object": True}}, "json_object", True),
    ]
    for extra, kind, value in cases:
        for path, body in [(CHAT, {"messages": MSG}), (COMP, {"prompt": "x"})]:
            res = _post(app, path, {**body, **extra})
            assert res.status_code == 200, (extra, res.text)
            so = engine.requests[-1][1].structured_outputs
            if kind is None:
                assert so is None
            else:
                assert so.kind == kind and getattr(so, kind) == value, (path, extra)
    msg = _post(app, CHAT, {"messages": MSG, "response_format": rf}).json()["choices"][0]
    assert msg["message"] == {"role": "assistant", "content": '{"a": 1}'}
    assert msg["finish_reason"] == "stop"


class Weather(BaseModel):
    city: str
    temperature_c: float
    conditions: list[str]


def test_openai_parse_with_a_pydantic_model(tokenizer):
    from openai.lib._pydantic import to_strict_json_schema

    engine, app = _app(tokenizer)
    engine.reply = '{"city": "Paris", "temperature_c": 21.5, "conditions": ["sunny"]}'

    async def parse(client):
        return await client.chat.completions.parse(
            model="stub", messages=MSG, response_format=Weather
        )

    completion = _client_run(app, parse)
    parsed = completion.choices[0].message.parsed
    assert parsed == Weather(city="Paris", temperature_c=21.5, conditions=["sunny"])
    so = engine.requests[-1][1].structured_outputs
    assert so.kind == "json" and so.json == to_strict_json_schema(Weather)


def _tool_calls(message: dict) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def _stream_with_openai(app, body: dict):
    """A streamed chat completion through the openai client: (content, [name, arguments]
    per call rebuilt from the deltas, finish_reason, ids)."""

    async def run(client):
        content, calls, ids, finish = "", [], [], None
        stream = await client.chat.completions.create(model="stub", stream=True, **body)
        async for chunk in stream:
            for choice in chunk.choices:
                d = choice.delta
                content += d.content or ""
                for t in d.tool_calls or []:
                    if t.id is not None:  # the first delta of a call: id, type, name
                        assert t.index == len(calls) and t.type == "function"
                        assert t.function.arguments == ""
                        calls.append([t.function.name, ""])
                        ids.append(t.id)
                    else:
                        assert t.function.name is None
                        calls[t.index][1] += t.function.arguments
                finish = choice.finish_reason or finish
        return content, calls, finish, ids

    return _client_run(app, run)


def test_tool_choice_required_is_forced_and_read(tokenizer):
    engine, app = _app(tokenizer)
    args = '{"city": "Paris", "unit": "c"}'
    engine.reply = (
        f'[{{"name": "get_weather", "parameters": {args}}}, {{"name": "now", "parameters": {{}}}}]'
    )
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": "required"}
    res = _post(app, CHAT, body).json()
    tools = [ChatCompletionTool.model_validate(t) for t in TOOLS]
    assert engine.requests[-1][1].structured_outputs.json == tool_choice_schema(tools, "required")
    choice = res["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert _tool_calls(choice["message"]) == [("get_weather", args), ("now", "{}")]
    ids = [c["id"] for c in choice["message"]["tool_calls"]]
    assert all(i.startswith("chatcmpl-tool-") for i in ids) and len(set(ids)) == 2
    content, calls, finish, stream_ids = _stream_with_openai(app, body)
    assert (content, calls, finish) == ("", [["get_weather", args], ["now", "{}"]], "tool_calls")
    assert all(i.startswith("chatcmpl-tool-") for i in stream_ids)
    # one call only without parallel tool calls
    _post(app, CHAT, {**body, "parallel_tool_calls": False})
    assert engine.requests[-1][1].structured_outputs.json["maxItems"] == 1


def test_a_required_reply_cut_by_length_keeps_its_complete_calls(tokenizer):
    """max_tokens cuts the array inside its third call: the two complete calls come back,
    exactly as the stream sent them (each call whole: nothing of the third), with
    finish_reason "length"; cut inside the first call: content, streamed as content too."""
    engine, app = _app(tokenizer)
    engine.finish_reason = "length"
    args = '{"city": "Paris", "unit": "c"}'
    two = f'[{{"name": "get_weather", "parameters": {args}}}, {{"name": "now", "parameters": {{}}}}'
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": "required"}
    for third in [', {"name": "get_weather", "parameters": {"ci', ', {"name": "no']:
        engine.reply = two + third
        choice = _post(app, CHAT, body).json()["choices"][0]
        assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
        assert _tool_calls(choice["message"]) == [("get_weather", args), ("now", "{}")]
        content, calls, finish, _ = _stream_with_openai(app, body)
        assert (content, finish) == ("", "length")
        assert calls == [["get_weather", args], ["now", "{}"]]
    engine.reply = '[{"name": "get_weather", "parameters": {"ci'
    choice = _post(app, CHAT, body).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": engine.reply}
    assert choice["finish_reason"] == "length"
    assert _stream_with_openai(app, body)[:3] == (engine.reply, [], "length")


def test_named_tool_choice_is_forced_and_read(tokenizer):
    engine, app = _app(tokenizer)
    engine.reply = '{"city": "Oslo"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    body = {"messages": MSG, "tools": TOOLS, "tool_choice": named, "n": 2}
    res = _post(app, CHAT, body).json()
    assert engine.requests[-1][1].structured_outputs.json == WEATHER["function"]["parameters"]
    for choice in res["choices"]:
        assert _tool_calls(choice["message"]) == [("get_weather", '{"city": "Oslo"}')]
        assert choice["finish_reason"] == "tool_calls"
    content, calls, finish, _ = _stream_with_openai(app, {**body, "n": 1})
    assert (content, calls, finish) == ("", [["get_weather", '{"city": "Oslo"}']], "tool_calls")


def test_auto_tool_choice_reads_hermes_calls(tokenizer):
    engine, app = _app(tokenizer, enable_auto_tool_choice=True, tool_call_parser="hermes")
    args = '{"city": "Paris"}'
    engine.reply = (
        f'I will check.\n<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    )
    res = _post(app, CHAT, {"messages": MSG, "tools": TOOLS}).json()  # auto by default
    assert engine.requests[-1][1].structured_outputs is None  # auto is not constrained
    choice = res["choices"][0]
    assert choice["message"]["content"] == "I will check.\n"
    assert _tool_calls(choice["message"]) == [("get_weather", args)]
    assert choice["finish_reason"] == "tool_calls"
    streamed = _stream_with_openai(app, {"messages": MSG, "tools": TOOLS, "tool_choice": "auto"})
    assert streamed[:3] == ("I will check.\n", [["get_weather", args]], "tool_calls")
    # no call: plain content, finish_reason stop, no tool_calls key
    engine.reply = "It is sunny. <b>"
    choice = _post(app, CHAT, {"messages": MSG, "tools": TOOLS}).json()["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "It is sunny. <b>"}
    assert choice["finish_reason"] == "stop"
    assert _stream_with_openai(app, {"messages": MSG, "tools": TOOLS})[:3] == (
        "It is sunny. <b>",
        [],
        "stop",
    )
    # "none" reads nothing, even a call-shaped reply
    engine.reply = '<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    choice = _post(app, CHAT, {"messages": MSG, "tools": TOOLS, "tool_choice": "none"}).json()
    assert choice["choices"][0]["message"]["content"] == engine.reply


def test_llama3_json_parser_is_chosen_by_the_flag(tokenizer):
    engine, app = _app(tokenizer, enable_auto_tool_choice=True, tool_call_parser="llama3_json")
    engine.reply = '{"name": "now", "parameters": {}}'
    choice = _post(app, CHAT, {"messages": MSG, "tools": TOOLS}).json()["choices"][0]
    assert _tool_calls(choice["message"]) == [("now", "{}")]


def test_tools_and_tool_history_are_rendered_by_the_template(tokenizer, caplog):
    engine, app = _app(tokenizer, chat_template=TOOL_TEMPLATE)
    engine.reply = "Sunny."
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    messages = [
        *MSG,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call-1", "type": "function", "function": call}],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": "21 C, sunny"},
    ]
    res = _post(app, CHAT, {"messages": messages, "tools": TOOLS, "tool_choice": "none"})
    assert res.status_code == 200, res.text
    prompt = tokenizer.decode(engine.requests[-1][0])
    assert (
        '"name": "get_weather"' in prompt
        and '"description": "Current weather of a city."' in prompt
    )  # the tools
    assert (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in prompt
    )  # the assistant's call, its arguments as an object
    assert "<tool_response id=call-1>21 C, sunny</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    # /tokenize renders the same prompt
    body = {"messages": messages, "tools": TOOLS}
    assert _post(app, "/tokenize", body).json()["tokens"] == engine.requests[-1][0]
    # the tokenizer's own template ignores tools: rendered without them, logged once
    engine, app = _app(tokenizer)
    with caplog.at_level(logging.WARNING, logger="pagedjax.server.serving"):
        for _ in range(2):
            body = {"messages": MSG, "tools": TOOLS, "tool_choice": "none"}
            assert _post(app, CHAT, body).status_code == 200
    warnings = [r for r in caplog.records if "does not render `tools`" in r.getMessage()]
    assert len(warnings) == 1
    assert "get_weather" not in tokenizer.decode(engine.requests[-1][0])
