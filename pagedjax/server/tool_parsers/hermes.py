"""The `hermes` tool parser: calls written as `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` (the format of Hermes 2 Pro, Qwen2.5 and Qwen3 chat templates), any number of
them; the text before the first call is the message's content, text after a call is
dropped (as vLLM does)."""

from __future__ import annotations

from pagedjax.server.tool_parsers.base import ParsedOutput, ToolParser, held_back
from pagedjax.server.tool_parsers.json_scan import JSONScanError, scan_call

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = text.find(START)
        if i < 0:
            content = text if final else text[: len(text) - held_back(text, START)]
            return ParsedOutput(content, [])
        content, calls = text[:i], []
        while i >= 0:
            try:
                call = scan_call(text, i + len(START), ("arguments", "parameters"))
            except JSONScanError:
                return ParsedOutput(content, calls, malformed=True)
            calls.append(call)
            if not call.complete:
                break
            end = text.find(END, call.end)
            if end < 0:
                break  # the closing tag has not come (a finished output may omit it)
            i = text.find(START, end + len(END))
        return ParsedOutput(content, calls)
