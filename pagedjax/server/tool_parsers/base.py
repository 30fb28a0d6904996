"""The tool-parser interface, the parsers of forced calls (`tool_choice` "required" or a named
function), and `ToolCallStreamer`, which turns successive parses of a growing output into
OpenAI's streamed deltas.

A parser reads a whole output text (`parse(text, final)`) into the ordinary content and the
tool calls it holds, each as far as the text goes. While the output streams (`final`
False), `content` leaves out a tail that may still become a tool-call marker, and calls'
arguments only grow; so the streamer, diffing each parse against what it has sent, sends
content fragments, then for each call one delta with its index, id, type and name, then
argument fragments. The same parse of the finished text gives the non-streamed response, so
the fragments concatenate to it exactly. The calls of `tool_choice="required"` are sent
whole, each when its object closes, so that a reply cut off by the length limit streams
exactly the complete calls its non-streamed response keeps.
"""

from __future__ import annotations

import dataclasses
import uuid

from pagedjax.server.protocol_tools import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedjax.server.tool_parsers.json_scan import (
    JSONScanError,
    PartialCall,
    scan_call,
    skip_ws,
    value_end,
)


@dataclasses.dataclass
class ParsedOutput:
    """What a parser read: `content` (ordinary text, "" if none), the calls in order, and
    `malformed` when the text cannot be the tool-call format the parser expects there."""

    content: str
    calls: list[PartialCall]
    malformed: bool = False


class ToolParser:
    """Reads tool calls out of a model's output (see the module docstring)."""

    name = "base"
    # the output is forced by a constraint (tool_choice "required" or a named function), so
    # an output cut off by the length limit is a prefix of the forced JSON
    forced = False
    # a stream sends each call only once its JSON object has closed (header and whole
    # arguments in one update), and a final text with no call as content: what the stream
    # sent is then what `extract` reads from the same text even when it was cut
    stream_whole_calls = False

    def parse(self, text: str, final: bool) -> ParsedOutput:
        raise NotImplementedError

    def extract(self, text: str, cut: bool = False) -> tuple[str | None, list[ToolCall]]:
        """The finished output as (content or None, tool calls). An output whose calls do not
        all parse (malformed JSON, a missing name, arguments that are not an object) is
        all content, with no calls.

        Args:
            text: the whole output.
            cut: the output was cut off by the length limit (finish_reason "length"). A forced
                parser then drops the unfinished last call and returns the complete ones
                before it (each with its whole arguments object): a stream of the same output
                has already sent those calls in full, and OpenAI's "length" says only that
                the reply was cut, so the two agree. With no complete call, or for an
                unforced parser, the output is read as when not cut.
        """
        parsed = self.parse(text, final=True)
        found = parsed.calls
        if cut and self.forced and found and not found[-1].complete:
            found = found[:-1]  # parse stops at the first unfinished call: only the last
        if parsed.malformed or not found or not all(c.valid() for c in found):
            return (text or None), []
        calls = [
            ToolCall(id=tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
            for c in found
        ]
        return (parsed.content or None), calls


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def held_back(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker` (text that
    may still become the marker, so a stream does not send it yet)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class RequiredToolParser(ToolParser):
    """`tool_choice="required"`: the output is the JSON array the constraint forces,
    `[{"name": ..., "parameters": {...}}, ...]`; no content."""

    name = "required"
    forced = True
    stream_whole_calls = True  # a cut reply keeps only its complete calls (`extract`)

    def parse(self, text: str, final: bool) -> ParsedOutput:
        calls: list[PartialCall] = []
        i = skip_ws(text, 0)
        if i >= len(text):
            return ParsedOutput("", calls)
        if text[i] != "[":
            return ParsedOutput("", calls, malformed=True)
        i += 1
        try:
            while True:
                i = skip_ws(text, i)
                if i >= len(text) or text[i] == "]":
                    return ParsedOutput("", calls)
                if calls and text[i] == ",":
                    i += 1
                call = scan_call(text, i, ("parameters", "arguments"))
                if call.name is not None or call.complete or call.arguments:
                    calls.append(call)
                if not call.complete:
                    return ParsedOutput("", calls)
                i = call.end
        except JSONScanError:
            return ParsedOutput("", calls, malformed=True)


class NamedToolParser(ToolParser):
    """A named `tool_choice`: the whole output is that function's arguments object."""

    name = "named"
    forced = True

    def __init__(self, function_name: str):
        self.function_name = function_name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        call = PartialCall(name=self.function_name, has_arguments=True)
        try:
            end = value_end(text, i) if i < len(text) else None
        except JSONScanError:
            return ParsedOutput("", [call], malformed=True)
        call.arguments = text[i:end] if end is not None else text[i:]
        call.complete, call.end = end is not None, end or 0
        return ParsedOutput("", [call])


class ToolCallStreamer:
    """Per choice of a streamed response: each call of `update` with the output so far
    returns the deltas to send (content fragments, then per call a header and argument
    fragments); `tools_called` says whether any call was sent."""

    def __init__(self, parser: ToolParser):
        self.parser = parser
        self.sent_content = 0
        self.sent_args: list[int] = []  # per call sent: how much of its arguments
        self.malformed = False

    @property
    def tools_called(self) -> bool:
        return bool(self.sent_args)

    def update(self, text: str, final: bool) -> list[tuple[str | None, DeltaToolCall | None]]:
        """The deltas for the output text so far, as (content, tool call) pairs (one of
        the two None)."""
        parsed = self.parser.parse(text, final)
        out: list[tuple[str | None, DeltaToolCall | None]] = []
        if parsed.malformed and not self.tools_called:
            # not the tool-call format after all: everything is content
            parsed = ParsedOutput(text if final else parsed.content, [])
            self.malformed = True
        if len(parsed.content) > self.sent_content:
            out.append((parsed.content[self.sent_content :], None))
            self.sent_content = len(parsed.content)
        whole = self.parser.stream_whole_calls
        for index, call in enumerate(parsed.calls):
            if call.name is None or (whole and not call.complete):
                break  # a call is announced only with its name (or whole), and in order
            if index == len(self.sent_args):
                header = DeltaToolCall(
                    index=index,
                    id=tool_call_id(),
                    type="function",
                    function=DeltaFunctionCall(name=call.name, arguments=""),
                )
                out.append((None, header))
                self.sent_args.append(0)
            fragment = call.arguments[self.sent_args[index] :]
            if fragment:
                delta = DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment))
                out.append((None, delta))
                self.sent_args[index] = len(call.arguments)
        if whole and final and not self.tools_called and len(text) > self.sent_content:
            out.append((text[self.sent_content :], None))  # no call completed: content
            self.sent_content = len(text)
        return out
