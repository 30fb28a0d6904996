"""What the completions and chat handlers share: the model check, prompt preparation
(tokenization; the chat template through `chat_rendering`), handing requests to the engine
(whose refusals become 400s, `serving_errors`), logprob conversion, SSE framing, and the
merge of several request streams into one.

Tokenization and chat-template rendering happen here, off the event loop, on a small pool
of threads (`TOKENIZER_THREADS`; a fast tokenizer releases the GIL while it encodes), so a
request with a multi-megabyte prompt delays no other stream and no `/health`. A prompt over
max_model_len (without `truncate_prompt_tokens`) is refused from its token count before
its ids become Python ints (`prompt_encoding`), which would hold the GIL. The engine
receives token ids only (its thread tokenizes just the bad words, in one batched call).
Several threads may encode at once: a fast tokenizer's encode only reads it, and nothing
here changes its truncation or padding. Text that cannot be tokenized is a 400. The engine
validates prompts and parameters once (prompt length, vocabulary, truncate_prompt_tokens,
logprobs limits, prompt + max_tokens against max_model_len); an `InvalidInputError` it
raises becomes a 400 whose `param` is its field.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from fastapi.responses import Response
from pydantic import BaseModel

from pagedjax.chat_template import template_reads_tools
from pagedjax.engine.async_llm import AsyncLLM, RequestStream
from pagedjax.engine.input_processor import prompt_too_long
from pagedjax.inputs import PromptType
from pagedjax.models.sources import default_model_ids
from pagedjax.outputs import Logprob, RequestOutput
from pagedjax.sampling_params import SamplingParams
from pagedjax.server.chat_rendering import render_chat
from pagedjax.server.prompt_encoding import PromptTooLongError, encode_texts
from pagedjax.server.protocol import (
    ChatMessage,
    DetokenizeRequest,
    SamplingRequest,
    TokenizeRequest,
)
from pagedjax.server.protocol_responses import (
    DetokenizeResponse,
    PromptLogprob,
    PromptLogprobs,
    TokenizeResponse,
)
from pagedjax.server.serving_errors import APIError, bad_input, bad_request

logger = logging.getLogger(__name__)

_MIN_LOGPROB = -9999.0  # what -inf becomes in JSON (vLLM's convention)
TOKENIZER_THREADS = 4  # requests tokenized (or rendered) at once, off the event loop
_T = TypeVar("_T")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def sse(payload: str) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class OpenAIServing:
    """Checks and conversions common to the OpenAI endpoints.

    Args:
        engine: the running `AsyncLLM`.
        served_model_name: the name clients may use (or omit) in `model`, or several names
            (the first is reported to a request that names none).
        chat_template: a Jinja chat template to use instead of the tokenizer's, or None.
    """

    def __init__(
        self, engine: AsyncLLM, served_model_name: str | Sequence[str], chat_template: str | None
    ):
        self.engine = engine
        names = (served_model_name,) if isinstance(served_model_name, str) else served_model_name
        self.served_model_names = tuple(names)
        self.served_model_name = self.served_model_names[0]
        # also accepted, unlisted: the model as given at start-up (vLLM's default name: a
        # client may send the path or hub id the server was started with), and for the
        # default model both of its ids, so that a client copied from vLLM finds it however
        # the server was started
        mc = engine.model_config
        self._accepted_names = {
            *self.served_model_names,
            mc.model,
            *default_model_ids(mc.source_path),
        }
        self.chat_template = chat_template
        self.log_requests = False  # --enable-log-requests: each request's id and parameters
        # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens
        self.enable_prompt_tokens_details = False
        self.content_format = "auto"  # --chat-template-content-format
        self._tools_warned = False  # the "template ignores tools" warning, once per server
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = mc.max_model_len  # reported by /tokenize and /v1/models
        self.default_sampling_fields = mc.default_sampling_fields  # for unset request fields
        self.vocab_size = mc.arch.vocab_size

    async def off_loop(self, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """fn(*args, **kwargs) on the tokenizer threads, so the event loop keeps serving."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_pool(), functools.partial(fn, *args, **kwargs))

    # ------------------------------------------------------------------- checks

    def model_name(self, model: str | None) -> str:
        """The name a response reports: the one the request used, else the first served."""
        return model if model and model in self._accepted_names else self.served_model_name

    def check_model(self, model: str | None) -> None:
        """Raises APIError 404 unless `model` is None or "" (the default, as in vLLM), one of
        the served names, or the model as given at start-up."""
        if model and model not in self._accepted_names:
            raise APIError(
                404,
                f"The model `{model}` does not exist.",
                param="model",
                code="model_not_found",
            )

    def warn_ignored_fields(self, request: SamplingRequest) -> None:
        extra = sorted((request.model_extra or {}).keys())
        if extra:
            names = ", ".join(repr(k[:40]) for k in extra[:10])
            logger.warning("ignoring unknown request fields: %s", names)

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise bad_request("the server runs without a tokenizer (skip_tokenizer_init)")
        return self.tokenizer

    def check_token_ids(
        self, ids: Sequence[int], what: str = "prompt", param: str = "tokens"
    ) -> None:
        """For /detokenize (generation requests are checked by the engine).

        Raises:
            APIError 400 (param `param`): a token id outside [0, vocab_size).
        """
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(
                f"{what} token id {bad} is out of the vocabulary [0, {self.vocab_size})", param
            )

    async def add_requests(
        self,
        requests: Sequence[tuple[str, PromptType, SamplingParams]],
        priority: int,
        check_max_tokens: bool,
        prompt_param: str = "prompt",
        constraint_param: str | None = None,
        max_tokens_param: str = "max_tokens",
    ) -> list[RequestStream]:
        """Hands (request id, token-id prompt, SamplingParams) triples to the engine, which
        truncates (truncate_prompt_tokens) and validates them: all are queued, or none.

        Args:
            check_max_tokens: the client gave max_tokens, so prompt + max_tokens above
                max_model_len is refused (param "max_tokens") rather than capped.
            prompt_param: the request field the engine's "prompt" is ("messages" in chat).
            constraint_param: the request field the output constraint came from (the
                engine's refusal of a schema, regex or grammar names it).
            max_tokens_param: the request field the output length came from (chat:
                "max_completion_tokens" when the client used that name).

        Raises:
            APIError 400: the engine refused an input (see `bad_input`).
        """
        if self.log_requests:
            for rid, prompt, params in requests:
                _log_request(rid, prompt, params)
        try:
            return await self.engine.add_requests(
                requests, priority=priority, check_max_tokens=check_max_tokens
            )
        except ValueError as e:
            raise bad_input(e, prompt_param, constraint_param, max_tokens_param) from e

    # ---------------------------------------------------------------- prompts

    def prompt_limit(self, request: SamplingRequest) -> int | None:
        """The most tokens a request's prompt may have: max_model_len, or None when the
        request asks for truncation (`truncate_prompt_tokens`: the engine keeps the end)."""
        return None if request.truncate_prompt_tokens is not None else self.max_model_len

    def encode_batch(
        self,
        texts: list[str],
        add_special_tokens: bool,
        param: str = "prompt",
        limit: int | None = None,
    ) -> list[list[int]]:
        """Token ids of several texts, from one batched tokenizer call (blocking: see
        `encode_many` for the event loop); `prompt_encoding.encode_texts`.

        Raises:
            APIError 400 (param `param`): no tokenizer, text the tokenizer refuses, a text
                of more than `limit` tokens (the engine's wording for a prompt over
                max_model_len; its ids are never made).
        """
        tok = self.require_tokenizer()
        try:
            return encode_texts(tok, texts, add_special_tokens, limit)
        except PromptTooLongError as e:
            too_long = prompt_too_long(e.num_tokens, self.max_model_len)
            raise bad_request(str(too_long), param) from e
        except (TypeError, ValueError) as e:  # e.g. an unpaired UTF-16 surrogate
            raise bad_request(f"the {param} cannot be tokenized: {e}", param) from e

    async def encode_many(
        self,
        texts: list[str],
        add_special_tokens: bool,
        param: str = "prompt",
        limit: int | None = None,
    ) -> list[list[int]]:
        """`encode_batch` on the tokenizer threads."""
        return await self.off_loop(self.encode_batch, texts, add_special_tokens, param, limit)

    async def render_chat_async(self, *args: Any, **kwargs: Any) -> list[int]:
        """`render_chat` on the tokenizer threads."""
        return await self.off_loop(self.render_chat, *args, **kwargs)

    async def tokenize(self, request: TokenizeRequest) -> Response:
        """`POST /tokenize` (a `TokenizeResponse`), its tokenization off the event loop.

        Raises:
            APIError 400/404: a bad request, an unknown model.
        """
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("give exactly one of prompt and messages")
        if request.messages is not None:
            if not request.messages:
                raise bad_request("messages must not be empty", "messages")
            if request.add_generation_prompt and request.continue_final_message:
                raise bad_request(
                    "add_generation_prompt and continue_final_message are exclusive",
                    "continue_final_message",
                )
            ids = await self.render_chat_async(
                request.messages,
                request.add_generation_prompt,
                request.continue_final_message,
                request.tools,
            )
        else:
            add = True if request.add_special_tokens is None else request.add_special_tokens
            (ids,) = await self.encode_many([request.prompt], add)
        strs = None
        if request.return_token_strs:
            strs = await self.off_loop(self.require_tokenizer().convert_ids_to_tokens, ids)
        response = TokenizeResponse(
            count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs
        )
        return await self.json_off_loop(response)

    async def detokenize(self, request: DetokenizeRequest) -> Response:
        """`POST /detokenize` (a `DetokenizeResponse`), checked and decoded off the event
        loop.

        Raises:
            APIError 400/404: a token id outside the vocabulary, no tokenizer, an unknown
                model.
        """
        self.check_model(request.model)
        self.require_tokenizer()

        def detokenize() -> DetokenizeResponse:
            self.check_token_ids(request.tokens, "a")
            return DetokenizeResponse(prompt=self.decode(request.tokens))

        return await self.json_off_loop(await self.off_loop(detokenize))

    async def json_off_loop(self, response: BaseModel) -> Response:
        """A response model as a JSON body serialised on the tokenizer threads (returned
        as the model, FastAPI validates it again and serialises it on the event loop)."""
        body = await self.off_loop(response.model_dump_json)
        return Response(body, media_type="application/json")

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids))

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Sequence[Any] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        limit: int | None = None,
    ) -> list[int]:
        """Token ids of a conversation through the server's chat template (`--chat-template`,
        else the tokenizer's); see `chat_rendering.render_chat`. The first request with
        tools under a template that never reads them is logged, once per server.

        Raises:
            APIError 400: no tokenizer or template, a message the template cannot render,
                non-text content, a rendered prompt of more than `limit` tokens (param
                "messages").
        """
        tok = self.require_tokenizer()
        if tools and not self._tools_warned:
            self._tools_warned = True
            if not template_reads_tools(
                self.chat_template if self.chat_template is not None else tok
            ):
                logger.warning(
                    "the chat template does not render `tools`: requests with tools are "
                    "rendered without them (start the server with a --chat-template that "
                    "renders them)"
                )
        return render_chat(
            tok,
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            template_kwargs=template_kwargs,
            encode=lambda text: self.encode_batch([text], False, "messages", limit)[0],
            content_format=self.content_format,
        )

    # ------------------------------------------------------------------ logprobs

    def token_str(self, token_id: int, lp: Logprob | None, as_ids: bool) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.decode([token_id])

    def prompt_logprobs(
        self, steps: Sequence[dict[int, Logprob] | None] | None
    ) -> PromptLogprobs | None:
        """vLLM's `prompt_logprobs` from the engine's: None for the first prompt token, then
        token id (as a string) -> logprob (-inf as -9999.0), rank and decoded text."""
        if steps is None:
            return None
        return [
            None
            if step is None
            else {
                str(t): PromptLogprob(
                    logprob=clamp_logprob(lp.logprob),
                    rank=lp.rank,
                    decoded_token=lp.decoded_token
                    if lp.decoded_token is not None
                    else self.decode([t]),
                )
                for t, lp in step.items()
            }
            for step in steps
        ]

    async def prompt_logprobs_async(
        self, steps: Sequence[dict[int, Logprob] | None] | None
    ) -> PromptLogprobs | None:
        """`prompt_logprobs` on the tokenizer threads: for a long prompt it is seconds of
        Python (8,192 positions x 21 entries: ~1 s), which must not hold up other streams."""
        if steps is None:
            return None
        return await self.off_loop(self.prompt_logprobs, steps)

    def top_entries(
        self, step: dict[int, Logprob], k: int, as_ids: bool
    ) -> list[tuple[str, float]]:
        """The k most likely entries of one position's logprob dict, as (token, logprob)."""
        ranked = sorted(
            step.items(),
            key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob),
        )
        return [(self.token_str(t, lp, as_ids), clamp_logprob(lp.logprob)) for t, lp in ranked[:k]]


@functools.cache
def _pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(
        TOKENIZER_THREADS, thread_name_prefix="pagedjax-tokenize"
    )


def clamp_logprob(x: float) -> float:
    return _MIN_LOGPROB if math.isinf(x) or math.isnan(x) else max(x, _MIN_LOGPROB)


async def merge_streams(
    streams: Sequence[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves several requests' outputs as (position, output), in arrival order.

    An `EngineError` of any stream is raised; on exit (finished, failed or cancelled) every
    stream is aborted, so no request outlives its consumer.
    """
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            streams[0].abort()
        return
    q: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    done = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                q.put_nowait((i, out))
        except Exception as e:
            q.put_nowait((i, e))
        finally:
            q.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()


LOGGED_PARAMS_CHARS = 1000  # a logged request's parameters are cut after this many characters


def _log_request(request_id: str, prompt: PromptType, params: SamplingParams) -> None:
    """--enable-log-requests: a request's id, prompt token count and sampling parameters
    (cut at `LOGGED_PARAMS_CHARS`; never the prompt's text)."""
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
    count = len(ids) if isinstance(ids, list) else "?"
    text = repr(params)
    if len(text) > LOGGED_PARAMS_CHARS:
        text = text[:LOGGED_PARAMS_CHARS] + "...(cut)"
    logger.info("Received request %s: %s prompt tokens, params: %s", request_id, count, text)
