"""`--reasoning-parser`: replies split into reasoning and content, whole and streamed (the
deltas concatenate to the whole reply's split whatever the chunking), and through the stub
server: `message.reasoning`, `delta.reasoning`, Qwen3's enable_thinking switch, and the tool
parser reading the content only."""

from __future__ import annotations

import json
import random

import pytest

from pagedjax.server.reasoning_parsers import (
    REASONING_PARSERS,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningStreamer,
)
from tests.server_tools_stub import HERMES, _app, _post, stub_tokenizer

CASES = [
    # reply, (reasoning, content)
    ("<think>\nplan</think>\n\nAnswer.", ("\nplan", "\n\nAnswer.")),
    ("plan</think>Answer.", ("plan", "Answer.")),  # the template opened <think>
    ("still thinking", ("still thinking", None)),  # cut off while thinking
    ("<think>a</think>", ("a", None)),
    ("</think>just content", (None, "just content")),
    ("", (None, None)),
    ("<thi", ("<thi", None)),
    ("a</think>b</think>c", ("a", "b</think>c")),
    ("<think><think>x</think>y", ("<think>x", "y")),
]


@pytest.mark.parametrize("reply, want", CASES)
def test_whole_replies_split_at_the_first_end_tag(reply, want):
    assert ReasoningParser().extract(reply) == want


@pytest.mark.parametrize("reply, want", CASES)
def test_streamed_deltas_add_up_to_the_whole_split(reply, want):
    rng = random.Random(0)
    for _ in range(200):
        cuts = sorted(rng.sample(range(len(reply) + 1), k=min(len(reply) + 1, rng.randint(0, 6))))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True)]
        streamer = ReasoningStreamer(thinking=True)
        got = ["", ""]
        for i, piece in enumerate(pieces):
            r, c = streamer.update(piece, final=i == len(pieces) - 1)
            got[0] += r
            got[1] += c
        assert (got[0] or None, got[1] or None) == want, pieces


def test_a_reply_that_does_not_think_is_all_content():
    streamer = ReasoningStreamer(thinking=False)
    assert streamer.update("<think>x</think>y", final=True) == ("", "<think>x</think>y")


def test_qwen3_thinks_unless_told_not_to():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3"}
    qwen3 = Qwen3ReasoningParser()
    assert qwen3.thinks(None) and qwen3.thinks({"enable_thinking": True})
    assert not qwen3.thinks({"enable_thinking": False})
    assert ReasoningParser().thinks({"enable_thinking": False})  # deepseek_r1 always thinks


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return stub_tokenizer(tmp_path_factory)


MESSAGES = [{"role": "user", "content": "hi"}]
REPLY = "<think>Let me see.</think>The answer is 4."


def _stream_deltas(app, body) -> list[dict]:
    r = _post(app, "/v1/chat/completions", {**body, "stream": True})
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
    return [json.loads(line)["choices"][0]["delta"] for line in lines]


def test_the_server_returns_reasoning_apart(tokenizer):
    engine, app = _app(tokenizer, reasoning_parser="qwen3")
    engine.reply = REPLY
    body = {"model": "stub", "messages": MESSAGES}
    message = _post(app, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("Let me see.", "The answer is 4.")
    deltas = _stream_deltas(app, body)
    assert "".join(d.get("reasoning", "") for d in deltas) == "Let me see."
    assert "".join(d.get("content", "") for d in deltas) == "The answer is 4."
    assert not any("reasoning" in d and "content" in d and d["content"] for d in deltas)
    # Qwen3's switch off: all content, and no reasoning field at all
    off = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    message = _post(app, "/v1/chat/completions", off).json()["choices"][0]["message"]
    assert message["content"] == REPLY and "reasoning" not in message
    assert "".join(d.get("content", "") for d in _stream_deltas(app, off)) == REPLY
    # without the flag nothing changes (and the message has no reasoning key)
    engine2, plain = _app(tokenizer)
    engine2.reply = REPLY
    message = _post(plain, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert message["content"] == REPLY and "reasoning" not in message


def test_tool_calls_are_read_from_the_content_only(tokenizer):
    engine, app = _app(tokenizer, **HERMES, reasoning_parser="deepseek_r1")
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    engine.reply = "I should call <tool_call>{}</tool_call> maybe</think>" + call
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
    body = {"model": "stub", "messages": MESSAGES, "tools": [tool]}
    choice = _post(app, "/v1/chat/completions", body).json()["choices"][0]
    assert choice["message"]["reasoning"] == "I should call <tool_call>{}</tool_call> maybe"
    (got,) = choice["message"]["tool_calls"]
    assert got["function"]["name"] == "get_weather"
    assert json.loads(got["function"]["arguments"]) == {"city": "Oslo"}
    assert choice["finish_reason"] == "tool_calls"
    deltas = _stream_deltas(app, body)
    assert "".join(d.get("reasoning", "") for d in deltas) == choice["message"]["reasoning"]
    streamed = [t for d in deltas for t in d.get("tool_calls", [])]
    assert streamed[0]["function"]["name"] == "get_weather"
    args = "".join(t["function"].get("arguments", "") for t in streamed)
    assert json.loads(args) == {"city": "Oslo"}


def test_an_unknown_parser_is_refused():
    from pagedjax import cli

    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--reasoning-parser", "nope"])
    ns = cli.build_parser().parse_args(["serve", "--reasoning-parser", "deepseek_r1"])
    assert ns.reasoning_parser == "deepseek_r1"


@pytest.mark.parametrize("piece_chars", [3, 16])
@pytest.mark.parametrize("tools", [False, True], ids=["content", "tool-parser"])
def test_streamed_logprobs_come_once_per_token_in_order(tokenizer, tools, piece_chars):
    """Each token's logprob is streamed once and in order, on the first chunk of its step,
    whether the step's text is reasoning, content, a tool call held back by the tool parser,
    or (16 characters a step: "Plan.</think>Cal") reasoning and content at once; no chunk
    but the first and the last is empty."""
    engine, app = _app(tokenizer, reasoning_parser="deepseek_r1", **(HERMES if tools else {}))
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    engine.reply = "Plan.</think>Calling " + call
    engine.piece_chars = piece_chars
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    body = {"model": "stub", "messages": MESSAGES, "logprobs": True, "top_logprobs": 1}
    if tools:
        body["tools"] = [tool]
    want = [-i / 100 for i in range(len(engine.reply))]
    whole = _post(app, "/v1/chat/completions", body).json()["choices"][0]
    assert [e["logprob"] for e in whole["logprobs"]["content"]] == want
    r = _post(app, "/v1/chat/completions", {**body, "stream": True})
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: {")]
    choices = [json.loads(line)["choices"][0] for line in lines]
    got = [e["logprob"] for c in choices if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert got == want
    for c in choices[1:-1]:
        assert c["logprobs"] or any(v for k, v in c["delta"].items() if k != "role"), c
    deltas = [c["delta"] for c in choices]
    assert "".join(d.get("reasoning", "") for d in deltas) == "Plan."
    if tools:
        assert choices[-1]["finish_reason"] == "tool_calls"
        assert "".join(d.get("content", "") for d in deltas) == "Calling "
    else:
        assert "".join(d.get("content", "") for d in deltas) == "Calling " + call
