"""`render_conversation` (shared by `LLM.chat` and the chat endpoint): tools, tool calls
with JSON-string arguments, text parts, template variables and the input errors, checked
against Hugging Face's own `apply_chat_template` on the same tokenizer."""

from __future__ import annotations

import copy
import logging

import pytest
from transformers import AutoTokenizer

from pagedjax import SamplingParams
from pagedjax.chat_template import render_conversation
from pagedjax.errors import InvalidInputError
from tests.server_tools_stub import TOOL_TEMPLATE

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"},
]


@pytest.fixture(scope="module")
def tok(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def hf_ids(tok, conv, **kw) -> list[int]:
    text = tok.apply_chat_template(conv, tokenize=False, **kw)
    return tok(text, add_special_tokens=False).input_ids


def test_tools_and_string_arguments_render_as_hf_with_parsed_arguments(tok):
    conv = copy.deepcopy(HISTORY)
    ids = render_conversation(tok, conv, chat_template=TOOL_TEMPLATE, tools=[WEATHER])
    parsed = copy.deepcopy(HISTORY)
    parsed[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Oslo"}
    want = hf_ids(
        tok, parsed, chat_template=TOOL_TEMPLATE, tools=[WEATHER], add_generation_prompt=True
    )
    assert ids == want
    text = tok.decode(ids)
    assert '"name": "get_weather"' in text and '"arguments": {"city": "Oslo"}' in text
    assert "<tool_response id=call_1>-3 C</tool_response>" in text
    assert conv == HISTORY  # the caller's messages are not modified


def test_text_parts_are_joined_like_a_string(tok):
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    as_parts = render_conversation(tok, [{"role": "user", "content": parts}])
    as_text = render_conversation(tok, [{"role": "user", "content": "Hello\nthere"}])
    assert (
        as_parts
        == as_text
        == hf_ids(tok, [{"role": "user", "content": "Hello\nthere"}], add_generation_prompt=True)
    )


PARTS_TEMPLATE = (
    "{% for m in messages %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endfor %}"
)


@pytest.mark.parametrize(
    "template, fmt, want",
    [
        (PARTS_TEMPLATE, "auto", "[Hello][there][Hi]"),  # the loop is found: parts
        (PARTS_TEMPLATE, "openai", "[Hello][there][Hi]"),
        ("{% for m in messages %}<{{ m.content }}>{% endfor %}", "auto", "<Hello\nthere><Hi>"),
        ("{% for m in messages %}<{{ m.content }}>{% endfor %}", "string", "<Hello\nthere><Hi>"),
    ],
)
def test_chat_template_content_format_as_vllm(tok, template, fmt, want):
    """vLLM's chat_template_content_format: "openai" hands the template text parts (a string
    content made one part), "string" joins them, "auto" picks by whether the template loops
    over a message's content (with the string format, such a template looped over the
    characters: every part rendered empty)."""
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    conv = [{"role": "user", "content": parts}, {"role": "assistant", "content": "Hi"}]
    ids = render_conversation(
        tok, conv, chat_template=template, add_generation_prompt=False, content_format=fmt
    )
    assert tok.decode(ids) == want
    with pytest.raises(InvalidInputError) as e:
        render_conversation(tok, conv, chat_template=template, content_format="json")
    assert e.value.param == "chat_template_content_format"


def test_template_kwargs_reach_the_template_but_not_the_reserved_names(tok):
    template = "{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}"
    ids = render_conversation(
        tok,
        [{"role": "user", "content": "x"}],
        chat_template=template,
        chat_template_kwargs={"greeting": "Hey ", "tokenize": False},
    )
    assert tok.decode(ids) == "Hey x"


@pytest.mark.parametrize(
    "conv, kw, param, words",
    [
        (
            [
                HISTORY[0],
                {**HISTORY[1], "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
            ],
            {},
            "messages",
            "messages[1].tool_calls[0].function.arguments is not valid JSON",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            {},
            "messages",
            "only text content parts",
        ),
        (
            [{"role": "user", "content": "hi"}],
            {"continue_final_message": True},
            "continue_final_message",
            "exclusive",
        ),
        (
            [{"role": "user", "content": "hi"}],
            {"continue_final_message": True, "add_generation_prompt": False},
            "messages",
            "needs a final assistant message",
        ),
        ([], {}, "messages", "must not be empty"),
        (
            [{"role": "user", "content": "hi"}],
            {"chat_template": "{{ raise_exception('no users here') }}"},
            "messages",
            "no users here",
        ),
    ],
)
def test_bad_conversations_name_the_field(tok, conv, kw, param, words):
    with pytest.raises(InvalidInputError) as e:
        render_conversation(tok, conv, **kw)
    assert e.value.param == param
    assert words in str(e.value)


def test_no_template_is_an_error_naming_the_remedy(tok):
    bare = copy.copy(tok)
    bare.chat_template = None
    with pytest.raises(InvalidInputError, match="no chat template") as e:
        render_conversation(bare, [{"role": "user", "content": "hi"}])
    assert e.value.param is None


def test_llm_chat_passes_tools_and_template_kwargs(make_llm, tiny_llama_dir, tok):
    llm = make_llm(tiny_llama_dir, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=1)
    # Short enough for the tiny model; `.city` renders only from parsed arguments.
    template = (
        "{{ greeting }}{% for t in tools %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}"
        "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments.city }}{% endif %}"
        "{% endfor %}"
    )
    out = llm.chat(
        copy.deepcopy(HISTORY),
        params,
        use_tqdm=False,
        chat_template=template,
        tools=[WEATHER],
        chat_template_kwargs={"greeting": "Hey "},
    )[0]
    assert tok.decode(out.prompt_token_ids) == "Hey [get_weather]Weather in Oslo?Oslo-3 C"


def test_llm_chat_warns_once_when_the_template_ignores_tools(make_llm, tiny_llama_dir, caplog):
    """As the server does: tools given to a template that never reads them are dropped from
    the rendering, and the LLM says so once (it said nothing)."""
    llm = make_llm(tiny_llama_dir, block_size=16)
    params = SamplingParams(temperature=0, max_tokens=1)
    conv = [{"role": "user", "content": "Hi"}]
    with caplog.at_level(logging.WARNING, logger="pagedjax.llm"):
        for _ in range(2):
            llm.chat(
                conv,
                params,
                use_tqdm=False,
                chat_template="{{ messages[0].content }}",
                tools=[WEATHER],
            )
    assert sum("does not render `tools`" in m for m in caplog.messages) == 1
    caplog.clear()
    llm._tools_warned = False
    with caplog.at_level(logging.WARNING, logger="pagedjax.llm"):
        llm.chat(
            conv, params, use_tqdm=False, chat_template="{{ tools | length }}", tools=[WEATHER]
        )
    assert not caplog.messages
