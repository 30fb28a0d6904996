"""Chat messages to prompt token ids through a Jinja chat template (Hugging Face's
`apply_chat_template`), as the OpenAI chat endpoint needs them.

Messages are turned into the dicts templates read: text parts joined, an assistant's
`tool_calls` with their arguments parsed into objects, a tool message's `tool_call_id`; tools
into `{"type": "function", "function": {...}}`. Anything the template cannot render, and
content this server does not take (images, audio), is a 400 naming `messages`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pagedjax.server.protocol import ChatMessage
from pagedjax.server.serving_errors import bad_request

# Keyword arguments of `apply_chat_template` that this module sets itself: a request's
# `chat_template_kwargs` cannot override them.
_RESERVED_KWARGS = ("tokenize", "return_dict", "chat_template", "conversation")


def render_chat(
    tokenizer: Any,
    chat_template: str | None,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: Sequence[Any] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Token ids of a conversation rendered through a chat template.

    Args:
        tokenizer: a Hugging Face tokenizer (its `apply_chat_template`).
        chat_template: a Jinja template to use instead of the tokenizer's, or None.
        messages: the request's messages, in order.
        add_generation_prompt: end with the template's assistant header.
        continue_final_message: leave the final assistant message open (it must exist).
        tools: the request's tools (pydantic models or dicts), passed as the template's
            `tools`; None or empty: none.
        template_kwargs: extra template variables (`chat_template_kwargs`), minus the
            arguments this function sets.

    Returns:
        The prompt's token ids.

    Raises:
        APIError 400: no template, a message the template cannot render, non-text content,
            tool-call arguments that are not JSON, continue_final_message without a final
            assistant message.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise bad_request("the model has no chat template; start the server with --chat-template")
    conversation = [message_dict(m, i) for i, m in enumerate(messages)]
    tool_dicts = [tool_dict(t) for t in tools] if tools else None
    if continue_final_message and conversation[-1]["role"] != "assistant":
        raise bad_request("continue_final_message needs a final assistant message", "messages")
    kwargs = dict(template_kwargs or {})
    for reserved in _RESERVED_KWARGS:
        kwargs.pop(reserved, None)
    try:
        ids = tokenizer.apply_chat_template(
            conversation,
            chat_template=chat_template,
            tools=tool_dicts,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
            return_dict=False,
            **kwargs,
        )
    except Exception as e:  # jinja2 errors, the template's raise_exception(), ...
        raise bad_request(
            f"the chat template could not render the messages: {e}", "messages"
        ) from e
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


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


def tool_dict(tool: Any) -> dict[str, Any]:
    """A tool as chat templates read it: `{"type": "function", "function": {...}}`."""
    if isinstance(tool, dict):
        return tool
    return tool.model_dump(exclude_none=True, by_alias=True)


def message_dict(m: ChatMessage, i: int) -> dict[str, Any]:
    """Message i as chat templates read it: text parts joined, an assistant's `tool_calls`
    with their arguments parsed into objects (as Hugging Face templates expect), a tool
    message's `tool_call_id`.

    Raises:
        APIError 400: non-text content parts, tool-call arguments that are not JSON.
    """
    content = m.content
    if isinstance(content, list):
        parts = []
        for part in content:
            if part.type != "text" or part.text is None:
                raise bad_request(
                    f"messages[{i}]: only text content parts are supported, got {part.type!r}",
                    "messages",
                )
            parts.append(part.text)
        content = "\n".join(parts)
    out: dict[str, Any] = {"role": m.role, "content": content if content is not None else ""}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        calls = []
        for j, call in enumerate(m.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError as e:
                raise bad_request(
                    f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}",
                    "messages",
                ) from e
            entry = {
                "type": "function",
                "function": {"name": call.function.name, "arguments": arguments},
            }
            if call.id is not None:
                entry["id"] = call.id
            calls.append(entry)
        out["tool_calls"] = calls
    return out
