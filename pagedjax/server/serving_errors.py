"""The OpenAI error body as an exception (`APIError`, answered with its HTTP status by the
API server) and the ways a refused input becomes a 400: a bad field (`bad_request`), an
engine refusal naming its field (`bad_input`), and a constraint that failed to compile after
its request was queued (`refuse_late_constraint_errors`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pagedjax.errors import InvalidInputError
from pagedjax.outputs import RequestOutput
from pagedjax.server.protocol_responses import (
    ErrorInfo,
    ErrorResponse,
)


class APIError(Exception):
    """An error answered with OpenAI's error body (`ErrorResponse`) and an HTTP status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.body = ErrorResponse(
            error=ErrorInfo(message=message, type=type, param=param, code=code)
        )


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def bad_input(
    e: ValueError,
    prompt_param: str = "prompt",
    constraint_param: str | None = None,
    max_tokens_param: str = "max_tokens",
) -> APIError:
    """The 400 for a refused input: an `InvalidInputError`'s `param` (its "prompt" renamed
    to `prompt_param`, the endpoint's field, its "max_tokens" to `max_tokens_param`, the
    field the client used, and its "structured_outputs" to `constraint_param`, the field
    the constraint came from), none for a plain ValueError."""
    param = e.param if isinstance(e, InvalidInputError) else None
    if param == "prompt":
        param = prompt_param
    elif param == "max_tokens":
        param = max_tokens_param
    elif param == "structured_outputs" and constraint_param:
        param = constraint_param
        return bad_request(constraint_message(str(e), constraint_param), param)
    return bad_request(str(e), param)


_CONSTRAINT_ERROR = re.compile(r"structured_outputs\.(\w+) is invalid: ")
_CONSTRAINT_WHAT = {"json": "JSON schema", "json_object": "JSON schema"}


def constraint_message(message: str, constraint_param: str | None) -> str:
    """The engine's message for a constraint that does not compile ("structured_outputs.<kind>
    is invalid: <reason>") in terms of the field the client sent, e.g. "the JSON schema of
    response_format is invalid: <reason>"; unchanged for "structured_outputs" itself or another
    message."""
    m = _CONSTRAINT_ERROR.match(message)
    if m is None or constraint_param in (None, "structured_outputs"):
        return message
    what = _CONSTRAINT_WHAT.get(m.group(1), m.group(1))
    return f"the {what} of {constraint_param} is invalid: {message[m.end() :]}"


def refuse_late_constraint_errors(
    results: Iterable[RequestOutput], constraint_param: str | None = None
) -> None:
    """A non-streamed request whose constraint failed to compile after it was queued (one too
    large to check when added, `structured_output.grammar`) gets the 400 it would have had if
    checked then, instead of choices with finish_reason "error" and no text. (A stream has
    started by then: its choices end with finish_reason "error", the reason as stop_reason.)

    Raises:
        APIError 400: an output ended with finish_reason "error" before any token; its
            message is the reason, its param `constraint_param` (default
            "structured_outputs").
    """
    for res in results:
        for o in res.outputs:
            if o.finish_reason == "error" and not o.token_ids:
                reason = o.stop_reason or "the output constraint does not compile"
                message = constraint_message(str(reason), constraint_param)
                raise bad_request(message, constraint_param or "structured_outputs")
