"""The server's pure ASGI middleware, run before FastAPI parses a request: the API key on
`/v1/*` (`ApiKeyMiddleware`) and the request body limit (`BodyLimitMiddleware`, 413 before a
body over `--max-request-body-bytes` is parsed); and `error_response`, OpenAI's error body
as a response."""

from __future__ import annotations

import secrets

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedjax.server.serving_errors import APIError


def error_response(err: APIError) -> JSONResponse:
    """OpenAI's error body `{"error": {...}}` with the error's status code."""
    return JSONResponse(err.body.model_dump(), status_code=err.status_code)


class ApiKeyMiddleware:
    """Pure ASGI middleware: `/v1/*` needs `Authorization: Bearer <api key>` (vLLM's rule)."""

    def __init__(self, app, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] == "http"
            and scope["path"].startswith("/v1")
            and scope["method"] != "OPTIONS"
        ):
            given = Headers(scope=scope).get("authorization", "").encode()
            if not secrets.compare_digest(given, self._expected):
                err = APIError(401, "Invalid or missing API key.", code="invalid_api_key")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)


DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


class BodyTooLarge(StarletteHTTPException):
    """Raised from the body-limit middleware's `receive` when a streamed body passes the
    limit; FastAPI re-raises HTTPExceptions met while reading a body, so the app's handler
    (or, failing that, the middleware itself) answers 413."""

    def __init__(self, limit: int):
        super().__init__(413, too_large_message(limit))


def too_large_message(limit: int) -> str:
    return (
        f"The request body is larger than this server's limit of {limit} bytes "
        "(--max-request-body-bytes)."
    )


def too_large_error(limit: int) -> APIError:
    return APIError(413, too_large_message(limit), code="request_too_large")


class BodyLimitMiddleware:
    """Pure ASGI middleware: a request body over `max_bytes` is refused with 413 before it
    is parsed, at once from its Content-Length, else when the streamed bytes pass it."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > limit:
            await error_response(too_large_error(limit))(scope, receive, send)
            return
        received = 0
        started = False

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except BodyTooLarge:
            if started:
                raise
            await error_response(too_large_error(limit))(scope, receive, send)
