"""Pydantic models of the OpenAI API's responses (and its error body), with vLLM's extra
fields (`prompt_logprobs`, `stop_reason`, a model card's `max_model_len`); the requests are
in `protocol`. Field meanings follow OpenAI's API reference."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import Field, TypeAdapter, model_serializer

from pagedjax.server.protocol_base import ResponseModel
from pagedjax.server.protocol_tools import DeltaToolCall, ToolCall

# --------------------------------------------------------------------------- errors


class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(ResponseModel):
    """OpenAI's error body: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorInfo


# --------------------------------------------------------------------------- responses


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # left out when None

    @model_serializer(mode="wrap")
    def _without_details(self, handler):
        data = handler(self)
        if self.prompt_tokens_details is None:
            data.pop("prompt_tokens_details", None)
        return data


class CompletionLogprobs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(ResponseModel):
    """vLLM's per-token entry of `prompt_logprobs` (rank 1 is the most likely token)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's `prompt_logprobs`: per prompt position, None for the first token, else token id
# (a string, as JSON keys are) -> its entry: the prompt's own token and the most likely ones.
PromptLogprobs = list[dict[str, PromptLogprob] | None]
# Serialises a PromptLogprobs on its own (the chat stream's first chunk carries it).
PROMPT_LOGPROBS = TypeAdapter(PromptLogprobs)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM; in a stream: the first chunk


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(ResponseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning: str | None = None  # with --reasoning-parser; left out of the JSON when None
    tool_calls: list[ToolCall] | None = None  # left out of the JSON when None


class ChatChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra, for the one prompt


class DeltaMessage(ResponseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # in the first chunk only


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedjax"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str
