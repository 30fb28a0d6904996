"""The chat endpoint's messages and tools as the dicts chat templates read, rendered to
prompt token ids by `pagedjax.chat_template.render_conversation` (shared with `LLM.chat`).

Text content parts are joined; content this server does not take (images, audio) is a 400
naming `messages`, as is anything the template cannot render.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedjax.chat_template import render_conversation
from pagedjax.errors import InvalidInputError
from pagedjax.server.protocol import ChatMessage
from pagedjax.server.serving_errors import bad_request


def render_chat(
    tokenizer: Any,
    chat_template: str | None,
    messages: Sequence[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    tools: Sequence[Any] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    encode: Callable[[str], list[int]] | None = None,
    content_format: str = "auto",
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
        template_kwargs: extra template variables (`chat_template_kwargs`).
        encode: the rendered text's token ids (see `render_conversation`); None: the
            tokenizer's own.
        content_format: "auto", "string" or "openai" (`--chat-template-content-format`,
            see `render_conversation`).

    Returns:
        The prompt's token ids.

    Raises:
        APIError 400: no template, a message the template cannot render, non-text content,
            tool-call arguments that are not JSON, add_generation_prompt with
            continue_final_message, continue_final_message without a final assistant
            message; what `encode` raises passes through.
    """
    conversation = [message_dict(m, i) for i, m in enumerate(messages)]
    try:
        return render_conversation(
            tokenizer,
            conversation,
            chat_template=chat_template,
            tools=[tool_dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=template_kwargs,
            encode=encode,
            content_format=content_format,
        )
    except InvalidInputError as e:
        raise bad_request(str(e), e.param) from e


def tool_dict(tool: Any) -> dict[str, Any]:
    """A tool as chat templates read it: `{"type": "function", "function": {...}}`."""
    if isinstance(tool, dict):
        return tool
    return tool.model_dump(exclude_none=True, by_alias=True)


def message_dict(m: ChatMessage, i: int) -> dict[str, Any]:
    """Message i as chat templates read it: text parts joined, an assistant's `tool_calls`
    (their arguments still the JSON strings the API carries: `render_conversation` parses
    them), a tool message's `tool_call_id`.

    Raises:
        APIError 400: non-text content parts.
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
        for call in m.tool_calls:
            entry = {
                "type": "function",
                "function": {"name": call.function.name, "arguments": call.function.arguments},
            }
            if call.id is not None:
                entry["id"] = call.id
            calls.append(entry)
        out["tool_calls"] = calls
    return out
