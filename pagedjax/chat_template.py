"""A conversation to prompt token ids through a Jinja chat template (Hugging Face's
`apply_chat_template`), for `LLM.chat` and the server's chat endpoint alike.

Messages are OpenAI-style dicts. Content may be a string or a list of text parts (joined by
newlines, as vLLM's "string" content format does). An assistant message's `tool_calls` may carry
`function.arguments` as the JSON string the OpenAI API uses: it is parsed into an object
first, since Hugging Face templates read the arguments as a mapping (as vLLM does before
rendering). Tools are passed as the template's `tools` variable, extra variables
(`chat_template_kwargs`) as keyword arguments, minus those this module sets itself.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pagedjax.errors import InvalidInputError

# Keyword arguments of `apply_chat_template` set here: `chat_template_kwargs` cannot
# override them.
RESERVED_KWARGS = ("tokenize", "return_dict", "chat_template", "conversation")
# Keyword arguments of `apply_chat_template` that change how it tokenizes: given in
# `chat_template_kwargs`, the template's own tokenization is used, not the caller's `encode`.
TOKENIZATION_KWARGS = (
    "sanitize_control_tokens",
    "tokenizer_kwargs",
    "truncation",
    "max_length",
    "padding",
)


def render_conversation(
    tokenizer: Any,
    conversation: Sequence[Mapping[str, Any]],
    *,
    chat_template: str | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    encode: Callable[[str], list[int]] | None = None,
    content_format: str = "auto",
) -> list[int]:
    """Token ids of one conversation rendered through a chat template.

    Args:
        tokenizer: a Hugging Face tokenizer (its `apply_chat_template`).
        conversation: messages, each a dict with "role" and "content" (and optionally
            "name", "tool_calls", "tool_call_id"); not modified.
        chat_template: a Jinja template to use instead of the tokenizer's, or None.
        tools: tool definitions (`{"type": "function", "function": {...}}`) for the
            template's `tools` variable; None or empty: none.
        add_generation_prompt: end with the template's assistant header.
        continue_final_message: leave the final assistant message open for the model to
            continue (it must exist); exclusive with add_generation_prompt.
        chat_template_kwargs: extra template variables.
        encode: the rendered text's token ids (special tokens not added, as
            `apply_chat_template` tokenizes), for a caller that refuses an over-long prompt
            before its ids exist (the server); None: the template's tokenizer. Not used when
            `chat_template_kwargs` sets one of `TOKENIZATION_KWARGS` (e.g.
            `sanitize_control_tokens`), which only the template's own tokenization applies.
        content_format: how messages' content reaches the template (vLLM's
            `chat_template_content_format`): "string" (text parts joined by newlines),
            "openai" (a list of `{"type": "text", "text": ...}` parts, a string content
            too), or "auto": "openai" for a template that loops over a message's content
            (`content_format_of`), else "string".

    Returns:
        The prompt's token ids.

    Raises:
        InvalidInputError: no template (param None); add_generation_prompt together with
            continue_final_message, continue_final_message without a final assistant
            message, tool-call arguments that are not JSON, or a conversation the template
            cannot render (param "messages"). What `encode` raises passes through.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidInputError(
            "the model has no chat template; give one (chat_template, or the server's "
            "--chat-template)"
        )
    if add_generation_prompt and continue_final_message:
        raise InvalidInputError(
            "add_generation_prompt and continue_final_message are exclusive",
            "continue_final_message",
        )
    if not conversation:
        raise InvalidInputError("messages must not be empty", "messages")
    if continue_final_message and conversation[-1].get("role") != "assistant":
        raise InvalidInputError(
            "continue_final_message needs a final assistant message", "messages"
        )
    if content_format not in CONTENT_FORMATS:
        raise InvalidInputError(
            f"chat_template_content_format must be one of {CONTENT_FORMATS}, got "
            f"{content_format!r}",
            "chat_template_content_format",
        )
    if content_format == "auto":
        content_format = content_format_of(
            chat_template if chat_template is not None else tokenizer
        )
    parts = content_format == "openai"
    messages = [_template_message(m, i, parts) for i, m in enumerate(conversation)]
    kwargs = {k: v for k, v in (chat_template_kwargs or {}).items() if k not in RESERVED_KWARGS}
    tokenize = encode is None or any(k in kwargs for k in TOKENIZATION_KWARGS)
    try:
        out = tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=tokenize,
            return_dict=False,
            **kwargs,
        )
    except Exception as e:  # jinja2 errors, the template's raise_exception(), ...
        raise InvalidInputError(
            f"the chat template could not render the messages: {e}", "messages"
        ) from e
    if not tokenize:
        return encode(out)
    if isinstance(out, dict) or hasattr(out, "input_ids"):
        out = out["input_ids"]
    return list(out)


def _template_message(message: Mapping[str, Any], i: int, parts: bool = False) -> Mapping[str, Any]:
    """Message i as templates read it (a copy only where something changes): content given
    as OpenAI text parts (`[{"type": "text", "text": ...}, ...]`) joined by newlines (with
    `parts`: kept as text parts, and a string content made one), each tool call's
    `function.arguments` given as a JSON string parsed into an object.

    Raises:
        InvalidInputError: a content part that is not text, arguments that are not JSON.
    """
    content = message.get("content")
    calls = message.get("tool_calls") or ()
    string_args = any(isinstance((c.get("function") or {}).get("arguments"), str) for c in calls)
    if not isinstance(content, list) and not string_args and not (parts and content is not None):
        return message
    message = copy.deepcopy(dict(message))
    if parts and isinstance(content, str):
        message["content"] = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise InvalidInputError(
                    f"messages[{i}]: only text content parts are supported, got {kind!r}",
                    "messages",
                )
            texts.append(str(part.get("text", "")))
        if parts:
            message["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            message["content"] = "\n".join(texts)
    for j, call in enumerate(message.get("tool_calls") or ()):
        fn = call.get("function") or {}
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError as e:
                raise InvalidInputError(
                    f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}",
                    "messages",
                ) from e
    return message


def template_reads_tools(template_or_tokenizer: Any) -> bool:
    """Whether a chat template (its text, or a tokenizer's `chat_template`, a dict of named
    templates included: the "tool_use" one, else the default) mentions `tools` at all; a
    template that does not renders requests without their tools."""
    source = template_or_tokenizer
    if not isinstance(source, str):
        source = getattr(source, "chat_template", None) or ""
    if isinstance(source, dict):
        source = source.get("tool_use") or source.get("default") or ""
    return "tools" in source


CONTENT_FORMATS = ("auto", "string", "openai")
# a Jinja loop over a message's content: `for part in message['content']`, `... in m.content`
_CONTENT_LOOP = re.compile(r"for\s+\w+\s+in\s+\w+(?:\.content\b|\[\s*['\"]content['\"]\s*\])")


def content_format_of(template_or_tokenizer: Any) -> str:
    """ "openai" for a chat template (its text, or a tokenizer's `chat_template`, a dict of
    named templates included) that loops over a message's content, else "string" (vLLM's
    "auto" detection, by the template's text)."""
    source = template_or_tokenizer
    if not isinstance(source, str):
        source = getattr(source, "chat_template", None) or ""
    if isinstance(source, dict):
        source = "\n".join(str(v) for v in source.values())
    return "openai" if _CONTENT_LOOP.search(source) else "string"
