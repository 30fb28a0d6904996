"""`/v1/completions`: prompts (text, token ids, or lists of either) -> engine requests ->
one JSON `CompletionResponse`, or server-sent `text_completion` chunks ending with
`data: [DONE]`.

Each prompt of the list is one engine request of n sequences; choice i*n + j is sequence j
of prompt i (OpenAI's and vLLM's order). With `echo`, the prompt text leads each choice's
text (in a stream, as the choice's first chunk). Usage counts every prompt once and every
choice's output tokens; a prompt's token count is the engine's, after truncate_prompt_tokens.
With vLLM's `prompt_logprobs`, each choice carries its prompt's (in a stream: in the choice's
first chunk), echo or not. Text prompts are tokenized in one batched call, off the event loop.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi.responses import Response, StreamingResponse

from pagedjax.engine.async_llm import EngineError, RequestStream
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.server.protocol import (
    CompletionRequest,
)
from pagedjax.server.protocol_responses import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
)
from pagedjax.server.serving import (
    SSE_DONE,
    OpenAIServing,
    clamp_logprob,
    merge_streams,
    random_id,
    sse,
)
from pagedjax.server.serving_errors import (
    APIError,
    bad_input,
    bad_request,
    refuse_late_constraint_errors,
)


class OpenAIServingCompletion(OpenAIServing):
    """Handles `CompletionRequest`s (see the module docstring)."""

    async def _prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        """(text or None, token ids) per prompt; raises APIError 400 for an empty one or
        text that cannot be tokenized."""
        p = request.prompt
        if isinstance(p, str):
            items: list = [p]
        elif not p:
            raise bad_request("prompt must not be empty", "prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        for i, item in enumerate(items):
            if isinstance(item, str) and not item:
                raise bad_request(f"prompt {i} must not be empty", "prompt")
        texts = [item for item in items if isinstance(item, str)]
        limit = self.prompt_limit(request)
        encoded = iter(
            await self.encode_many(texts, request.add_special_tokens, limit=limit) if texts else []
        )
        return [
            (item, next(encoded))
            if isinstance(item, str)
            else (None, item)  # the engine checks ids
            for item in items
        ]

    async def create(self, request: CompletionRequest):
        """Returns a JSON Response or a StreamingResponse; raises APIError for bad input."""
        self.check_model(request.model)
        self.warn_ignored_fields(request)
        try:
            params = request.to_sampling_params(self.default_sampling_fields)
        except ValueError as e:
            raise bad_input(e) from e
        request_id = random_id("cmpl")
        prompts = await self._prompts(request)
        engine_requests = [
            (f"{request_id}-{i}", {"prompt_token_ids": ids}, params)
            for i, (_, ids) in enumerate(prompts)
        ]
        streams = await self.add_requests(
            engine_requests, request.priority, check_max_tokens=request.max_tokens is not None
        )
        created = int(time.time())
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, created, prompts, streams),
                media_type="text/event-stream",
            )
        results: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in merge_streams(streams):
                results[i] = out
        except EngineError as e:
            raise APIError(500, str(e), type="server_error") from e
        refuse_late_constraint_errors(results)

        def body() -> str:  # off the event loop: prompt logprobs may be large
            return self._response(request, request_id, created, prompts, results).model_dump_json()

        return Response(await self.off_loop(body), media_type="application/json")

    def _echo_text(self, text: str | None, ids: list[int]) -> str:
        return text if text is not None else self.decode(ids)

    def _response(self, request, request_id, created, prompts, results) -> CompletionResponse:
        choices = []
        completion_tokens = 0
        for i, ((text, _), res) in enumerate(zip(prompts, results, strict=True)):
            echo = self._echo_text(text, res.prompt_token_ids) if request.echo else ""
            prompt_logprobs = self.prompt_logprobs(res.prompt_logprobs)
            for o in res.outputs:
                completion_tokens += len(o.token_ids)
                choices.append(
                    CompletionChoice(
                        index=i * request.n + o.index,
                        text=echo + o.text,
                        logprobs=self._logprobs(request, o, res, 0, len(echo)),
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                        prompt_logprobs=prompt_logprobs,
                    )
                )
        prompt_tokens = sum(len(res.prompt_token_ids) for res in results)
        return CompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name(request.model),
            choices=sorted(choices, key=lambda c: c.index),
            usage=UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens,
                prompt_tokens_details=self._details(results),
            ),
        )

    def _details(self, results: list[RequestOutput]) -> PromptTokensDetails | None:
        """With `--enable-prompt-tokens-details`: the prompt tokens served from the prefix
        cache, over every prompt of the request."""
        if not self.enable_prompt_tokens_details:
            return None
        return PromptTokensDetails(cached_tokens=sum(r.num_cached_tokens or 0 for r in results))

    def _logprobs(
        self,
        request: CompletionRequest,
        o: CompletionOutput,
        res: RequestOutput,
        offset: int,
        echo_len: int,
    ) -> CompletionLogprobs | None:
        """OpenAI's completions `logprobs` object from the engine's per-token dicts: the
        sampled token's logprob and the `logprobs` most likely; None when not asked for or
        not computed. `offset` is where this text starts in the choice's text; `echo_len`
        > 0 when it starts with the echoed prompt, whose tokens then come first."""
        if request.logprobs is None or o.logprobs is None:
            return None
        as_ids = request.return_tokens_as_token_ids
        k = request.logprobs
        out = CompletionLogprobs()
        steps: list[tuple[int, dict | None]] = []
        if echo_len and res.prompt_logprobs is not None:
            steps += list(zip(res.prompt_token_ids, res.prompt_logprobs, strict=False))
        else:
            offset += echo_len
        token_ids = list(o.token_ids)
        steps += list(
            zip(token_ids, o.logprobs[-len(token_ids) :] if token_ids else [], strict=False)
        )
        for token_id, step in steps:
            lp = step.get(token_id) if step else None
            token = self.token_str(token_id, lp, as_ids)
            out.tokens.append(token)
            out.text_offset.append(offset)
            offset += len(token)
            if step is None:  # the first prompt token has no logprob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(clamp_logprob(lp.logprob) if lp is not None else None)
            top: dict[str, float] = {}
            for t, v in self.top_entries(step, k, as_ids) if k else []:
                top.setdefault(t, v)  # tokens that decode alike: the likeliest is kept
            if lp is not None:
                top.setdefault(token, clamp_logprob(lp.logprob))
            out.top_logprobs.append(top)
        return out

    async def _stream(
        self,
        request: CompletionRequest,
        request_id: str,
        created: int,
        prompts: list[tuple[str | None, list[int]]],
        streams: list[RequestStream],
    ) -> AsyncIterator[str]:
        n = request.n
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        prompt_lens = [0] * len(prompts)  # the engine's counts, known from a prompt's output
        firsts: list = [None] * len(prompts)  # each prompt's first output (its cached tokens)
        completion_tokens = [0] * (len(prompts) * n)
        echo_pending = [request.echo] * len(completion_tokens)
        prompt_lps: list = [None] * len(prompts)  # each prompt's, from its first output
        lps_pending = [request.prompt_logprobs is not None] * len(completion_tokens)
        sent_chars = [0] * len(completion_tokens)  # where the next logprobs' offsets start

        def usage() -> UsageInfo:
            p, c = sum(prompt_lens), sum(completion_tokens)
            details = self._details([f for f in firsts if f is not None])
            return UsageInfo(
                prompt_tokens=p,
                completion_tokens=c,
                total_tokens=p + c,
                prompt_tokens_details=details,
            )

        def chunk(choices: list[CompletionChoice], with_usage: bool) -> str:
            body = CompletionResponse(
                id=request_id,
                created=created,
                model=self.model_name(request.model),
                choices=choices,
                usage=usage() if with_usage else None,
            )
            if any(c.prompt_logprobs is not None for c in choices):
                return sse(body.model_dump_json())
            return sse(body.model_dump_json(exclude={"choices": {"__all__": {"prompt_logprobs"}}}))

        try:
            async for i, out in merge_streams(streams):
                prompt_lens[i] = len(out.prompt_token_ids)
                firsts[i] = firsts[i] or out
                if out.prompt_logprobs is not None and prompt_lps[i] is None:
                    prompt_lps[i] = await self.prompt_logprobs_async(out.prompt_logprobs)
                for o in out.outputs:
                    idx = i * n + o.index
                    text, echo_len = o.text, 0
                    plp = None
                    if lps_pending[idx] and prompt_lps[i] is not None:
                        plp, lps_pending[idx] = prompt_lps[i], False
                    if echo_pending[idx]:
                        echo = self._echo_text(prompts[i][0], out.prompt_token_ids)
                        text, echo_len = echo + text, len(echo)
                        echo_pending[idx] = False
                    completion_tokens[idx] += len(o.token_ids)
                    quiet = not text and o.finish_reason is None and request.logprobs is None
                    if quiet and plp is None:
                        continue  # e.g. a token that ends inside a UTF-8 character
                    choice = CompletionChoice(
                        index=idx,
                        text=text,
                        logprobs=self._logprobs(request, o, out, sent_chars[idx], echo_len),
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                        prompt_logprobs=plp,
                    )
                    lp = choice.logprobs
                    if lp is not None and lp.tokens:  # offsets run on over token strings
                        sent_chars[idx] = lp.text_offset[-1] + len(lp.tokens[-1])
                    else:
                        sent_chars[idx] += len(text)
                    yield chunk([choice], continuous)
            if include_usage:
                yield chunk([], True)
        except EngineError as e:
            yield sse(APIError(500, str(e), type="server_error").body.model_dump_json())
        yield SSE_DONE
