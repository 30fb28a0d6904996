"""The server's prompt encoding (`server.prompt_encoding`): the tokenizer's own ids, and a
prompt over the limit refused from its token count before its ids become Python ints;
the chat path through it renders what the tokenizer's own chat tokenization gives."""

from __future__ import annotations

import copy

import pytest
from transformers import AutoTokenizer

from pagedjax.chat_template import render_conversation
from pagedjax.server.prompt_encoding import PromptTooLongError, _plain_backend, encode_texts
from tests.server_tools_stub import TOOL_TEMPLATE

TEXTS = [
    "Hello, world!",
    "  leading spaces and ünïcödé, 漢字, emoji 🙂",
    "<s>special tokens</s> written in the text <pad>",
    "<|im_start|>user\nHi<|im_end|>\n",
    "x" * 1000,
]


@pytest.fixture(scope="module")
def tiny_tok(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(params=["tiny", "smol"])
def tok(request, tiny_tok):
    return tiny_tok if request.param == "tiny" else request.getfixturevalue("smol_tokenizer")


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_the_ids_are_the_tokenizers_own(tok, add_special_tokens):
    assert _plain_backend(tok) is not None, "the fast path is not taken"
    want = [list(x) for x in tok(TEXTS, add_special_tokens=add_special_tokens).input_ids]
    got = encode_texts(tok, TEXTS, add_special_tokens, limit=1000 + 2)
    assert got == want
    assert all(type(t) is int for ids in got for t in ids)


class _Spy:
    """Wraps a tokenizer's backend: its encodings report which had their ids read."""

    def __init__(self, backend):
        self.backend, self.read = backend, []
        self.truncation = backend.truncation
        self.padding = backend.padding
        self.encode_special_tokens = backend.encode_special_tokens

    def encode_batch(self, texts, add_special_tokens):
        return self._encode(self.backend.encode_batch, texts, add_special_tokens)

    def encode_batch_fast(self, texts, add_special_tokens):
        return self._encode(self.backend.encode_batch_fast, texts, add_special_tokens)

    def _encode(self, encode, texts, add_special_tokens):
        spy = self

        class Encoding:
            def __init__(self, i, enc):
                self.i, self.enc = i, enc

            def __len__(self):
                return len(self.enc)

            @property
            def ids(self):
                spy.read.append(self.i)
                return self.enc.ids

        encs = encode(texts, add_special_tokens=add_special_tokens)
        return [Encoding(i, e) for i, e in enumerate(encs)]


class _Wrapped:
    def __init__(self, tok):
        self.backend_tokenizer = _Spy(tok.backend_tokenizer)
        self.split_special_tokens = tok.split_special_tokens


def test_a_text_over_the_limit_is_refused_before_any_ids_are_read(tiny_tok):
    texts = ["a" * 10, "b" * 41, "c" * 50]  # byte-level, no BOS: one token a byte
    wrapped = _Wrapped(tiny_tok)
    with pytest.raises(PromptTooLongError) as e:
        encode_texts(wrapped, texts, True, limit=40)
    assert (e.value.index, e.value.num_tokens, e.value.limit) == (1, 41, 40)
    assert wrapped.backend_tokenizer.read == []
    got = encode_texts(wrapped, texts, True, limit=50)
    assert wrapped.backend_tokenizer.read == [0, 1, 2]
    assert got == tiny_tok(texts).input_ids
    assert encode_texts(wrapped, texts, True, limit=None) == got


def test_a_backend_that_truncates_is_called_through_its_wrapper(tiny_tok):
    tok = copy.deepcopy(tiny_tok)
    tok.backend_tokenizer.enable_truncation(5)
    assert _plain_backend(tok) is None
    with pytest.raises(PromptTooLongError) as e:
        encode_texts(tok, TEXTS, False, limit=900)
    assert (e.value.index, e.value.num_tokens) == (4, 1000)
    assert encode_texts(tok, TEXTS, False) == tiny_tok(TEXTS, add_special_tokens=False).input_ids


CONV = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "<s>What is 2+2?</s>"},
]


@pytest.mark.parametrize("template", [None, TOOL_TEMPLATE])
def test_a_chat_rendered_to_text_then_encoded_equals_the_templates_tokenization(tiny_tok, template):
    seen = []

    def encode(text):
        seen.append(text)
        return encode_texts(tiny_tok, [text], False)[0]

    want = render_conversation(tiny_tok, CONV, chat_template=template)
    assert render_conversation(tiny_tok, CONV, chat_template=template, encode=encode) == want
    assert len(seen) == 1 and seen[0].endswith("<|assistant|>") == (template is None)


def test_a_tokenization_keyword_leaves_the_chat_to_the_templates_tokenization(tiny_tok):
    def encode(text):
        raise AssertionError("encode was called")

    kw = {"chat_template_kwargs": {"sanitize_control_tokens": True}}
    ids = render_conversation(tiny_tok, CONV, encode=encode, **kw)
    assert ids == render_conversation(tiny_tok, CONV, **kw)
