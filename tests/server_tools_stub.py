"""The stub engine and the in-process HTTP helpers of the server's structured-output and
tool-calling tests (`test_server_tools.py`, `test_server_tool_errors.py`): a `StubEngine`
that records each request's SamplingParams and answers with a scripted text, the tools and
the tool-rendering chat template the tests use, and small wrappers around httpx / openai."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx
import openai

from pagedjax.engine.async_llm import RequestStream
from pagedjax.errors import InvalidInputError
from pagedjax.outputs import CompletionOutput, Logprob, RequestOutput
from pagedjax.sampling_params import RequestOutputKind
from pagedjax.server.api_server import build_app
from tests.conftest import make_tokenizer

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
MSG = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
TOOLS = [WEATHER, NOW]

# A Hermes / Qwen2.5-style template (written for this test) that renders tools, assistant
# tool calls and tool results.
TOOL_TEMPLATE = """
{%- if tools %}<|im_start|>system
Tools:
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response id={{ m.tool_call_id }}>{{ m.content }}</tool_response><|im_end|>
{% elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}
{%- for c in m.tool_calls %}<tool_call>{{ {'name': c.function.name,
 'arguments': c.function.arguments} | tojson }}</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


# the server options of "auto" tool calls read by the hermes parser
HERMES = dict(chat_template=TOOL_TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes")


class StubEngine:
    """Records (prompt ids, SamplingParams) of each request and answers every choice with
    `self.reply` (DELTA outputs of `self.piece_chars` characters, or one FINAL_ONLY output),
    finished with `self.finish_reason`: one token per character, and with `logprobs` asked
    for, the reply's i-th token is id 10 + i with logprob -i / 100. A constraint whose regex
    is "(" or whose schema has "type": "nonsense" is refused as the engine refuses what does
    not compile. Every prompt is [7, 8] to the client, `cached_tokens` of it cached."""

    def __init__(self, tokenizer):
        arch = SimpleNamespace(vocab_size=320)
        self.model_config = SimpleNamespace(
            served_model_name="stub",
            served_model_names=("stub",),
            default_sampling_fields={},
            max_model_len=4096,
            model="stub",
            source_path="stub",
            arch=arch,
        )
        self.tokenizer = tokenizer
        self.errored = False
        self.requests: list[tuple[list[int], object]] = []
        self.reply = ""
        self.piece_chars = 3
        self.finish_reason = "stop"
        self.cached_tokens = 0  # each output's num_cached_tokens

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self):
        pass

    def abort_nowait(self, request_id):
        pass

    async def add_requests(self, requests, priority=0, check_max_tokens=False):
        streams = []
        for rid, prompt, params in requests:
            so = params.structured_outputs
            if so is not None and (so.regex == "(" or "nonsense" in json.dumps(so.json)):
                raise InvalidInputError("the constraint does not compile", "structured_outputs")
            self.requests.append((prompt["prompt_token_ids"], params))
            stream = RequestStream(rid, params.output_kind, self)
            text = self.reply
            n = self.piece_chars
            pieces = [text[i : i + n] for i in range(0, len(text), n)] or [""]
            if params.output_kind == RequestOutputKind.FINAL_ONLY:
                pieces = [text]
            done = 0  # characters sent: one token each
            for k, piece in enumerate(pieces):
                last = k == len(pieces) - 1
                ids = [5] * len(piece)
                logprobs = None
                if params.logprobs is not None:  # token i is id 10 + i, logprob -i / 100
                    ids = [10 + done + j for j in range(len(piece))]
                    logprobs = [{t: Logprob(-(t - 10) / 100, rank=1)} for t in ids]
                done += len(piece)
                outs = [
                    CompletionOutput(
                        index=i,
                        text=piece,
                        token_ids=ids,
                        logprobs=logprobs,
                        finish_reason=self.finish_reason if last else None,
                    )
                    for i in range(params.n)
                ]
                out = RequestOutput(rid, None, [7, 8], outs, last, None, self.cached_tokens)
                stream._put(out)
            streams.append(stream)
        return streams


def stub_tokenizer(tmp_path_factory):
    """The tiny test tokenizer (`conftest.make_tokenizer`) in a temporary folder, loaded with
    transformers (each test module's `tokenizer` fixture)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def _app(tokenizer, **kw):
    engine = StubEngine(tokenizer)
    return engine, build_app(engine, **kw)


def _post(app, path: str, body: dict) -> httpx.Response:
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            return await http.post(path, json=body)

    return asyncio.run(main())


def _client_run(app, fn):
    """Runs `await fn(client)` with an `openai.AsyncOpenAI` client talking to the app."""

    async def main():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")
        async with openai.AsyncOpenAI(base_url="http://t/v1", api_key="x", http_client=http) as c:
            return await fn(c)

    return asyncio.run(main())


def _error(res: httpx.Response) -> dict:
    assert res.status_code == 400, res.text
    return res.json()["error"]
