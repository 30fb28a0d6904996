"""The `llama3_json` tool parser: Llama 3.1/3.2's JSON tool calls, an output that is
`{"name": ..., "parameters": {...}}` (optionally after `<|python_tag|>`), several calls
separated by `;`. An output that does not start with `{` is plain content."""

from __future__ import annotations

from pagedjax.server.tool_parsers.base import ParsedOutput, ToolParser
from pagedjax.server.tool_parsers.json_scan import JSONScanError, scan_call, skip_ws

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif i < len(text) and PYTHON_TAG.startswith(text[i:]) and not final:
            return ParsedOutput("", [])  # may still become the tag
        if i >= len(text):
            return ParsedOutput(text if final else "", [])  # only whitespace so far
        if text[i] != "{":
            return ParsedOutput(text, [])
        calls = []
        while True:
            try:
                call = scan_call(text, i, ("parameters", "arguments"))
            except JSONScanError:
                return ParsedOutput("", calls, malformed=True)
            calls.append(call)
            if not call.complete:
                break
            j = skip_ws(text, call.end)
            if j >= len(text) or text[j] != ";":
                break
            i = skip_ws(text, j + 1)
            if i >= len(text):
                break
        return ParsedOutput("", calls)
