"""Pydantic models of the OpenAI API's requests, with vLLM's extra fields (the responses are in
`protocol_responses`).

Requests are validated strictly (JSON types are not coerced: `"max_tokens": "5"` or `true`
for an integer is refused; NaN and infinities are refused) and each range is declared on the
field, so that the OpenAPI document at `/openapi.json` describes what is accepted and every
violation is an HTTP 400. Text that cannot be encoded as UTF-8 (a JSON string holding an
unpaired UTF-16 surrogate such as `"\\ud800"`) is refused in every field. Unknown fields
are accepted and ignored (OpenAI clients send fields this server does not use, such as
`user` or `store`); the server logs their names.

Field meanings follow OpenAI's API reference (`/v1/completions`, `/v1/chat/completions`)
and, for the extras (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`,
`stop_token_ids`, ...), vLLM's `SamplingParams`. `to_sampling_params` maps a request onto
`SamplingParams` as vLLM's server does.
"""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from pagedjax.errors import InvalidInputError
from pagedjax.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from pagedjax.server.constraints import check_tools, find_tool, request_constraint
from pagedjax.server.protocol_base import OpenAIBaseModel
from pagedjax.server.protocol_tools import (
    ChatCompletionTool,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsRequest,
    ToolCallIn,
    ToolChoice,
)

MAX_N = 128  # OpenAI's limit on choices per request
_INT64 = (-(2**63), 2**63 - 1)
_INT32_MAX = 2**31 - 1
_NO_DEFAULTS: Mapping[str, Any] = types.MappingProxyType({})  # no generation-config defaults


# --------------------------------------------------------------------------- requests


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


NonNegInt = Annotated[int, Field(ge=0, le=_INT64[1])]
TokenIds = Annotated[list[NonNegInt], Field(max_length=1_000_000)]


# vLLM's older names of the structured_outputs keys (extra body fields before 0.11).
LEGACY_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
    "guided_whitespace_pattern": "whitespace_pattern",
}


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="Served model name (default: the only one).")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, description="Token id (as a string) -> bias added to its logit, in [-100, 100]."
    )
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=_INT64[0], le=_INT64[1])
    stop: str | Annotated[list[str], Field(max_length=64)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, description="Default 1.0; 0 is greedy.")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None
    # vLLM's extra sampling fields
    top_k: int | None = Field(None, ge=-1, le=_INT32_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_INT64[1])
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=_INT64[1])
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    priority: int = Field(0, ge=_INT64[0], le=_INT64[1])
    cache_salt: str | None = None
    # constrained output: OpenAI's response_format, vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @model_validator(mode="before")
    @classmethod
    def _legacy_guided_fields(cls, data: Any) -> Any:
        """vLLM's older extra fields `guided_json`, `guided_regex`, `guided_choice`,
        `guided_grammar` and `guided_whitespace_pattern` (replaced by `structured_outputs`)
        are read as the `structured_outputs` they stand for; with `structured_outputs` too,
        a 400."""
        if not isinstance(data, dict) or not any(k in data for k in LEGACY_GUIDED_FIELDS):
            return data
        if data.get("structured_outputs") is not None:
            raise ValueError("give structured_outputs or the older guided_* fields, not both")
        data = dict(data)
        legacy = {
            LEGACY_GUIDED_FIELDS[k]: data.pop(k) for k in list(data) if k in LEGACY_GUIDED_FIELDS
        }
        data["structured_outputs"] = {k: v for k, v in legacy.items() if v is not None} or None
        return data

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output constraint and the field it came from (see
        `constraints.request_constraint`)."""
        return request_constraint(self.response_format, self.structured_outputs)

    def base_sampling_kwargs(self, defaults: Mapping[str, Any]) -> dict[str, Any]:
        """The SamplingParams fields common to both endpoints (see `to_sampling_params`)."""

        def pick(name: str, fallback: float) -> Any:
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, fallback)

        return dict(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty", 1.0),
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            bad_words=self.bad_words,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=self.constraint()[0],
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if token < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {key!r}")
        out[token] = value
    return out


MAX_PROMPTS = 2048  # OpenAI's limit on prompts per completions request
PromptInput = (
    str
    | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
    | TokenIds
    | Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS)]
)


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`."""

    prompt: PromptInput = Field(
        description="A string, a list of strings, token ids, or a list of token-id lists."
    )
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=_INT64[1], description="<= max_logprobs")
    max_tokens: int | None = Field(16, ge=1, le=_INT64[1])
    suffix: str | None = None
    # vLLM extras
    prompt_logprobs: int | None = Field(None, ge=0, le=_INT64[1])
    add_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False

    def to_sampling_params(self, defaults: Mapping[str, Any] = _NO_DEFAULTS) -> SamplingParams:
        """The request's SamplingParams. A field the request leaves unset (null; max_tokens
        only when given as null) takes its value from `defaults` (the generation config's,
        `ModelConfig.default_sampling_fields`), else pagedjax's default; max_tokens None
        lets the engine allow all the room max_model_len leaves.

        Raises:
            ValueError: combinations the fields' own ranges cannot express;
                InvalidInputError (param: the field) for a value SamplingParams refuses.
        """
        self.check_stream_options()
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (only best_of == n)")
        prompt_logprobs = self.prompt_logprobs
        if prompt_logprobs is None and self.echo and self.logprobs is not None:
            prompt_logprobs = self.logprobs  # echoed prompt tokens carry logprobs too
        max_tokens = self.max_tokens if self.max_tokens is not None else defaults.get("max_tokens")
        return SamplingParams(
            max_tokens=max_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=prompt_logprobs,
            **self.base_sampling_kwargs(defaults),
        )


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    """A message of the conversation; an assistant's may carry `tool_calls`, a tool's
    result names the call it answers (`tool_call_id`)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=_INT64[1], description="<= max_logprobs")
    max_tokens: int | None = Field(None, ge=1, le=_INT64[1], description="Deprecated name.")
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT64[1])
    tools: list[ChatCompletionTool] | None = Field(None, max_length=1024)
    tool_choice: ToolChoice | None = Field(
        None, description='Default: "auto" with tools, else "none".'
    )
    parallel_tool_calls: bool = True
    # vLLM extras
    prompt_logprobs: int | None = Field(None, ge=0, le=_INT64[1], description="<= max_logprobs")
    echo: bool = Field(
        False,
        description="The reply starts with the final message's content when that message is "
        "the assistant's (with continue_final_message: the text being continued).",
    )
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """`tool_choice`, or its default: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def constraint(self) -> tuple[StructuredOutputsParams | None, str | None]:
        """The output constraint (response_format, structured_outputs, or a forced tool
        call) and the field it came from."""
        return request_constraint(
            self.response_format,
            self.structured_outputs,
            self.tools,
            self.effective_tool_choice,
            self.parallel_tool_calls,
        )

    def to_sampling_params(self, defaults: Mapping[str, Any] = _NO_DEFAULTS) -> SamplingParams:
        """The request's SamplingParams; max_tokens is max_completion_tokens, else
        max_tokens, else the defaults' (None: all the room max_model_len leaves). Other
        unset fields take `defaults` as in `CompletionRequest.to_sampling_params`.

        Raises:
            ValueError: combinations the fields' own ranges cannot express;
                InvalidInputError (param: the field) for a value SamplingParams refuses.
        """
        self.check_stream_options()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidInputError("top_logprobs needs logprobs to be true", "top_logprobs")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise InvalidInputError("when tool_choice is given, tools must be set", "tool_choice")
        if self.tools:
            check_tools(self.tools)
        if isinstance(self.tool_choice, NamedToolChoice):
            find_tool(self.tools, self.tool_choice)
        if self.chat_template is not None:
            raise InvalidInputError(
                "chat_template in a request is not accepted; use --chat-template", "chat_template"
            )
        if self.add_generation_prompt and self.continue_final_message:
            raise InvalidInputError(
                "add_generation_prompt and continue_final_message are exclusive",
                "continue_final_message",
            )
        max_tokens = self.max_completion_tokens or self.max_tokens or defaults.get("max_tokens")
        return SamplingParams(
            max_tokens=max_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            prompt_logprobs=self.prompt_logprobs,
            **self.base_sampling_kwargs(defaults),
        )


class TokenizeRequest(OpenAIBaseModel):
    """`POST /tokenize`: a prompt, or chat messages (and tools) rendered through the chat
    template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatCompletionTool] | None = Field(None, max_length=1024)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIBaseModel):
    """`POST /detokenize`."""

    model: str | None = None
    tokens: TokenIds
