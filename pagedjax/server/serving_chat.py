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
rendered and tokenized off the event loop.

Constrained output (`response_format`, `structured_outputs`) is a `StructuredOutputsParams`
the engine enforces (`constraints.py`). Tools are rendered through the chat template's
`tools` argument. `tool_choice` "required" and a named function are enforced by a JSON
schema built from the tools, and their output read by `RequiredToolParser` /
`NamedToolParser`; "auto" (the default with tools) needs `--enable-auto-tool-choice` and
reads the output with the `--tool-call-parser`'s parser; "none" reads nothing. Parsed calls
come back as `message.tool_calls` with `finish_reason` "tool_calls"; a stream sends them as
OpenAI's tool-call deltas (`ToolCallStreamer`), which concatenate to the same calls. A forced
reply cut off by `max_tokens` keeps the calls it completed, with `finish_reason` "length"; a
stream of "required" calls sends each call whole once its object closes, so it has sent
exactly those (a named call streams its arguments as they come, and a cut one is content in
the whole reply). With `--reasoning-parser`, the reply's thinking is `message.reasoning`
(streamed: `delta.reasoning`) and the rest is read as above (`reasoning_parsers`).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Sequence

from fastapi.responses import Response, StreamingResponse

from pagedjax.engine.async_llm import AsyncLLM, EngineError, RequestStream
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.server.protocol import (
    ChatCompletionRequest,
)
from pagedjax.server.protocol_responses import (
    PROMPT_LOGPROBS,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    DeltaMessage,
    PromptTokensDetails,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from pagedjax.server.protocol_tools import NamedToolChoice
from pagedjax.server.reasoning_parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningStreamer,
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
from pagedjax.server.tool_parsers import (
    TOOL_PARSERS,
    NamedToolParser,
    RequiredToolParser,
    ToolCallStreamer,
    ToolParser,
)


class OpenAIServingChat(OpenAIServing):
    """Handles `ChatCompletionRequest`s (see the module docstring).

    Args:
        enable_auto_tool_choice: `tool_choice="auto"` is served (vLLM's flag).
        tool_call_parser: the parser of "auto" tool calls, a key of `TOOL_PARSERS`.

    Raises:
        ValueError: an unknown parser, or auto tool choice without a parser.
    """

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_name: str | Sequence[str],
        chat_template: str | None,
        enable_auto_tool_choice: bool = False,
        tool_call_parser: str | None = None,
        response_role: str = "assistant",
        reasoning_parser: str | None = None,
    ):
        super().__init__(engine, served_model_name, chat_template)
        self.response_role = response_role
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown --reasoning-parser {reasoning_parser!r}; known: "
                f"{sorted(REASONING_PARSERS)}"
            )
        self.reasoning = REASONING_PARSERS[reasoning_parser]() if reasoning_parser else None
        if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
            raise ValueError(
                f"unknown --tool-call-parser {tool_call_parser!r}; known: {sorted(TOOL_PARSERS)}"
            )
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser

    def tool_parser(self, request: ChatCompletionRequest) -> ToolParser | None:
        """The parser of this request's tool calls (None: its output is plain content).

        Raises:
            APIError 400: "auto" tool choice on a server started without it.
        """
        choice = request.effective_tool_choice
        if not request.tools or choice == "none":
            return None
        if choice == "required":
            return RequiredToolParser()
        if isinstance(choice, NamedToolChoice):
            return NamedToolParser(choice.function.name)
        if not self.enable_auto_tool_choice:
            raise bad_request(
                '"auto" tool choice (the default when tools are given) needs the server to be '
                "started with --enable-auto-tool-choice and --tool-call-parser; or send "
                'tool_choice "none", "required" or a named function',
                "tool_choice",
            )
        return TOOL_PARSERS[self.tool_call_parser]()

    async def create(self, request: ChatCompletionRequest, prompt_tokens_details: bool = False):
        """Returns a JSON Response or a StreamingResponse; raises APIError for bad input.
        With `prompt_tokens_details` (or the server's `enable_prompt_tokens_details`), the
        usage has `prompt_tokens_details.cached_tokens`."""
        details = prompt_tokens_details or self.enable_prompt_tokens_details
        self.check_model(request.model)
        self.warn_ignored_fields(request)
        try:
            params = request.to_sampling_params(self.default_sampling_fields)
            source = request.constraint()[1]
        except ValueError as e:
            raise bad_input(e) from e
        parser = self.tool_parser(request)
        ids = await self.render_chat_async(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.tools,
            request.chat_template_kwargs,
            self.prompt_limit(request),
        )
        request_id = random_id("chatcmpl")
        constraint_param = "tools" if source == "tool_choice" else source
        (stream,) = await self.add_requests(
            [(request_id, {"prompt_token_ids": ids}, params)],
            request.priority,
            check_max_tokens=params.max_tokens is not None,
            prompt_param="messages",
            constraint_param=constraint_param,
            max_tokens_param=(
                "max_completion_tokens"
                if request.max_completion_tokens is not None
                else "max_tokens"
            ),
        )
        created = int(time.time())
        echo = _echo_text(request)
        if request.stream:
            return StreamingResponse(
                self._stream(request, request_id, created, stream, echo, parser, details),
                media_type="text/event-stream",
            )
        final = None
        try:
            async for _, out in merge_streams([stream]):
                final = out
        except EngineError as e:
            raise APIError(500, str(e), type="server_error") from e
        refuse_late_constraint_errors([final], constraint_param)
        args = (request, request_id, created, final, echo, parser, details)
        return Response(await self.off_loop(self._final_body, *args), media_type="application/json")

    def _final_body(
        self,
        request: ChatCompletionRequest,
        request_id: str,
        created: int,
        final: RequestOutput,
        echo: str,
        parser: ToolParser | None,
        details: bool = False,
    ) -> str:
        """The non-streamed response's JSON (run off the event loop: prompt logprobs may be
        large); `prompt_logprobs` only when asked for, `tool_calls` only when present, the
        usage's `prompt_tokens_details` with `details`."""
        choices = [
            ChatChoice(
                index=o.index,
                message=_message(o, echo, parser, self._role(request), self._reasoning(request)),
                logprobs=self._logprobs(request, o),
                finish_reason=o.finish_reason,
                stop_reason=o.stop_reason,
            )
            for o in final.outputs
        ]
        for c in choices:
            if c.message.tool_calls and c.finish_reason == "stop":
                c.finish_reason = "tool_calls"
        completion_tokens = sum(len(o.token_ids) for o in final.outputs)
        body = ChatCompletionResponse(
            id=request_id,
            created=created,
            model=self.model_name(request.model),
            choices=choices,
            usage=UsageInfo(
                prompt_tokens=len(final.prompt_token_ids),
                completion_tokens=completion_tokens,
                total_tokens=len(final.prompt_token_ids) + completion_tokens,
                prompt_tokens_details=_details(final) if details else None,
            ),
            prompt_logprobs=self.prompt_logprobs(final.prompt_logprobs),
        )
        exclude: dict = {"choices": {}}
        for i, c in enumerate(choices):  # OpenAI's shape: no null tool_calls or reasoning
            unset = {k for k in ("tool_calls", "reasoning") if getattr(c.message, k) is None}
            if unset:
                exclude["choices"][i] = {"message": unset}
        if request.prompt_logprobs is None:
            exclude["prompt_logprobs"] = True  # OpenAI's shape unless asked for
        return body.model_dump_json(exclude=exclude)

    def _reasoning(self, request: ChatCompletionRequest) -> ReasoningParser | None:
        """The reasoning parser of a request's reply, if it thinks (`--reasoning-parser`)."""
        if self.reasoning is None or not self.reasoning.thinks(request.chat_template_kwargs):
            return None
        return self.reasoning

    def _role(self, request: ChatCompletionRequest) -> str:
        """The reply's role, as vLLM chooses it: `--response-role` (default "assistant")
        after a generation prompt, else the role of the message the model continues."""
        if request.add_generation_prompt:
            return self.response_role
        return request.messages[-1].role

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
        parser: ToolParser | None,
        details: bool = False,
    ) -> AsyncIterator[str]:
        opts = request.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = bool(opts and opts.continuous_usage_stats)
        completion_tokens = [0] * request.n
        streamers = [ToolCallStreamer(parser) for _ in range(request.n)] if parser else None
        thinks = self._reasoning(request) is not None
        thoughts = [ReasoningStreamer(thinks) for _ in range(request.n)]
        texts = [""] * request.n  # each choice's output so far (read by the tool parser)
        prompt_tokens = 0  # the engine's count (after truncation), from the first output
        cached = None  # with `details`: the prompt's tokens served from the prefix cache

        def usage() -> UsageInfo:
            c = sum(completion_tokens)
            return UsageInfo(
                prompt_tokens=prompt_tokens,
                completion_tokens=c,
                total_tokens=prompt_tokens + c,
                prompt_tokens_details=cached,
            )

        def chunk(choices: list[ChatChunkChoice], with_usage: bool, prompt_logprobs=None) -> str:
            body = ChatCompletionChunk(
                id=request_id,
                created=created,
                model=self.model_name(request.model),
                choices=choices,
                usage=usage() if with_usage else None,
            )
            exclude = {"choices": {"__all__": {"delta": {"tool_calls"}}}, "prompt_logprobs": True}
            data = body.model_dump(exclude=exclude)
            for c, choice in zip(data["choices"], choices, strict=True):
                # a delta names only what it carries
                c["delta"] = {k: v for k, v in c["delta"].items() if v is not None}
                if choice.delta.tool_calls:
                    c["delta"]["tool_calls"] = [
                        t.model_dump(exclude_none=True) for t in choice.delta.tool_calls
                    ]
            text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
            if prompt_logprobs is not None:  # the last field, serialised by pydantic (faster)
                plp = PROMPT_LOGPROBS.dump_json(prompt_logprobs).decode()
                text = f'{text[:-1]},"prompt_logprobs":{plp}}}'
            return sse(text)

        try:
            first_output = True
            async for _, out in merge_streams([stream]):
                if first_output:  # the role chunks, once the prompt's token count is known
                    first_output = False
                    prompt_tokens = len(out.prompt_token_ids)
                    cached = _details(out) if details else None
                    plp = await self.prompt_logprobs_async(out.prompt_logprobs)
                    for i in range(request.n):
                        role = DeltaMessage(role=self._role(request), content="")
                        yield chunk([ChatChunkChoice(index=i, delta=role)], continuous, plp)
                        plp = None
                        if echo:
                            echoed = ChatChunkChoice(index=i, delta=DeltaMessage(content=echo))
                            yield chunk([echoed], continuous)
                for o in out.outputs:
                    completion_tokens[o.index] += len(o.token_ids)
                    final = o.finish_reason is not None
                    reasoning, text = thoughts[o.index].update(o.text, final)
                    step = []  # this step's chunks of the choice
                    if reasoning:
                        step.append(
                            ChatChunkChoice(index=o.index, delta=DeltaMessage(reasoning=reasoning))
                        )
                    if streamers is not None:
                        texts[o.index] += text
                        step += self._tool_chunks(request, o, texts[o.index], streamers, bool(step))
                    elif text or final or (request.logprobs and o.token_ids and not step):
                        # (an empty step is e.g. a token that ends inside a UTF-8 character)
                        delta = DeltaMessage(content=text) if text or not thinks else DeltaMessage()
                        step.append(
                            ChatChunkChoice(
                                index=o.index,
                                delta=delta,
                                finish_reason=o.finish_reason,
                                stop_reason=o.stop_reason,
                            )
                        )
                    if step:  # the step's logprobs go with its first chunk
                        step[0].logprobs = self._logprobs(request, o)
                    for c in step:
                        yield chunk([c], continuous)
            if include_usage:
                yield chunk([], True)
        except EngineError as e:
            yield sse(APIError(500, str(e), type="server_error").body.model_dump_json())
        yield SSE_DONE

    def _tool_chunks(
        self,
        request: ChatCompletionRequest,
        o: CompletionOutput,
        text: str,
        streamers: list[ToolCallStreamer],
        carried: bool = False,
    ) -> list[ChatChunkChoice]:
        """The chunks of one step of a choice read by a tool parser: its content and
        tool-call deltas, the finish reason with the last ("tool_calls" when calls were sent
        and the output stopped); an empty chunk carries the step's logprobs (set by the
        caller on the step's first chunk) when there is nothing else and no earlier chunk of
        the step (`carried`: a reasoning chunk) carries them."""
        streamer = streamers[o.index]
        final = o.finish_reason is not None
        deltas = [
            DeltaMessage(content=content) if tool is None else DeltaMessage(tool_calls=[tool])
            for content, tool in streamer.update(text, final)
        ]
        if not deltas and (final or (request.logprobs and o.token_ids and not carried)):
            deltas = [DeltaMessage()]
        out = [ChatChunkChoice(index=o.index, delta=d) for d in deltas]
        if final:
            reason = o.finish_reason
            if streamer.tools_called and reason == "stop":
                reason = "tool_calls"
            out[-1].finish_reason, out[-1].stop_reason = reason, o.stop_reason
        return out


def _message(
    o: CompletionOutput,
    echo: str,
    parser: ToolParser | None,
    role: str,
    reasoning_parser: ReasoningParser | None = None,
) -> ChatResponseMessage:
    """The reply of one finished choice: its text, or with a tool parser the content and
    calls it reads (an output whose calls do not parse is all content; a forced one cut by
    the length limit keeps its complete calls, see `ToolParser.extract`); with a reasoning
    parser, its thinking apart and the tool parser reading the rest."""
    reasoning, text = None, o.text
    if reasoning_parser is not None:
        reasoning, text = reasoning_parser.extract(o.text)
        if text is None and not echo:
            return ChatResponseMessage(role=role, content=None, reasoning=reasoning)
        text = text or ""
    if parser is None:
        return ChatResponseMessage(role=role, content=echo + text, reasoning=reasoning)
    content, calls = parser.extract(text, cut=o.finish_reason == "length")
    if echo:
        content = echo + (content or "")
    return ChatResponseMessage(
        role=role, content=content, reasoning=reasoning, tool_calls=calls or None
    )


def _details(out: RequestOutput) -> PromptTokensDetails:
    """A usage's `prompt_tokens_details`: the prompt tokens served from the prefix cache."""
    return PromptTokensDetails(cached_tokens=out.num_cached_tokens or 0)


def _echo_text(request: ChatCompletionRequest) -> str:
    """With `echo`, the final message's content when it is the assistant's (text parts
    joined as the template saw them), else ""."""
    last = request.messages[-1]
    if not request.echo or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(p.text or "" for p in last.content)
