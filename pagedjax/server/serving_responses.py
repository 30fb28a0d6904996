"""`/v1/responses` (OpenAI's Responses API): served by the chat completions path, its request
translated (`ResponsesRequest.to_chat`) and its reply rewritten as a `response` object, or a
stream of the Responses API's server-sent events.

A reply becomes the response's `output` items, in the order the model wrote them: a
`reasoning` item (with `--reasoning-parser`: the thinking, as `reasoning_text` content), a
`message` item (the text, as one `output_text` part) and one `function_call` item per tool
call (`call_id`, `name`, `arguments`; tools and `tool_choice` as in chat completions). When
`include` names "message.output_text.logprobs" or `top_logprobs` is set, the `output_text`
part has the logprobs of every token of the reply, those of its thinking and calls included
(the text alone cannot be told apart token by token); a stream sends them with the text
deltas as they come, and those of tokens after the text only in the final response.
A reply cut by `max_output_tokens` (or the context length) has `status` "incomplete" and
`incomplete_details.reason` "max_output_tokens". `usage.input_tokens_details.cached_tokens`
counts the prompt tokens served from the prefix cache and `cache_write_tokens` the rest (the
ones computed, which prefix caching keeps for later requests); reasoning tokens are not
counted apart (`output_tokens_details.reasoning_tokens` is 0).

A stream sends `event: <type>` / `data: <json>` pairs, each with its `sequence_number`:
`response.created`, `response.in_progress`; per item `response.output_item.added`, its
deltas (`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`, with `response.content_part.added` / `.done`
around a message's text), their `.done` events and `response.output_item.done`; then
`response.completed` with the whole response, also when its status is "incomplete" (as vLLM
ends it; OpenAI sends `response.incomplete` then). The deltas of each
item concatenate to its text in that response. An engine failure mid-stream is an `error`
event. Event shapes follow OpenAI's API reference ("Streaming events" of the Responses API).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from pagedjax.server.protocol_responses_api import ResponsesRequest
from pagedjax.server.serving_chat import OpenAIServingChat
from pagedjax.server.serving_errors import APIError, bad_request

logger = logging.getLogger(__name__)

# chat completion field -> the Responses API field it came from (for error bodies)
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "top_logprobs",
}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OpenAIServingResponses:
    """Handles `ResponsesRequest`s through `chat` (see the module docstring)."""

    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat

    async def create(self, request: ResponsesRequest):
        """Returns a JSON Response or a StreamingResponse.

        Raises:
            APIError 400: `previous_response_id` or `background` (nothing is stored), an
                input with no message, or what the chat path refuses (its `param` renamed
                to this API's field, e.g. `max_output_tokens`, `text.format`).
        """
        ignored = sorted(set(request.model_extra or {}) - set(request.chat_extras()))
        if ignored:
            names = ", ".join(repr(k[:40]) for k in ignored[:10])
            logger.warning("ignoring unknown request fields: %s", names)
        if request.conversation is not None:
            raise bad_request(
                "this server does not store conversations; send the whole conversation in input",
                "conversation",
            )
        if request.previous_response_id is not None:
            raise bad_request(
                "this server does not store responses, so previous_response_id cannot be "
                "resolved; send the whole conversation in input",
                "previous_response_id",
            )
        if request.background:
            raise bad_request(
                "background responses need a stored response, and this server stores none",
                "background",
            )
        try:
            chat_request = request.to_chat()
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            field = str(first["loc"][0])
            raise bad_request(f"{where}: {first['msg']}", _PARAMS.get(field, field)) from e
        except ValueError as e:
            raise bad_request(str(e), "input") from e
        try:
            result = await self.chat.create(chat_request, prompt_tokens_details=True)
        except APIError as e:
            raise _renamed(e) from e
        response_id = request.request_id or _id("resp")
        defaults = self.chat.default_sampling_fields
        head = _response_head(request, response_id, self.chat.model_name(request.model), defaults)
        if not request.stream:
            return JSONResponse(_response(head, json.loads(result.body)))
        return StreamingResponse(
            _events(head, result.body_iterator),
            media_type="text/event-stream",
        )


def _renamed(e: APIError) -> APIError:
    """The chat path's error in the Responses API's field names."""
    info = e.body.error
    message = info.message
    for old, new in (
        ("max_completion_tokens", "max_output_tokens"),
        ("response_format", "text.format"),
    ):
        message = message.replace(old, new)
    param = _PARAMS.get(info.param or "", info.param)
    return APIError(e.status_code, message, type=info.type, param=param, code=info.code)


def _response_head(
    request: ResponsesRequest, response_id: str, model: str, defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """The fields of the response object that echo the request (status still in progress);
    an unset temperature or top_p as the engine applies it (`defaults`: the model's
    generation config, else 1.0)."""
    fmt = request.text.format.model_dump(by_alias=True, exclude_none=True)
    choice = request.tool_choice
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "metadata": request.metadata or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls,
        "previous_response_id": None,
        "reasoning": None,
        "store": False,
        "temperature": _resolved(request.temperature, defaults, "temperature"),
        "text": {"format": fmt},
        "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
        "tools": [t.model_dump(exclude_none=True) for t in request.tools],
        "top_logprobs": request.top_logprobs or 0,
        "top_p": _resolved(request.top_p, defaults, "top_p"),
        "truncation": request.truncation,
        "usage": None,
        "user": request.user,
    }


def _resolved(value: float | None, defaults: Mapping[str, Any], name: str) -> float:
    if value is not None:
        return value
    return float(defaults.get(name, 1.0))


def _usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    written = chat_usage["prompt_tokens"] - cached  # computed now (what prefix caching keeps)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": written},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def _finished(head: dict, output: list[dict], finish_reason: str | None, usage: dict) -> dict:
    """The response once its reply has ended: status, items' status, usage."""
    cut = finish_reason == "length"
    for item in output:
        if item["type"] == "message" and cut:
            item["status"] = "incomplete"
    return {
        **head,
        "status": "incomplete" if cut else "completed",
        "completed_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output,
        "usage": _usage(usage),
    }


def _message_item(text: str, logprobs: list[dict], status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}
    return {
        "type": "message",
        "id": _id("msg"),
        "status": status,
        "role": "assistant",
        "content": [part],
    }


def _reasoning_item(text: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "content": content}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _response(head: dict, chat_body: dict) -> dict:
    """The whole response from a chat completion's body (its one choice)."""
    (choice,) = chat_body["choices"]
    message = choice["message"]
    output = []
    if message.get("reasoning"):
        output.append(_reasoning_item(message["reasoning"]))
    calls = message.get("tool_calls") or []
    if message.get("content") or not (calls or output):
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        output.append(_message_item(message.get("content") or "", logprobs))
    for c in calls:
        output.append(_call_item(c["id"], c["function"]["name"], c["function"]["arguments"]))
    return _finished(head, output, choice["finish_reason"], chat_body["usage"])


class _EventWriter:
    """The stream's events, numbered, and the output items they build."""

    def __init__(self):
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being streamed
        self.pending_logprobs: list[dict] = []  # of tokens whose text has not come yet

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def begin(self, item: dict) -> list[str]:
        out = self.close()
        self.output.append(item)
        self.open = item
        out.append(
            self.event(
                "response.output_item.added",
                output_index=len(self.output) - 1,
                item=_in_progress(item),
            )
        )
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out.append(
                self.event(
                    "response.content_part.added", **self._where(), content_index=0, part=part
                )
            )
        return out

    def text(self, kind: str, delta: str) -> list[str]:
        """A delta of the open item, or of a new one when the kind changes."""
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self.begin(_message_item("", []) if kind == "message" else _reasoning_item(""))
        part = self.open["content"][0]
        part["text"] += delta
        if kind == "reasoning":
            out.append(
                self.event(
                    "response.reasoning_text.delta", **self._where(), content_index=0, delta=delta
                )
            )
            return out
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        part["logprobs"] += logprobs
        out.append(
            self.event(
                "response.output_text.delta",
                **self._where(),
                content_index=0,
                delta=delta,
                logprobs=logprobs,
            )
        )
        return out

    def tool_call(self, delta: dict) -> list[str]:
        out = []
        function = delta.get("function") or {}
        if "id" in delta:  # a new call: its id and name come first
            out += self.begin(_call_item(delta["id"], function.get("name", ""), "", "in_progress"))
        arguments = function.get("arguments")
        if arguments and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += arguments
            out.append(
                self.event(
                    "response.function_call_arguments.delta", **self._where(), delta=arguments
                )
            )
        return out

    def close(self) -> list[str]:
        item, out = self.open, []
        if item is None:
            return out
        where = self._where()
        if item["type"] == "message":
            part = item["content"][0]
            out.append(
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=part["text"],
                    logprobs=part["logprobs"],
                )
            )
            out.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        elif item["type"] == "reasoning":
            text = item["content"][0]["text"]
            out.append(
                self.event("response.reasoning_text.done", **where, content_index=0, text=text)
            )
        else:
            item["status"] = "completed"
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(
            self.event("response.output_item.done", output_index=where["output_index"], item=item)
        )
        self.open = None
        return out


def _in_progress(item: dict) -> dict:
    """An item as `response.output_item.added` shows it: no text yet."""
    if item["type"] == "message":
        return {**item, "status": "in_progress", "content": []}
    if item["type"] == "reasoning":
        return {**item, "content": []}
    return {**item, "status": "in_progress"}


async def _events(head: dict, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """The Responses API's events from the chat path's stream of chunks (see the module
    docstring)."""
    w = _EventWriter()
    yield w.event("response.created", response=head)
    yield w.event("response.in_progress", response=head)
    finish_reason, usage = None, None
    try:
        async for raw in chunks:
            payload = raw.removeprefix("data: ").strip()
            if payload == "[DONE]":
                break
            data = json.loads(payload)
            if "error" in data:
                error = data["error"]
                yield w.event(
                    "error",
                    code=error.get("code"),
                    message=error["message"],
                    param=error.get("param"),
                )
                return
            usage = data.get("usage") or usage
            for choice in data["choices"]:
                delta = choice["delta"]
                logprobs = (choice.get("logprobs") or {}).get("content") or []
                if delta.get("reasoning"):
                    for e in w.text("reasoning", delta["reasoning"]):
                        yield e
                w.pending_logprobs += logprobs  # sent with the next text delta
                if delta.get("content"):
                    for e in w.text("message", delta["content"]):
                        yield e
                for call in delta.get("tool_calls") or []:
                    for e in w.tool_call(call):
                        yield e
                finish_reason = choice.get("finish_reason") or finish_reason
        if not w.output:  # an empty reply is an empty message
            for e in w.begin(_message_item("", [])):
                yield e
        messages = [item for item in w.output if item["type"] == "message"]
        if messages:  # tokens after the text (a call's): in the final response only
            messages[0]["content"][0]["logprobs"] += w.pending_logprobs
        for e in w.close():
            yield e
        # vLLM's last event, whatever the status (OpenAI sends response.incomplete for a cut
        # reply, which the openai client's stream helper does not take as the end)
        yield w.event(
            "response.completed", response=_finished(head, w.output, finish_reason, usage)
        )
    finally:
        aclose = getattr(chunks, "aclose", None)
        if aclose is not None:
            await aclose()
