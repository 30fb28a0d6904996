"""`/v1/responses` (OpenAI's Responses API) through the stub engine: what reaches the engine
(rendered conversation, sampling parameters, constraints), the response object validated
by the `openai` package's own types, the streamed events as the `openai` client's stream
helper accumulates them (it checks their order), tools and tool history, reasoning,
logprobs, an incomplete reply, and the 400s."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response
from pydantic import BaseModel

from tests.server_tools_stub import (
    HERMES,
    TOOL_TEMPLATE,
    WEATHER,
    _app,
    _client_run,
    _error,
    _post,
    stub_tokenizer,
)

RESPONSES = "/v1/responses"
JSON_OBJECT = {"format": {"type": "json_object"}}
REPLY = "Paris is the capital."


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return stub_tokenizer(tmp_path_factory)


def _prompt(engine, tokenizer) -> str:
    return tokenizer.decode(engine.requests[-1][0])


def _events(app, body: dict) -> list[dict]:
    r = _post(app, RESPONSES, {**body, "stream": True})
    assert r.status_code == 200, r.text
    blocks = [b for b in r.text.split("\n\n") if b.strip()]
    events = []
    for block in blocks:
        kind, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_a_text_reply_through_the_openai_client(tokenizer):
    engine, app = _app(tokenizer)
    engine.reply, engine.cached_tokens = REPLY, 1

    async def run(client):
        return await client.responses.create(
            model="stub",
            input="Capital of France?",
            instructions="Answer in one sentence.",
            max_output_tokens=20,
            temperature=0.0,
        )

    resp = _client_run(app, run)
    assert resp.output_text == REPLY and resp.status == "completed"
    assert resp.id.startswith("resp_") and resp.object == "response"
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.status == "completed"
    u = resp.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (2, len(REPLY), 2 + len(REPLY))
    assert u.input_tokens_details.cached_tokens == 1
    params = engine.requests[-1][1]
    assert (params.max_tokens, params.temperature) == (20, 0.0)
    prompt = _prompt(engine, tokenizer)
    assert prompt.index("Answer in one sentence.") < prompt.index("Capital of France?")
    # the raw body validates against the openai package's own model, field by field
    raw = _post(app, RESPONSES, {"model": "stub", "input": "hi"}).json()
    Response.model_validate(raw, strict=False)
    assert raw["store"] is False and raw["max_output_tokens"] is None
    assert raw["temperature"] == 1.0 and raw["top_p"] == 1.0  # unset: what the engine uses
    named = _post(app, RESPONSES, {"input": "hi", "request_id": "resp_mine"}).json()
    assert named["id"] == "resp_mine"  # vLLM's request_id


def test_the_stream_accumulates_to_the_same_response(tokenizer):
    engine, app = _app(tokenizer)
    engine.reply = REPLY

    async def run(client):
        async with client.responses.stream(model="stub", input="Capital?") as stream:
            kinds = [event.type async for event in stream]
            return kinds, await stream.get_final_response()

    kinds, final = _client_run(app, run)
    assert final.output_text == REPLY and final.status == "completed"
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds.count("response.output_text.delta") == -(-len(REPLY) // 3)  # 3 chars a step
    events = _events(app, {"input": "Capital?"})
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == REPLY
    assert events[-1]["response"]["usage"]["output_tokens"] == len(REPLY)


def test_an_input_list_renders_messages_calls_and_call_outputs(tokenizer):
    engine, app = _app(tokenizer, chat_template=TOOL_TEMPLATE)
    engine.reply = "It is sunny."
    body = {
        "input": [
            {"role": "developer", "content": "Be brief."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Oslo?"}],
            },
            {  # an earlier response's reasoning item sent back: dropped
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "SECRET THOUGHT"}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        ],
        "tools": [{"type": "function", **WEATHER["function"]}],
        "tool_choice": "none",
    }
    resp = _post(app, RESPONSES, body).json()
    assert resp["output"][0]["content"][0]["text"] == "It is sunny."
    prompt = _prompt(engine, tokenizer)
    at = [
        prompt.index(s)
        for s in ("Be brief.", "Oslo?", "<tool_call>", "<tool_response id=call_1>sunny")
    ]
    assert at == sorted(at), prompt
    assert "SECRET THOUGHT" not in prompt
    assert '"name": "get_weather"' in prompt  # the tool, rendered by the template


def test_forced_tool_calls_are_function_call_items(tokenizer):
    engine, app = _app(tokenizer)
    args = '{"city": "Paris"}'
    engine.reply = f'[{{"name": "get_weather", "parameters": {args}}}]'
    tool = {"type": "function", **WEATHER["function"]}
    body = {"input": "Weather in Paris?", "tools": [tool], "tool_choice": "required"}
    resp = _post(app, RESPONSES, body).json()
    Response.model_validate(resp, strict=False)
    (call,) = resp["output"]
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == {"city": "Paris"} and call["call_id"]
    assert engine.requests[-1][1].structured_outputs.kind == "json"  # the forcing schema
    named = {**body, "tool_choice": {"type": "function", "name": "get_weather"}}
    engine.reply = args
    (call,) = _post(app, RESPONSES, named).json()["output"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})

    async def run(client):
        async with client.responses.stream(model="stub", **named) as stream:
            return await stream.get_final_response()

    (streamed,) = _client_run(app, run).output
    assert (streamed.name, json.loads(streamed.arguments)) == ("get_weather", {"city": "Paris"})
    events = _events(app, named)
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert json.loads("".join(pieces)) == {"city": "Paris"}
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == "".join(pieces)


def test_auto_tool_calls_follow_the_text_and_reasoning_comes_first(tokenizer):
    engine, app = _app(tokenizer, **HERMES, reasoning_parser="deepseek_r1")
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    engine.reply = "Need weather.</think>Checking. " + call
    body = {"input": "Oslo?", "tools": [{"type": "function", **WEATHER["function"]}]}
    resp = _post(app, RESPONSES, body).json()
    Response.model_validate(resp, strict=False)
    kinds = [item["type"] for item in resp["output"]]
    assert kinds == ["reasoning", "message", "function_call"]
    assert resp["output"][0]["content"][0]["text"] == "Need weather."
    assert resp["output"][1]["content"][0]["text"] == "Checking. "
    assert json.loads(resp["output"][2]["arguments"]) == {"city": "Oslo"}
    events = _events(app, body)
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == kinds
    thought = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(thought) == "Need weather."
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == kinds


def test_text_format_json_schema_constrains_and_parses(tokenizer):
    class City(BaseModel):
        name: str
        population: int

    engine, app = _app(tokenizer)
    engine.reply = '{"name": "Oslo", "population": 709000}'

    async def run(client):
        return await client.responses.parse(model="stub", input="A city?", text_format=City)

    resp = _client_run(app, run)
    assert resp.output_parsed == City(name="Oslo", population=709000)
    so = engine.requests[-1][1].structured_outputs
    assert so.kind == "json" and set(so.json["properties"]) == {"name", "population"}
    body = {"input": "x", "text": {"format": {"type": "json_object"}}}
    _post(app, RESPONSES, body)
    assert engine.requests[-1][1].structured_outputs.kind == "json_object"


def test_logprobs_of_the_output_text(tokenizer):
    engine, app = _app(tokenizer)
    engine.reply = REPLY
    want = [-i / 100 for i in range(len(REPLY))]
    body = {"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    resp = _post(app, RESPONSES, body).json()
    got = resp["output"][0]["content"][0]["logprobs"]
    assert [lp["logprob"] for lp in got] == want and resp["top_logprobs"] == 2
    params = engine.requests[-1][1]
    assert params.logprobs == 2
    events = _events(app, body)
    streamed = [
        lp["logprob"]
        for e in events
        if e["type"] == "response.output_text.delta"
        for lp in e["logprobs"]
    ]
    assert streamed == want
    plain = _post(app, RESPONSES, {"input": "x"}).json()
    assert plain["output"][0]["content"][0]["logprobs"] == []
    assert engine.requests[-1][1].logprobs is None
    # with thinking and a call: every token's, streamed or not
    engine, app = _app(tokenizer, **HERMES, reasoning_parser="deepseek_r1")
    engine.reply = (
        'Hm.</think>Checking. <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    )

    want = [-i / 100 for i in range(len(engine.reply))]
    body = {**body, "tools": [{"type": "function", **WEATHER["function"]}]}
    for resp in (_post(app, RESPONSES, body).json(), _events(app, body)[-1]["response"]):
        kinds = [item["type"] for item in resp["output"]]
        assert kinds == ["reasoning", "message", "function_call"]
        assert [lp["logprob"] for lp in resp["output"][1]["content"][0]["logprobs"]] == want


def test_a_reply_cut_by_max_output_tokens_is_incomplete(tokenizer):
    engine, app = _app(tokenizer)
    engine.reply, engine.finish_reason = "Paris is", "length"
    body = {"input": "x", "max_output_tokens": 8}
    resp = _post(app, RESPONSES, body).json()
    assert resp["status"] == "incomplete"
    assert resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert resp["output"][0]["status"] == "incomplete"
    events = _events(app, body)
    assert events[-1]["type"] == "response.completed"  # vLLM's last event, whatever the status
    assert events[-1]["response"]["status"] == "incomplete"

    async def run(client):
        async with client.responses.stream(model="stub", **body) as stream:
            return await stream.get_final_response()

    assert _client_run(app, run).status == "incomplete"


@pytest.mark.parametrize(
    "body, param, says",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "store"),
        ({"input": "x", "background": True}, "background", "store"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "store"),
        ({"input": "x", "include": ["foo.bar"]}, "include.0", ""),
        ({"input": [{"role": "robot", "content": "x"}]}, "input.0.message.role", "'user'"),
        ({"input": "x", "tools": [{"type": "function", "name": "a b"}]}, "tools.0.name", "a b"),
        ({"input": "x", "tool_choice": {"type": "function"}}, "tool_choice.name", "required"),
        (
            {"input": "x", "structured_outputs": {"regex": "a+"}, "text": JSON_OBJECT},
            "structured_outputs",
            "text.format and structured_outputs both",
        ),
        ({"input": []}, "input", "no message"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", ""),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "tools"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input",
            "'input_image' are not supported",
        ),
        (
            {
                "input": "x",
                "text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}},
            },
            "text.format",
            "",  # (the stub's own message; the engine's is tested in test_server_tool_errors)
        ),
    ],
    ids=[
        "previous-response",
        "background",
        "conversation",
        "unknown-include",
        "bad-role",
        "bad-tool-name",
        "choice-without-name",
        "two-constraints",
        "empty-input",
        "max-output-0",
        "choice-no-tools",
        "image",
        "bad-schema",
    ],
)
def test_bad_input_is_a_400_naming_the_field(tokenizer, body, param, says):
    engine, app = _app(tokenizer)
    error = _error(_post(app, RESPONSES, body))
    assert error["param"] == param and says in error["message"], error
    engine.reply = "ok"
    assert _post(app, RESPONSES, {"input": "x"}).json()["status"] == "completed"


def test_enable_prompt_tokens_details_on_chat_and_completions(tokenizer):
    """vLLM's `--enable-prompt-tokens-details`: usage.prompt_tokens_details.cached_tokens
    (summed over a completion request's prompts), streamed or not; without it, no key."""
    from pagedjax import cli

    ns = cli.build_parser().parse_args(["serve", "--enable-prompt-tokens-details"])
    assert ns.enable_prompt_tokens_details
    chat = {"messages": [{"role": "user", "content": "x"}]}
    completion = {"prompt": ["a", "b"]}
    for flag in (False, True):
        engine, app = _app(tokenizer, enable_prompt_tokens_details=flag)
        engine.reply, engine.cached_tokens = "ok", 1
        for path, body, cached in (
            ("/v1/chat/completions", chat, 1),
            ("/v1/completions", completion, 2),
        ):
            usage = _post(app, path, body).json()["usage"]
            streamed = _post(
                app, path, {**body, "stream": True, "stream_options": {"include_usage": True}}
            )
            last = [line for line in streamed.text.splitlines() if line.startswith("data: {")][-1]
            for u in (usage, json.loads(last[6:])["usage"]):
                if flag:
                    assert u["prompt_tokens_details"] == {"cached_tokens": cached}, path
                else:
                    assert "prompt_tokens_details" not in u, path


def test_vllm_sampling_extras_reach_the_engine(tokenizer):
    engine, app = _app(tokenizer)
    engine.reply = "123"
    body = {
        "input": "x",
        "structured_outputs": {"regex": "[0-9]{3}"},
        "min_tokens": 2,
        "ignore_eos": True,
        "logit_bias": {"5": 1.5},
        "stop_token_ids": [9],
        "top_k": 5,
        "seed": 3,
    }
    assert _post(app, RESPONSES, body).status_code == 200
    params = engine.requests[-1][1]
    assert params.structured_outputs.regex == "[0-9]{3}"
    assert (params.min_tokens, params.ignore_eos, params.stop_token_ids) == (2, True, [9])
    assert params.logit_bias == {5: 1.5}
    assert (params.top_k, params.seed) == (5, 3)
    error = _error(_post(app, RESPONSES, {"input": "x", "top_k": "5"}))
    assert error["param"] == "top_k"
    _post(app, RESPONSES, {"input": "x", "guided_choice": ["a", "b"]})  # vLLM's older name
    assert engine.requests[-1][1].structured_outputs.choice == ["a", "b"]
