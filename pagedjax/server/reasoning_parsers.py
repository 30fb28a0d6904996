"""Reasoning parsers (vLLM's `--reasoning-parser`): a chat reply's thinking, written before
`</think>`, comes back as `message.reasoning` (streamed: `delta.reasoning`), the rest as
`content`, as vLLM returns them.

Both parsers read the reply as starting inside the thinking (the model, or its chat template
in the prompt, opens it with `<think>`; a `<think>` the reply starts with is dropped), which
ends at the first `</think>`; a reply that never writes `</think>` is all reasoning (cut off
while thinking). They differ in when that applies:

    deepseek_r1  every reply (DeepSeek-R1 and its distillations always think);
    qwen3        unless the request's `chat_template_kwargs` has `"enable_thinking": false`
                 (Qwen3's switch: its template then renders an empty thinking block, and the
                 reply is all content).

The tool parser reads the content only. Output constraints (`response_format`) apply to the
whole reply, thinking included (vLLM can start them after `</think>`; this server does not).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser:
    """Splits replies into reasoning and content (see the module docstring)."""

    name = "deepseek_r1"

    def thinks(self, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        """Whether a request's reply starts in its thinking."""
        return True

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole reply; None where a part is empty."""
        if text.startswith(THINK_START):
            text = text[len(THINK_START) :]
        reasoning, end, content = text.partition(THINK_END)
        if not end:
            return text or None, None
        return reasoning or None, content or None


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def thinks(self, chat_template_kwargs: Mapping[str, Any] | None) -> bool:
        return (chat_template_kwargs or {}).get("enable_thinking", True) is not False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    ReasoningParser.name: ReasoningParser,
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
}


class ReasoningStreamer:
    """One streamed choice: each text delta -> (reasoning delta, content delta), so that the
    concatenated deltas equal `ReasoningParser.extract` of the whole reply (held back meanwhile:
    text that may be the start of `<think>` at the very beginning, or of `</think>`)."""

    def __init__(self, thinking: bool):
        self.thinking = thinking
        self._start = thinking  # the reply's first characters may still be "<think>"
        self._held = ""

    def update(self, delta: str, final: bool) -> tuple[str, str]:
        if not self.thinking:
            return "", delta
        text = self._held + delta
        self._held = ""
        if self._start:
            if THINK_START.startswith(text) and not final:
                self._held = text  # not yet known whether the reply opens with "<think>"
                return "", ""
            self._start = False
            if text.startswith(THINK_START):
                text = text[len(THINK_START) :]
        i = text.find(THINK_END)
        if i >= 0:
            self.thinking = False
            return text[:i], text[i + len(THINK_END) :]
        if not final:
            keep = next(
                (k for k in range(len(THINK_END) - 1, 0, -1) if text.endswith(THINK_END[:k])), 0
            )
            if keep:
                self._held = text[-keep:]
                text = text[:-keep]
        return text, ""
