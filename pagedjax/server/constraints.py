"""What a request's fields ask to constrain, as one `StructuredOutputsParams`: the OpenAI
field `response_format`, vLLM's extra body field `structured_outputs`, and `tool_choice`
"required" or a named function (whose JSON schema is built from the tools' parameter
schemas, as vLLM builds it).

A request sets at most one of them; each is checked here (a JSON schema must be a JSON
object, a tool's parameters an object schema, a named function one of the tools) and
refused with an `InvalidInputError` whose `param` is the field. Whether a schema, regex or
grammar compiles is the engine's check when the request is added; the handlers rename its
`param` ("structured_outputs") to the field the constraint came from (`source`).
"""

from __future__ import annotations

import copy
import json
from typing import Any

from pagedjax.errors import InvalidInputError
from pagedjax.sampling_params import StructuredOutputsParams
from pagedjax.server.protocol_tools import (
    ChatCompletionTool,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsRequest,
)

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def request_constraint(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputsRequest | None,
    tools: list[ChatCompletionTool] | None = None,
    tool_choice: str | NamedToolChoice | None = None,
    parallel_tool_calls: bool = True,
) -> tuple[StructuredOutputsParams | None, str | None]:
    """The constraint a request asks for, and the field it came from.

    Returns:
        (params, source): params None when the output is free; source is "response_format",
        "structured_outputs" or "tool_choice" (None with no constraint).

    Raises:
        InvalidInputError: more than one field constrains the output (param: the second),
            a `json_schema` without a schema object, a `structured_outputs` that sets no kind
            or several, a named function that is not in `tools` (param "tool_choice").
    """
    found: list[tuple[StructuredOutputsParams, str]] = []
    if response_format is not None and response_format.type != "text":
        found.append((_from_response_format(response_format), "response_format"))
    if structured_outputs is not None:
        found.append((_from_structured_outputs(structured_outputs), "structured_outputs"))
    if tools and (tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)):
        schema = tool_choice_schema(tools, tool_choice, parallel_tool_calls)
        found.append((StructuredOutputsParams(json=schema), "tool_choice"))
    if len(found) > 1:
        first, second = found[0][1], found[1][1]
        raise InvalidInputError(
            f"{first} and {second} both constrain the output; give only one of them", second
        )
    return found[0] if found else (None, None)


def _from_response_format(rf: ResponseFormat) -> StructuredOutputsParams:
    if rf.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if rf.json_schema is None or rf.json_schema.json_schema is None:
        raise InvalidInputError(
            'response_format of type "json_schema" needs json_schema.schema (a JSON schema object)',
            "response_format",
        )
    return StructuredOutputsParams(json=rf.json_schema.json_schema)


def _from_structured_outputs(so: StructuredOutputsRequest) -> StructuredOutputsParams:
    json_schema = so.json_
    if isinstance(json_schema, str):
        try:
            json_schema = json.loads(json_schema)
        except json.JSONDecodeError as e:
            raise InvalidInputError(
                f"structured_outputs.json is not valid JSON: {e}", "structured_outputs"
            ) from e
    if json_schema is not None and not isinstance(json_schema, dict | bool):
        raise InvalidInputError(
            "structured_outputs.json must be a JSON schema (an object)", "structured_outputs"
        )
    return StructuredOutputsParams(
        json=json_schema,
        regex=so.regex,
        choice=so.choice,
        grammar=so.grammar,
        json_object=so.json_object or None,
        whitespace_pattern=so.whitespace_pattern,
    )


def find_tool(
    tools: list[ChatCompletionTool] | None, choice: NamedToolChoice
) -> ChatCompletionTool:
    """The tool a named `tool_choice` names; InvalidInputError (param "tool_choice") if none."""
    for tool in tools or []:
        if tool.function.name == choice.function.name:
            return tool
    names = ", ".join(repr(t.function.name) for t in tools or []) or "none"
    raise InvalidInputError(
        f"tool_choice names the function {choice.function.name!r}, which is not in tools "
        f"(tools: {names})",
        "tool_choice",
    )


def check_tools(tools: list[ChatCompletionTool]) -> None:
    """Raises InvalidInputError (param "tools") for duplicate function names or parameters
    that are not an object schema."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if fn.name in seen:
            raise InvalidInputError(f"tools[{i}]: the function name {fn.name!r} repeats", "tools")
        seen.add(fn.name)
        params = fn.parameters
        if params is not None and params.get("type", "object") != "object":
            raise InvalidInputError(
                f"tools[{i}].function.parameters must be a JSON schema of type 'object', "
                f"got type {params.get('type')!r}",
                "tools",
            )


def tool_choice_schema(
    tools: list[ChatCompletionTool],
    tool_choice: str | NamedToolChoice,
    parallel_tool_calls: bool = True,
) -> dict[str, Any]:
    """The JSON schema that forces a tool call, as vLLM builds it.

    - a named function: that function's parameters (the output is its arguments object);
    - "required": an array of at least one (exactly one without `parallel_tool_calls`) of
      `{"name": <a tool's name>, "parameters": <that tool's parameters>}`, one `anyOf`
      alternative per tool.

    Each tool's `$defs` (or `definitions`) are moved to the root, where its `$ref`s
    ("#/$defs/X") then point; two tools defining one name differently are refused
    (InvalidInputError, param "tools").
    """
    if isinstance(tool_choice, NamedToolChoice):
        return copy.deepcopy(find_tool(tools, tool_choice).function.parameters or _EMPTY_PARAMETERS)
    defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    alternatives = []
    for tool in tools:
        params = copy.deepcopy(tool.function.parameters or _EMPTY_PARAMETERS)
        for key in ("$defs", "definitions"):
            for name, definition in (params.pop(key, None) or {}).items():
                if defs[key].setdefault(name, definition) != definition:
                    raise InvalidInputError(
                        f"tools define {key}/{name} differently; give the definitions "
                        "distinct names",
                        "tools",
                    )
        alternatives.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    items: dict[str, Any] = {"anyOf": alternatives} if len(alternatives) > 1 else alternatives[0]
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    schema.update({key: d for key, d in defs.items() if d})
    return schema
