"""Tool parsers: read the tool calls a model wrote in its output, whole or while it streams.

`--tool-call-parser` picks one of `TOOL_PARSERS` for `tool_choice="auto"` (vLLM's names);
`tool_choice="required"` and a named function use the parsers of the JSON their constraint
forces (`RequiredToolParser`, `NamedToolParser`). `ToolCallStreamer` makes OpenAI's
streamed tool-call deltas from any of them.
"""

from __future__ import annotations

from pagedjax.server.tool_parsers.base import (
    NamedToolParser,
    ParsedOutput,
    RequiredToolParser,
    ToolCallStreamer,
    ToolParser,
)
from pagedjax.server.tool_parsers.hermes import HermesToolParser
from pagedjax.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}

__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "NamedToolParser",
    "ParsedOutput",
    "RequiredToolParser",
    "ToolCallStreamer",
    "ToolParser",
]
