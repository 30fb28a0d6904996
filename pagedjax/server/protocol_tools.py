"""Pydantic models of the OpenAI API's constrained-output and tool-calling fields:
`response_format`, vLLM's extra body field `structured_outputs`, `tools`, `tool_choice`, the
`tool_calls` of assistant messages (in a request's history and in responses) and their
streamed deltas.

Field meanings follow OpenAI's API reference (chat completions: `response_format`, `tools`,
`tool_choice`, `parallel_tool_calls`) and vLLM's `StructuredOutputsParams` (`json`, `regex`,
`choice`, `grammar`, `json_object`, `whitespace_pattern`). What a request's fields become
(one `StructuredOutputsParams`) is `pagedjax.server.constraints`.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator

from pagedjax.server.protocol_base import OpenAIBaseModel as _In
from pagedjax.server.protocol_base import ResponseModel as _Out

# OpenAI's rule for function names
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


# --------------------------------------------------------------- response_format


class JsonSchemaFormat(_In):
    """`response_format.json_schema`: `schema` is the JSON schema (a JSON object) the
    output must validate against; `name`, `description` and `strict` are accepted as OpenAI
    defines them (the output always follows the schema exactly)."""

    model_config = ConfigDict(
        strict=True, extra="allow", allow_inf_nan=False, populate_by_name=True
    )

    name: str = Field("response", max_length=64)
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_In):
    """`response_format`: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" (the schema in `json_schema.schema`)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_In):
    """vLLM's extra body field `structured_outputs`: exactly one of `json` (a JSON schema,
    object or its JSON text), `regex`, `choice` (a list of strings), `grammar` (Lark, or
    GBNF/EBNF as llguidance reads it), `json_object` (true); optional `whitespace_pattern`.
    vLLM's other keys (`disable_any_whitespace`, ...) are accepted and ignored."""

    model_config = ConfigDict(
        strict=True, extra="allow", allow_inf_nan=False, populate_by_name=True
    )

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None


# ----------------------------------------------------------------------- tools


def check_function_name(v: str) -> str:
    """OpenAI's rule for function names (a field validator of `name`).

    Raises:
        ValueError: a name that is not 1 to 64 of `A-Za-z0-9_-`.
    """
    if not _FUNCTION_NAME.match(v):
        raise ValueError(f"function names are 1 to 64 letters, digits, '_' or '-', got {v[:80]!r}")
    return v


class FunctionDefinition(_In):
    """A callable function: its name (OpenAI's rule: 1-64 of `A-Za-z0-9_-`), what it does,
    and the JSON schema of its arguments (an object schema; none: no arguments)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _name = field_validator("name")(check_function_name)


class ChatCompletionTool(_In):
    """One entry of `tools`: `{"type": "function", "function": {...}}`."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_In):
    name: str


class NamedToolChoice(_In):
    """`tool_choice` naming one function: `{"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


# ------------------------------------------------------------ tool calls (history)


class FunctionCallIn(_In):
    name: str
    arguments: str = Field(description="The arguments as a JSON object's text.")


class ToolCallIn(_In):
    """A tool call of an assistant message in the conversation history."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


# ----------------------------------------------------------- tool calls (responses)


class FunctionCall(_Out):
    name: str
    arguments: str  # a JSON object's text, as the model wrote it


class ToolCall(_Out):
    """A tool call of a response's `message.tool_calls`; ids are `chatcmpl-tool-<hex>`."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(_Out):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Out):
    """One streamed fragment of a tool call: the first for an `index` carries its id, type and
    name (arguments ""), the next ones only argument text; concatenated, the fragments
    give the call's `arguments`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall
