"""Scanning a JSON text that may still be growing (a model's output while it streams):
where a value ends (or that it has not ended yet), and the `{"name": ..., "arguments": ...}`
object of one tool call, read as far as the text goes.

A call's `arguments` is the raw text of its value, as the model wrote it: while the value is
incomplete, every character seen so far belongs to it, so the text only grows from one
output to the next, and the fragments a stream sends concatenate to the final value.
Syntax is checked only as far as needed to find where values end; a finished call's name and
arguments are then checked with `json.loads` (`PartialCall.valid`).
"""

from __future__ import annotations

import dataclasses
import json

_WS = " \t\n\r"
_SCALAR_END = _WS + ",}]"


class JSONScanError(ValueError):
    """The text cannot be the start of the JSON expected there."""


@dataclasses.dataclass
class PartialCall:
    """One tool call as far as the text goes.

    Attributes:
        name: the function name once its string is complete, else None.
        arguments: the raw JSON text of the arguments value so far ("" before it starts).
        complete: the call's object (and so its arguments) is closed.
        end: index in the text just past the call's object (when complete).
        has_arguments: the object has an arguments key (a complete call without one has
            arguments "{}").
    """

    name: str | None = None
    arguments: str = ""
    complete: bool = False
    end: int = 0
    has_arguments: bool = False

    def valid(self) -> bool:
        """A complete call with a name and arguments that parse as a JSON object."""
        if not self.complete or self.name is None:
            return False
        try:
            return isinstance(json.loads(self.arguments), dict)
        except json.JSONDecodeError:
            return False


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def string_end(text: str, i: int) -> int | None:
    """Index past the JSON string starting at text[i] ('"'), or None if it has not ended."""
    i += 1
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == '"':
            return i + 1
        i += 1
    return None


def value_end(text: str, i: int) -> int | None:
    """Index past the JSON value starting at text[i] (no leading whitespace), or None if
    the text ends first (a number or literal at the very end counts as unfinished).

    Raises:
        JSONScanError: brackets that do not match.
    """
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        return string_end(text, i)
    if c in "{[":
        stack = [c]
        i += 1
        while i < len(text):
            c = text[i]
            if c == '"':
                end = string_end(text, i)
                if end is None:
                    return None
                i = end
                continue
            if c in "{[":
                stack.append(c)
            elif c in "}]":
                if "{[}]"["{[".index(stack.pop()) + 2] != c:
                    raise JSONScanError(f"{c!r} closes a bracket it does not match")
                if not stack:
                    return i + 1
            i += 1
        return None
    if c in "}],:":
        raise JSONScanError(f"a value was expected, got {c!r}")
    while i < len(text) and text[i] not in _SCALAR_END:
        i += 1
    return i if i < len(text) else None


def scan_call(text: str, start: int, arg_keys: tuple[str, ...]) -> PartialCall:
    """Reads the tool-call object that starts at text[start] (after optional whitespace):
    its "name" and its arguments (the value of the first key of `arg_keys` present).

    Raises:
        JSONScanError: the text there is not (the start of) such an object.
    """
    call = PartialCall()
    i = skip_ws(text, start)
    if i >= len(text):
        return call
    if text[i] != "{":
        raise JSONScanError(f"a tool call object was expected, got {text[i]!r}")
    i += 1
    while True:
        i = skip_ws(text, i)
        if i >= len(text):
            return call
        if text[i] == "}":
            call.complete, call.end = True, i + 1
            if not call.has_arguments:
                call.arguments = "{}"
            return call
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            if i >= len(text):
                return call
        if text[i] != '"':
            raise JSONScanError(f"a key was expected, got {text[i]!r}")
        key_end = string_end(text, i)
        if key_end is None:
            return call
        key = json.loads(text[i:key_end])
        i = skip_ws(text, key_end)
        if i >= len(text):
            return call
        if text[i] != ":":
            raise JSONScanError(f"':' was expected after a key, got {text[i]!r}")
        i = skip_ws(text, i + 1)
        end = value_end(text, i)
        if key in arg_keys and not call.has_arguments:
            call.has_arguments = True
            call.arguments = text[i:end] if end is not None else text[i:]
        elif key == "name" and end is not None and text[i] == '"':
            call.name = json.loads(text[i:end])
        if end is None:
            return call
        i = end
