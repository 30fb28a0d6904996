"""`/v1/chat/completions`: messages -> the chat template -> one engine request of n
sequences -> a `chat.completion`, or server-sent `chat.completion.chunk`s ending with
`data: [DONE]`.

A stream opens each choice with a chunk whose delta is `{"role": "assistant", "content": ""}`,
then sends content deltas; the last chunk of a choice carries its `finish_reason`. With
`stream_options.include_usage`, a final chunk with no choices carries the usage.

vLLM's extras: `echo` starts each reply with the final message's content when that message
is the assistant's (streamed: a content chunk right after the role chunk), so that with
`continue_final_message` the reply holds the whole continued message; `prompt_logprobs` comes
back as the response's `prompt_logprobs` (streamed: in the first chunk). The chat template is
rendered and tokenized off the event loop. `tool_choice` other than "none" needs `tools`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, StreamingResponse

from pagedjax.engine.async_llm import EngineError, RequestStream
from pagedjax.outputs import CompletionOutput
from pagedjax.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from pagedjax.server.serving import (
    SSE_DONE,
    APIError,
    OpenAIServing,
    bad_input,
    clamp_logprob,
    merge_streams,
    random_id,
    sse,
)


class OpenAIServingChat(OpenAIServing):
    """Handles `ChatCompletionRequest`s (see the module docstring)."""

    async def create(self, request: ChatCompletionRequest):
        """Returns a JSONResponse or a StreamingResponse; raises APIError for bad input."""
        self.check_model(request.model)
        self.warn_ignored_fields(request)
        try:
            params = request.to_sampling_params()  # max_tokens None: all the room left
        except ValueError as e:
            raise bad_input(e) from e
        ids = await self.render_chat_async(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.tools if request.tool_choice == "none" else None,
            request.chat_template_kwargs,
        )
        request_id = random_id("chatcmpl")
        (stream,) = await self.add_requests(
            [(request_id, {"prompt_token_ids": ids}, params)],
            request.priority,
            check_max_tokens=params.max_tokens is not None,
            prompt_param="messages",
        )
        created = int(time.time())
        echo = _echo_text(request)
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, created, stream, echo),
                media_type="text/event-stream",
            )
        final = None
        try:
            async for _, out in merge_streams([stream]):
                final = out
        except EngineError as e:
            raise APIError(500, str(e), type="server_error") from e
        choices = [
            ChatChoice(
                index=o.index,
                message=ChatResponseMessage(content=echo + o.text),
                logprobs=self._logprobs(request, o),
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
            )
            for o in final.outputs
        ]
        completion_tokens = sum(len(o.token_ids) for o in final.outputs)
        body = ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.served_model_name,
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=len(final.prompt_token_ids),
                completion_tokens=completion_tokens,
                total_tokens=len(final.prompt_token_ids) + completion_tokens,
            ),
            prompt_logprobs=self.prompt_logprobs(final.prompt_logprobs),
        )
        data = body.model_dump()
        if request.prompt_logprobs is None:
            del data["prompt_logprobs"]  # OpenAI's shape unless asked for
        return JSONResponse(data)

    def _logprobs(self, request: ChatCompletionRequest, o: CompletionOutput) -> ChatLogprobs | None:
        """OpenAI's chat `logprobs` object: per output token its text, logprob and UTF-8
        bytes, and the `top_logprobs` most likely; None when not asked for or not computed."""
        if not request.logprobs or o.logprobs is None:
            return None
        k = request.top_logprobs or 0
        token_ids = list(o.token_ids)
        content = []
        for token_id, step in zip(
            token_ids, o.logprobs[-len(token_ids) :] if token_ids else [], strict=False
        ):
            lp = step.get(token_id) if step else None
            token = self.token_str(token_id, lp, False)
            top = self.top_entries(step, k, False) if step and k else []
            content.append(
                TokenLogprob(
                    token=token,
                    logprob=clamp_logprob(lp.logprob) if lp is not None else -9999.0,
                    bytes=list(token.encode("utf-8")),
                    top_logprobs=[
                        TopLogprob(token=t, logprob=v, bytes=list(t.encode("utf-8")))
                        for t, v in top
                    ],
                )
            )
        return ChatLogprobs(content=content)

    async def _stream(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        stream: RequestStream,
        echo: str,
    ) -> AsyncIterator[str]:
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        completion_tokens = [0] * request.n
        prompt_tokens = 0  # the engine's count (after truncation), from the first output

        def usage() -> UsageInfo:
            c = sum(completion_tokens)
            return UsageInfo(
                prompt_tokens=prompt_tokens, completion_tokens=c, total_tokens=prompt_tokens + c
            )

        def chunk(choices: list[ChatChunkChoice], with_usage: bool, prompt_logprobs=None) -> str:
            body = ChatCompletionChunk(
                id=request_id,
                created=created,
                model=self.served_model_name,
                choices=choices,
                usage=usage() if with_usage else None,
                prompt_logprobs=prompt_logprobs,
            )
            data = body.model_dump()
            if prompt_logprobs is None:
                del data["prompt_logprobs"]
            for c in data["choices"]:  # a delta names only what it carries
                c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
            return sse(json.dumps(data, ensure_ascii=False))

        try:
            first_output = True
            async for _, out in merge_streams([stream]):
                if first_output:  # the role chunks, once the prompt's token count is known
                    first_output = False
                    prompt_tokens = len(out.prompt_token_ids)
                    plp = self.prompt_logprobs(out.prompt_logprobs)
                    for i in range(request.n):
                        role = DeltaMessage(role="assistant", content="")
                        yield chunk([ChatChunkChoice(index=i, delta=role)], continuous, plp)
                        plp = None
                        if echo:
                            echoed = ChatChunkChoice(index=i, delta=DeltaMessage(content=echo))
                            yield chunk([echoed], continuous)
                for o in out.outputs:
                    completion_tokens[o.index] += len(o.token_ids)
                    if not o.text and o.finish_reason is None and not request.logprobs:
                        continue  # e.g. a token that ends inside a UTF-8 character
                    choice = ChatChunkChoice(
                        index=o.index,
                        delta=DeltaMessage(content=o.text),
                        logprobs=self._logprobs(request, o),
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                    )
                    yield chunk([choice], continuous)
            if include_usage:
                yield chunk([], True)
        except EngineError as e:
            yield sse(APIError(500, str(e), type="server_error").body.model_dump_json())
        yield SSE_DONE


def _echo_text(request: ChatCompletionRequest) -> str:
    """With `echo`, the final message's content when it is the assistant's (text parts
    joined as the template saw them), else ""."""
    last = request.messages[-1]
    if not request.echo or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(p.text or "" for p in last.content)
