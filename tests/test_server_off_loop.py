"""Where the server's tokenizer work runs, in process on a stub engine: every endpoint
encodes, renders and decodes on the tokenizer threads, never on the event loop's thread;
a prompt over max_model_len is refused there before its ids are read; and prompt logprobs
are converted there too."""

from __future__ import annotations

import asyncio
import copy
import json
import threading

import httpx
import pytest

from pagedjax.engine.async_llm import RequestStream
from pagedjax.outputs import Logprob
from pagedjax.server.serving import OpenAIServing
from tests.server_tools_stub import StubEngine, build_app, stub_tokenizer

RECORDED = ("encode", "encode_batch", "encode_batch_fast", "decode", "decode_batch")


class _RecordingBackend:
    """A `tokenizers.Tokenizer` whose encode / decode calls note the thread they ran on,
    and whose encodings note when their ids are read."""

    def __init__(self, backend):
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "threads", [])
        object.__setattr__(self, "ids_read", 0)

    def __getattr__(self, name):
        attr = getattr(self._backend, name)
        if name not in RECORDED:
            return attr

        def call(*args, **kwargs):
            self.threads.append((name, threading.current_thread()))
            out = attr(*args, **kwargs)
            return [_Encoding(self, e) for e in out] if name.startswith("encode_batch") else out

        return call

    def __setattr__(self, name, value):
        setattr(self._backend, name, value)


class _Encoding:
    def __init__(self, owner, enc):
        self._owner, self._enc = owner, enc

    def __len__(self):
        return len(self._enc)

    def __getattr__(self, name):
        return getattr(self._enc, name)

    @property
    def ids(self):
        object.__setattr__(self._owner, "ids_read", self._owner.ids_read + 1)
        return self._enc.ids


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return stub_tokenizer(tmp_path_factory)


@pytest.fixture
def recorded(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok._tokenizer = _RecordingBackend(tok._tokenizer)
    engine = StubEngine(tok)
    engine.model_config.max_model_len = 64
    return engine, build_app(engine), tok._tokenizer


def _post_on_loop(app, path: str, body: dict) -> tuple[httpx.Response, threading.Thread]:
    """POSTs to the app; returns the answer and the thread the event loop ran on."""

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.post(path, json=body), threading.current_thread()

    return asyncio.run(main())


MESSAGES = [{"role": "user", "content": "Hi there"}]


@pytest.mark.parametrize(
    "path,body,call",
    [
        ("/v1/completions", {"prompt": "Hi there", "max_tokens": 2}, "encode_batch_fast"),
        ("/v1/completions", {"prompt": ["a", "b"], "max_tokens": 2}, "encode_batch_fast"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}, "encode_batch_fast"),
        ("/tokenize", {"prompt": "Hi there"}, "encode_batch_fast"),
        ("/tokenize", {"messages": MESSAGES}, "encode_batch_fast"),
        ("/detokenize", {"tokens": [72, 105, 32, 116]}, "decode"),
    ],
    ids=["completion", "two-prompts", "chat", "tokenize", "tokenize-chat", "detokenize"],
)
def test_tokenizer_work_runs_off_the_event_loop(recorded, path, body, call):
    _, app, backend = recorded
    res, loop_thread = _post_on_loop(app, path, {"model": "stub", **body})
    assert res.status_code == 200, res.text
    names = [name for name, _ in backend.threads]
    assert call in names, names
    on_loop = [name for name, t in backend.threads if t is loop_thread]
    assert not on_loop, f"{on_loop} ran on the event loop's thread"


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"prompt": "x" * 65}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "x" * 100], "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 60}]}, "messages"),
    ],
)
def test_a_prompt_over_max_model_len_is_refused_before_its_ids_are_read(
    recorded, path, body, param
):
    """The stub's max_model_len is 64; the byte-level tokenizer gives one token a byte (the
    60-character chat message renders to 82 tokens: "<|user|>", the message, "</s>" as one
    token, "<|assistant|>"). The engine never sees the request."""
    engine, app, backend = recorded
    res, _ = _post_on_loop(app, path, {"model": "stub", **body})
    assert res.status_code == 400, res.text
    err = res.json()["error"]
    assert err["param"] == param
    assert err["message"].startswith("This model's maximum context length is 64 tokens."), err
    assert backend.ids_read == 0 and engine.requests == []


def test_truncate_prompt_tokens_lets_a_long_prompt_through_to_the_engine(recorded):
    engine, app, _ = recorded
    body = {"model": "stub", "prompt": "x" * 100, "truncate_prompt_tokens": 10, "max_tokens": 2}
    res, _ = _post_on_loop(app, "/v1/completions", body)
    assert res.status_code == 200, res.text
    assert len(engine.requests[0][0]) == 100  # the engine truncates


PROMPT_LOGPROBS = [None, {7: Logprob(-0.5, 1, "a"), 9: Logprob(-1.5, 2, "b")}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_are_converted_off_the_event_loop(recorded, monkeypatch, path, stream):
    """vLLM's `prompt_logprobs` are built from the engine's on the tokenizer threads (for
    thousands of prompt positions that is seconds of Python), and come back intact."""
    _, app, _ = recorded
    put = RequestStream._put

    def put_with_prompt_logprobs(self, out):
        out.prompt_logprobs = PROMPT_LOGPROBS
        return put(self, out)

    monkeypatch.setattr(RequestStream, "_put", put_with_prompt_logprobs)
    threads = []
    convert = OpenAIServing.prompt_logprobs

    def recording(self, steps):
        threads.append(threading.current_thread())
        return convert(self, steps)

    monkeypatch.setattr(OpenAIServing, "prompt_logprobs", recording)
    body = {"model": "stub", "max_tokens": 2, "prompt_logprobs": 1, "stream": stream}
    if path == "/v1/completions":
        body["prompt"] = "Hi"
    else:
        body["messages"] = MESSAGES
    res, loop_thread = _post_on_loop(app, path, body)
    assert res.status_code == 200, res.text
    if stream:
        lines = res.text.splitlines()
        chunks = [json.loads(x[len("data: ") :]) for x in lines if x.startswith("data: {")]
    else:
        chunks = [res.json()]
    # chat carries them at the top level, completions in each choice
    got = [c.get("prompt_logprobs") for c in chunks]
    got += [ch.get("prompt_logprobs") for c in chunks for ch in c["choices"]]
    got = [g for g in got if g is not None]
    want = [
        None,
        {
            "7": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
            "9": {"logprob": -1.5, "rank": 2, "decoded_token": "b"},
        },
    ]
    assert got == [want]
    assert threads and all(t is not loop_thread for t in threads)
