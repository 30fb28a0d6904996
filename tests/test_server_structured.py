"""Constrained outputs and forced tool calls end to end: the HTTP app in process on the tiny
random model's engine (whose random weights would never write valid JSON by themselves),
through the `openai` client. Every output of a json_schema / json_object / regex / choice
request, greedy or sampled with n = 3, must parse and validate (schemas checked with
`jsonschema_rs`); `tool_choice="required"` and a named function must give calls whose
arguments validate against the tool's parameters, and the streamed tool-call deltas must
concatenate to the non-streamed calls; `chat.completions.parse` must return the pydantic
object; a schema, regex or tool schema that does not compile is a 400 naming its field.

JSON constraints allow any whitespace between tokens (llguidance's default, as in vLLM), and
random weights would fill the output with it: requests here push whitespace down with
`logit_bias` (it stays allowed, and is still picked where nothing else is)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema_rs
import openai
import pytest
from pydantic import BaseModel, Field

from pagedjax.engine.async_llm import AsyncLLM
from pagedjax.server.api_server import build_app

MODEL = None  # the served name (the model path), set by the app fixture
MSG = [{"role": "user", "content": "Data?"}]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "n", "color", "tags"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "set_level",
            "parameters": {
                "type": "object",
                "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 5}},
                "required": ["level"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "paint",
            "parameters": {
                "type": "object",
                "properties": {"color": {"enum": ["red", "blue"]}, "twice": {"type": "boolean"}},
                "required": ["color", "twice"],
                "additionalProperties": False,
            },
        },
    },
]
VALIDATORS = {
    t["function"]["name"]: jsonschema_rs.validator_for(t["function"]["parameters"]) for t in TOOLS
}
SAMPLED = dict(temperature=1.0, n=3, seed=7)
# a schema longer than the engine checks when a request is added, with an error deep inside
LARGE_BROKEN = {
    "type": "object",
    "properties": {
        **{f"p{i}": {"type": "string", "pattern": "[a-z]{3}"} for i in range(600)},
        "broken": {"type": "no-such-type"},
    },
}
NO_WS: dict[str, float] = {}  # logit_bias against whitespace tokens, set by the app fixture


@pytest.fixture(scope="module")
def app(make_llm, tiny_llama_dir):
    global MODEL
    engine = AsyncLLM(make_llm(tiny_llama_dir).llm_engine)
    MODEL = engine.model_config.served_model_name
    tok = engine.get_tokenizer()
    for ch in " \n\t\r":
        (token,) = tok.encode(ch, add_special_tokens=False)
        NO_WS[str(token)] = -100.0
    yield build_app(engine)
    engine.shutdown()


def _run(app, fn):
    """`await fn(client)` with an openai.AsyncOpenAI client on the app (in process)."""

    async def main():
        http = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=300
        )
        async with openai.AsyncOpenAI(
            base_url="http://t/v1", api_key="x", http_client=http, max_retries=0
        ) as client:
            return await fn(client)

    return asyncio.run(main())


def _chat(app, **kw):
    async def call(client):
        return await client.chat.completions.create(
            model=MODEL, messages=MSG, logit_bias=NO_WS, **kw
        )

    return _run(app, call)


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), SAMPLED], ids=["greedy", "n3"])
def test_json_schema_and_json_object_outputs_parse_and_validate(app, sampling):
    validator = jsonschema_rs.validator_for(SCHEMA)
    rf = {"type": "json_schema", "json_schema": {"name": "data", "schema": SCHEMA}}
    res = _chat(app, response_format=rf, **sampling)
    assert len(res.choices) == sampling.get("n", 1)
    for choice in res.choices:
        assert choice.finish_reason == "stop", choice.message.content
        validator.validate(json.loads(choice.message.content))
    res = _chat(app, response_format={"type": "json_object"}, **sampling)
    for choice in res.choices:
        assert choice.message.content.lstrip().startswith("{")
        if choice.finish_reason == "stop":  # random weights may write an endless string
            assert isinstance(json.loads(choice.message.content), dict)


def test_regex_and_choice_outputs_match(app):
    async def run(client):
        regex = await client.completions.create(
            model=MODEL,
            prompt="Code:",
            max_tokens=20,
            **SAMPLED,
            extra_body={"structured_outputs": {"regex": "[a-c]{2,5}-[0-9]{1,3}"}},
        )
        choice = await client.chat.completions.create(
            model=MODEL,
            messages=MSG,
            max_tokens=20,
            **SAMPLED,
            extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
        )
        return regex, choice

    regex, choice = _run(app, run)
    for c in regex.choices:
        assert re.fullmatch("[a-c]{2,5}-[0-9]{1,3}", c.text), c.text
    for c in choice.choices:
        assert c.message.content in ("yes", "no", "maybe so")


def _calls(message) -> list[tuple[str, str]]:
    return [(t.function.name, t.function.arguments) for t in message.tool_calls or []]


def _streamed_calls(app, **kw) -> tuple[list[list[str]], str]:
    async def run(client):
        calls, finish = [], None
        stream = await client.chat.completions.create(
            model=MODEL, messages=MSG, stream=True, logit_bias=NO_WS, **kw
        )
        async for chunk in stream:
            for choice in chunk.choices:
                for t in choice.delta.tool_calls or []:
                    if t.id is not None:
                        calls.append([t.function.name, t.function.arguments])
                    else:
                        calls[t.index][1] += t.function.arguments
                finish = choice.finish_reason or finish
        return calls, finish

    return _run(app, run)


def test_required_tool_choice_gives_valid_calls_streamed_alike(app):
    kw = dict(tools=TOOLS, tool_choice="required")
    res = _chat(app, temperature=0.0, **kw)
    calls = _calls(res.choices[0].message)
    assert calls and res.choices[0].finish_reason == "tool_calls"
    for name, arguments in calls:
        VALIDATORS[name].validate(json.loads(arguments))
    streamed, finish = _streamed_calls(app, temperature=0.0, **kw)
    assert [tuple(c) for c in streamed] == calls and finish == "tool_calls"
    for choice in _chat(app, parallel_tool_calls=False, **SAMPLED, **kw).choices:
        ((name, arguments),) = _calls(choice.message)
        VALIDATORS[name].validate(json.loads(arguments))


def test_named_tool_choice_gives_that_function(app):
    named = {"type": "function", "function": {"name": "paint"}}
    res = _chat(app, tools=TOOLS, tool_choice=named, **SAMPLED)
    for choice in res.choices:
        ((name, arguments),) = _calls(choice.message)
        assert name == "paint"
        VALIDATORS["paint"].validate(json.loads(arguments))


class Pick(BaseModel):
    word: str = Field(max_length=8)
    count: int = Field(ge=0, le=9)
    sure: bool


def test_openai_parse_returns_the_pydantic_object(app):
    async def run(client):
        return await client.chat.completions.parse(
            model=MODEL, messages=MSG, response_format=Pick, temperature=0.0, logit_bias=NO_WS
        )

    parsed = _run(app, run).choices[0].message.parsed
    assert isinstance(parsed, Pick) and 0 <= parsed.count <= 9 and len(parsed.word) <= 8


@pytest.mark.parametrize(
    "body,param",
    [
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        (  # too large to check when added: it fails on the compile pool, still a 400
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": LARGE_BROKEN},
                }
            },
            "response_format",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"x": {"type": "nonsense"}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
    ids=["regex", "grammar", "json-schema", "json-schema-large", "tool-schema"],
)
def test_constraints_that_do_not_compile_are_400_naming_the_field(app, body, param):
    async def run(client):
        http = client._client
        res = await http.post("http://t/v1/chat/completions", json={"messages": MSG, **body})
        ok = await client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
        return res, ok

    res, ok = _run(app, run)
    assert res.status_code == 400, res.text
    assert res.json()["error"]["param"] == param
    # the message names the field the client sent (it said "structured_outputs.json"
    # whatever the field was)
    message = res.json()["error"]["message"]
    if param == "structured_outputs":
        assert message.startswith("structured_outputs."), message
    else:
        assert message.startswith(f"the JSON schema of {param} is invalid: "), message
        assert "structured_outputs" not in message
    assert ok.choices[0].finish_reason == "length"  # the next request is served


def test_a_large_schema_that_does_not_compile_on_completions(app):
    """/v1/completions: not streamed, the 400 of a constraint checked when added; streamed
    (begun before the compile failed), every choice ends with finish_reason "error" and the
    reason as stop_reason."""
    body = {
        "model": MODEL,
        "prompt": "Data?",
        "max_tokens": 4,
        "n": 2,
        "structured_outputs": {"json": LARGE_BROKEN},
    }

    async def run(client):
        http = client._client
        plain = await http.post("http://t/v1/completions", json=body)
        streamed = await http.post("http://t/v1/completions", json={**body, "stream": True})
        return plain, streamed

    plain, streamed = _run(app, run)
    assert plain.status_code == 400, plain.text
    error = plain.json()["error"]
    assert error["param"] == "structured_outputs"
    assert error["message"].endswith("does not compile: Invalid type: no-such-type")
    assert streamed.status_code == 200
    chunks = [
        json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")
    ]
    ends = {c["index"]: c for ch in chunks for c in ch["choices"] if c["finish_reason"]}
    assert sorted(ends) == [0, 1]
    for c in ends.values():
        assert c["finish_reason"] == "error"
        assert c["stop_reason"].endswith("Invalid type: no-such-type")
