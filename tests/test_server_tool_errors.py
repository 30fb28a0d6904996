"""The server's refusals of bad tools and constraints: every case of `BAD` is a 400 naming
the field of its request (nothing reaches the engine, and the next request is served), the
completions endpoint's constraint conflicts, and the tool-calling flags of `pagedjax serve`
(`--enable-auto-tool-choice`, `--tool-call-parser`, `--chat-template`). On the stub engine of
`server_tools_stub.py`."""

from __future__ import annotations

import pytest

from pagedjax import cli
from pagedjax.server.api_server import build_app
from pagedjax.server.cli_args import check_serve_args
from tests.server_tools_stub import (
    CHAT,
    COMP,
    MSG,
    NOW,
    TOOL_TEMPLATE,
    TOOLS,
    StubEngine,
    _app,
    _error,
    _post,
    stub_tokenizer,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return stub_tokenizer(tmp_path_factory)


def _tools_with(parameters) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


BAD = [
    ({"messages": MSG, "tool_choice": "required"}, "tool_choice", "tools must be set"),
    (
        {
            "messages": MSG,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
        "tool_choice",
        "'nope'",
    ),
    ({"messages": MSG, "tools": TOOLS}, "tool_choice", "--enable-auto-tool-choice"),
    ({"messages": MSG, "tools": TOOLS, "tool_choice": "any"}, "tool_choice", ""),
    ({"messages": MSG, "tools": [{"type": "function"}], "tool_choice": "none"}, "tools", ""),
    (
        {"messages": MSG, "tools": _tools_with({"type": "string"}), "tool_choice": "required"},
        "tools",
        "type 'object'",
    ),
    ({"messages": MSG, "tools": [NOW, NOW], "tool_choice": "required"}, "tools", "repeats"),
    (
        {
            "messages": MSG,
            "tools": [{"type": "function", "function": {"name": "a b"}}],
            "tool_choice": "none",
        },
        "tools",
        "function names",
    ),
    (
        {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        "json_schema.schema",
    ),
    ({"messages": MSG, "response_format": {"type": "yaml"}}, "response_format", ""),
    (
        {
            "messages": MSG,
            "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a"},
        },
        "structured_outputs",
        "only one",
    ),
    (
        {
            "messages": MSG,
            "tools": TOOLS,
            "tool_choice": "required",
            "response_format": {"type": "json_object"},
        },
        "tool_choice",
        "only one",
    ),
    (
        {"messages": MSG, "structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
        "exactly one",
    ),
    ({"messages": MSG, "structured_outputs": {"choice": []}}, "structured_outputs", "choice"),
    # refused by the engine: the param names the field the constraint came from
    ({"messages": MSG, "structured_outputs": {"regex": "("}}, "structured_outputs", "compile"),
    (
        {
            "messages": MSG,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
            },
        },
        "response_format",
        "compile",
    ),
    (
        {
            "messages": MSG,
            "tools": _tools_with({"type": "object", "properties": {"x": {"type": "nonsense"}}}),
            "tool_choice": "required",
        },
        "tools",
        "compile",
    ),
    (
        {
            "messages": [
                *MSG,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{oops"},
                        }
                    ],
                },
            ]
        },
        "messages",
        "not valid JSON",
    ),
    # rendering refusals (pagedjax.chat_template)
    (
        {"messages": MSG, "add_generation_prompt": True, "continue_final_message": True},
        "continue_final_message",
        "exclusive",
    ),
    (
        {"messages": MSG, "add_generation_prompt": False, "continue_final_message": True},
        "messages",
        "final assistant message",
    ),
    (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        "messages",
        "only text content parts",
    ),
]


@pytest.mark.parametrize("body,param,words", BAD, ids=[f"bad-{i}" for i in range(len(BAD))])
def test_bad_tools_and_constraints_are_400_naming_the_field(tokenizer, body, param, words):
    engine, app = _app(tokenizer)
    err = _error(_post(app, CHAT, body))
    assert err["param"] is not None and err["param"].startswith(param), err
    assert words in err["message"], err
    assert engine.requests == []  # nothing reached the engine
    engine.reply = "fine"  # and the next request is served
    assert _post(app, CHAT, {"messages": MSG}).json()["choices"][0]["message"]["content"] == "fine"


def test_completions_refuse_constraint_conflicts(tokenizer):
    engine, app = _app(tokenizer)
    body = {
        "prompt": "x",
        "response_format": {"type": "json_object"},
        "structured_outputs": {"choice": ["a"]},
    }
    assert _error(_post(app, COMP, body))["param"] == "structured_outputs"
    body = {"prompt": "x", "structured_outputs": {"regex": "("}}
    assert _error(_post(app, COMP, body))["param"] == "structured_outputs"


def test_tool_flags(tokenizer, tmp_path):
    ns = cli.build_parser().parse_args(
        ["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    )
    assert ns.enable_auto_tool_choice and ns.tool_call_parser == "llama3_json"
    ns = cli.build_parser().parse_args(["serve", str(tmp_path), "--enable-auto-tool-choice"])
    with pytest.raises(ValueError, match="--tool-call-parser"):
        check_serve_args(ns)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--tool-call-parser", "nope"])
    with pytest.raises(ValueError, match="--tool-call-parser"):
        build_app(StubEngine(tokenizer), enable_auto_tool_choice=True)


def test_chat_template_flag_takes_a_file_or_the_text(tmp_path):
    from pagedjax.server.api_server import _load_chat_template

    long_text = TOOL_TEMPLATE + "{# " + "x" * 500 + " #}"  # longer than a file name may be
    assert _load_chat_template(long_text) == long_text
    path = tmp_path / "t.jinja"
    path.write_text(TOOL_TEMPLATE)
    assert _load_chat_template(str(path)) == TOOL_TEMPLATE
    with pytest.raises(ValueError, match="cannot read --chat-template"):
        _load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        _load_chat_template("{% for m in messages %}")


def test_legacy_guided_fields_are_read_as_structured_outputs(tokenizer):
    """vLLM's older `guided_*` extra fields constrain the output as `structured_outputs` does
    (they were ignored before); given with `structured_outputs` they are a 400."""
    engine, app = _app(tokenizer)
    engine.reply = "yes"
    _post(app, CHAT, {"messages": MSG, "guided_choice": ["yes", "no"]})
    _post(app, COMP, {"prompt": "x", "guided_regex": "[a-z]+", "guided_whitespace_pattern": ""})
    got = [params.structured_outputs for _, params in engine.requests]
    assert [(g.choice, g.regex, g.whitespace_pattern) for g in got] == [
        (["yes", "no"], None, None),
        (None, "[a-z]+", ""),
    ]
    body = {"messages": MSG, "guided_regex": "a", "structured_outputs": {"regex": "b"}}
    assert "not both" in _error(_post(app, CHAT, body))["message"]
