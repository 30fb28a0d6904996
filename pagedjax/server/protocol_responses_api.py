"""Pydantic model of a request to OpenAI's Responses API (`POST /v1/responses`) and its
translation into the chat completion request that serves it (`ResponsesRequest.to_chat`).

Field meanings follow OpenAI's API reference (Responses: `input`, `instructions`,
`max_output_tokens`, `text.format`, `tools`, `tool_choice`, `top_logprobs`, `include`) and,
for the extras (`top_k`, `min_p`, `repetition_penalty`, `seed`, `stop`, `priority`,
`cache_salt`), vLLM's `SamplingParams`, as in vLLM's own `/v1/responses`.

`input` is a string (one user message) or a list of items: messages (`role` and `content`, a
string or `input_text` / `output_text` parts; the `type` "message" may be left out),
`function_call` items (the model's earlier calls, rendered as one assistant message's
`tool_calls`) and `function_call_output` items (rendered as `tool` messages). `instructions`
becomes a leading system message. Earlier `reasoning` items (an earlier response's output
sent back) are accepted and dropped, as chat templates drop earlier thinking. Content parts
that are not text (`input_image`, ...) are refused. Nothing is stored: `store` is accepted
and reported false, and `previous_response_id`, `conversation` and `background` are refused
with a 400. vLLM's sampling extras of the chat endpoint that this model does not declare
(`structured_outputs`, `logit_bias`, `min_tokens`, `ignore_eos`, `stop_token_ids`, ...) are
passed to the chat request as they are (`CHAT_EXTRAS`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator

from pagedjax.server.protocol import (
    LEGACY_GUIDED_FIELDS,
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    SamplingRequest,
)
from pagedjax.server.protocol_base import OpenAIBaseModel
from pagedjax.server.protocol_tools import (
    ChatCompletionTool,
    FunctionCallIn,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolCallIn,
    check_function_name,
)

_INT64_MAX = 2**63 - 1
# `include` values that change what comes back: the output text's token logprobs
OUTPUT_LOGPROBS = "message.output_text.logprobs"
# OpenAI's `include` values; the others name outputs of tools this server does not run
Includable = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
]
# unknown fields of a Responses request that go to the chat request as they are: vLLM's
# sampling extras (`SamplingRequest`) that the Responses model does not declare, and
# vLLM's older names of `structured_outputs`
CHAT_EXTRAS = (
    frozenset(SamplingRequest.model_fields)
    - {"model", "n", "stream", "stream_options", "response_format", "user"}
) | frozenset(LEGACY_GUIDED_FIELDS)


_TEXT_PARTS = ("input_text", "output_text", "text")


class InputText(OpenAIBaseModel):
    """A text part of a message: `input_text` (user, system), `output_text` (an earlier
    assistant reply, as the Responses API returns it) or `text`."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class FunctionCallItem(OpenAIBaseModel):
    """An earlier call of the model: `call_id` pairs it with its `function_call_output`."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(OpenAIBaseModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class ReasoningItem(OpenAIBaseModel):
    """An earlier reply's reasoning: accepted and not rendered."""

    type: Literal["reasoning"]


def _item_kind(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "")
    return kind if kind in ("function_call", "function_call_output", "reasoning") else "message"


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


class FunctionTool(OpenAIBaseModel):
    """A function tool, in the Responses API's flat shape (no `function` wrapper)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _name = field_validator("name")(check_function_name)


class FunctionToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBaseModel):
    """`text.format`: "text", "json_object", or "json_schema" with the schema inline
    (`name`, `schema`, `description`, `strict`; not under a `json_schema` key as in chat)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenAIBaseModel):
    format: TextFormat = Field(default_factory=TextFormat)


class ResponsesRequest(OpenAIBaseModel):
    """A `/v1/responses` request (see the module docstring)."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=_INT64_MAX)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[Includable] | None = None
    tools: list[FunctionTool] = Field(default_factory=list, max_length=1024)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = Field(default_factory=TextConfig)
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None  # refused: nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    # vLLM's extras; its sampling extras (`top_k`, `seed`, `stop`, ...) are read from the
    # unknown fields and validated by the chat request (`chat_extras`)
    request_id: str | None = Field(None, description="The response's id (default: random).")
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        """A part that is not text (`input_image`, `input_file`, `input_audio`) is refused
        by name, not as a mismatch of every item shape."""
        for item in value if isinstance(value, list) else ():
            if not isinstance(item, dict) or item.get("type") == "reasoning":
                continue  # (dropped: its reasoning_text parts are not rendered)
            parts = item.get("content", item.get("output"))
            for part in parts if isinstance(parts, list) else ():
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind not in _TEXT_PARTS:
                    raise ValueError(
                        f"content parts of type {kind!r} are not supported: this server "
                        f"serves text-only models (parts: {', '.join(_TEXT_PARTS)})"
                    )
        return value

    def chat_extras(self) -> dict[str, Any]:
        """The unknown fields that the chat request takes as they are (`CHAT_EXTRAS`:
        `structured_outputs`, `logit_bias`, `min_tokens`, `ignore_eos`, ...)."""
        return {k: v for k, v in (self.model_extra or {}).items() if k in CHAT_EXTRAS}

    @property
    def wants_logprobs(self) -> bool:
        """Token logprobs of the output text: asked for by `include` or `top_logprobs`."""
        return OUTPUT_LOGPROBS in (self.include or []) or bool(self.top_logprobs)

    def messages(self) -> list[ChatMessage]:
        """The conversation as chat messages (see the module docstring).

        Raises:
            ValueError: an empty `input` list, or one with nothing to render.
        """
        out = []
        if self.instructions is not None:
            out.append(ChatMessage(role="system", content=self.instructions))
        items = (
            [InputMessage(role="user", content=self.input)]
            if isinstance(self.input, str)
            else self.input
        )
        for item in items:
            if isinstance(item, InputMessage):
                out.append(ChatMessage(role=item.role, content=_text(item.content)))
            elif isinstance(item, FunctionCallItem):
                call = ToolCallIn(
                    id=item.call_id,
                    function=FunctionCallIn(name=item.name, arguments=item.arguments),
                )
                last = out[-1] if out else None
                if last is not None and last.role == "assistant" and last.tool_calls is not None:
                    last.tool_calls.append(call)
                else:
                    out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            elif isinstance(item, FunctionCallOutputItem):
                out.append(
                    ChatMessage(role="tool", tool_call_id=item.call_id, content=_text(item.output))
                )
        if not any(m.role != "system" for m in out):
            raise ValueError("input holds no message to answer")
        return out

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completion request that serves this one (streamed with usage).

        Raises:
            ValueError: see `messages`.
        """
        fmt = self.text.format
        response_format = None
        if fmt.type == "json_schema":
            schema = JsonSchemaFormat.model_validate(
                {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
            )
            response_format = ResponseFormat(type="json_schema", json_schema=schema)
        elif fmt.type == "json_object":
            response_format = ResponseFormat(type="json_object")
        tools = [
            ChatCompletionTool(
                function=FunctionDefinition(
                    name=t.name,
                    description=t.description,
                    parameters=t.parameters,
                    strict=t.strict,
                )
            )
            for t in self.tools
        ]
        choice = self.tool_choice
        if isinstance(choice, FunctionToolChoice):
            choice = NamedToolChoice(function=NamedFunction(name=choice.name))
        fields: dict[str, Any] = dict(
            model=self.model,
            messages=self.messages(),
            max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            logprobs=self.wants_logprobs,
            top_logprobs=self.top_logprobs if self.wants_logprobs else None,
            tools=tools or None,
            tool_choice=choice if tools or choice not in ("auto", "none") else None,
            parallel_tool_calls=self.parallel_tool_calls,
            response_format=response_format,
            stream=self.stream,
            chat_template_kwargs=self.chat_template_kwargs,
        )
        fields.update(self.chat_extras())
        if self.stream:
            fields["stream_options"] = {"include_usage": True}
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}
        )


def _text(content: str | list[InputText]) -> str | list[ContentPart]:
    if isinstance(content, str):
        return content
    return [ContentPart(type="text", text=p.text) for p in content]
