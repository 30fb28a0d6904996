"""The OpenAI-compatible HTTP server: the FastAPI app, its error handling, and `run_server`
(what `pagedjax serve` runs: build the engine, then serve it with uvicorn).

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions`, `POST /v1/responses`
(OpenAI's Responses API, served by the chat path: `serving_responses`), `GET
/v1/models[/{id}]`, `GET /health`, `GET /metrics` (Prometheus text), `POST /tokenize`, `POST
/detokenize`, `GET /version`, and FastAPI's `/openapi.json` and `/docs`.

Errors always have OpenAI's body `{"error": {"message", "type", "param", "code"}}`:
400 for a request that is malformed or out of range (bad JSON, wrong types, a prompt longer
than max_model_len, an option the engine refuses: every `ValueError` of the engine), 401 for
a missing or wrong API key on `/v1/*` when `--api-key` is set, 404 for an unknown model or
path (an endpoint this server does not have, such as `/v1/embeddings`, is named as not
supported), 405 for a wrong method, 413 for a body over `--max-request-body-bytes` (refused
before it is parsed), 415 for a body that is not JSON, 500 only for an internal failure,
which fails that one request (and 503 while the engine is down).

Browsers may call it from other origins (CORS, vLLM's defaults: every origin, method and
header; `--allowed-origins` etc.); preflights are answered before the API key is checked.

A client that disconnects aborts its request, streaming or not: a streamed response is
cancelled by Starlette when the client goes away, and a non-streamed one is raced against a
watcher of the connection; either way the request's stream aborts it and its blocks are
freed. On SIGTERM (or SIGINT) uvicorn stops accepting connections, lets in-flight requests
finish for up to `--shutdown-timeout` seconds and cancels (aborts) the rest; the engine then
stops and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import logging
import signal
import socket
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

import pagedjax
from pagedjax.engine.async_llm import AsyncLLM, EngineDeadError
from pagedjax.engine.prometheus import CONTENT_TYPE
from pagedjax.server.cli_args import check_serve_args
from pagedjax.server.middleware import (
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    BodyTooLarge,
    error_response,
    too_large_error,
)
from pagedjax.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from pagedjax.server.protocol_responses import (
    DetokenizeResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from pagedjax.server.protocol_responses_api import ResponsesRequest
from pagedjax.server.serving import OpenAIServing
from pagedjax.server.serving_chat import OpenAIServingChat
from pagedjax.server.serving_completion import OpenAIServingCompletion
from pagedjax.server.serving_errors import APIError, bad_request
from pagedjax.server.serving_responses import OpenAIServingResponses

logger = logging.getLogger(__name__)

_ERRORS = {
    code: {"model": ErrorResponse, "description": desc}
    for code, desc in [
        (400, "Invalid request"),
        (401, "Missing or wrong API key"),
        (404, "Unknown model"),
    ]
}


# what pydantic puts in an error's location for the member of a union that failed
_UNION_MEMBERS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _field_path(loc: tuple) -> list[str]:
    """An error location as the client's field path: no "body", and none of the union
    members pydantic names (`input.list[tagged-union[...]].0.role` -> `input.0.role`;
    a model's class name: the API's fields are lower case)."""
    return [
        str(x)
        for x in loc
        if x != "body"
        and not (isinstance(x, str) and ("[" in x or x in _UNION_MEMBERS or x[:1].isupper()))
    ]


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The 400's message (up to three errors) and `param` (the first error's field). Of a
    union's errors, the deepest come first: the member that matched the value's shape
    (a list for a list) says what is wrong in it."""
    parts, param = [], None
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        e = next(e for e in errors if e.get("type") == "json_invalid")
        return f"the body is not valid JSON: {e.get('ctx', {}).get('error', '')}", None
    errors = sorted(errors, key=lambda e: -len(_field_path(e.get("loc", ()))))
    for e in errors[:3]:
        loc = _field_path(e.get("loc", ()))
        where = ".".join(loc)
        param = param or (where or None)
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return "; ".join(parts) or "invalid request", param


def _is_json(content_type: str | None) -> bool:
    if not content_type:
        return True  # no Content-Type: parsed as JSON, as FastAPI does
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or (
        media.startswith("application/") and media.endswith("+json")
    )


# what an unknown path's 404 says is there
_ENDPOINTS = (
    "POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET /v1/models, "
    "POST /tokenize, POST /detokenize, GET /health, GET /metrics, GET /version"
)


async def _until_disconnected(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel_on_disconnect(raw_request: Request, coro) -> Response:
    """Runs a handler; if the client disconnects first, cancels it (which aborts its engine
    requests). A streamed response is returned as soon as it is created, so only the
    non-streamed part is raced here; Starlette watches the stream itself."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_until_disconnected(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=499)  # nobody is there to read it
    return task.result()


def build_app(
    engine: AsyncLLM,
    api_key: str | None = None,
    chat_template: str | None = None,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    enable_auto_tool_choice: bool = False,
    tool_call_parser: str | None = None,
    response_role: str = "assistant",
    reasoning_parser: str | None = None,
    chat_template_content_format: str = "auto",
    cors: dict | None = None,
    log_requests: bool = False,
    enable_prompt_tokens_details: bool = False,
) -> FastAPI:
    """The FastAPI app serving `engine` (see the module docstring).

    Args:
        engine: a running AsyncLLM; the app shuts it down when its lifespan ends.
        api_key: if set, `/v1/*` requires `Authorization: Bearer <api_key>`.
        chat_template: a Jinja template that replaces the tokenizer's chat template.
        max_request_body_bytes: larger request bodies are answered 413 before parsing.
        enable_auto_tool_choice: serve `tool_choice="auto"` (needs `tool_call_parser`).
        tool_call_parser: the parser of "auto" tool calls ("hermes", "llama3_json").
        response_role: the role of chat replies after a generation prompt.
        reasoning_parser: "deepseek_r1" or "qwen3": chat replies' thinking comes back as
            `reasoning` (`reasoning_parsers`).
        chat_template_content_format: "auto", "string" or "openai": messages' content as
            the template reads it (`chat_template.render_conversation`).
        cors: Starlette `CORSMiddleware` arguments (allow_origins, allow_methods,
            allow_headers, allow_credentials); None: every origin, method and header, no
            credentials (vLLM's defaults). It runs before the API key check, so that
            browsers' preflight requests (which carry no key) are answered.
        log_requests: log each generation request's id and parameters at INFO.
        enable_prompt_tokens_details: chat and completion usage carries
            `prompt_tokens_details.cached_tokens`.

    Raises:
        ValueError: an unknown tool_call_parser or reasoning_parser, or auto tool choice
            without a tool_call_parser.
    """
    mc = engine.model_config
    names = mc.served_model_names

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="pagedjax", version=pagedjax.__version__, lifespan=lifespan)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_body_bytes)
    if api_key:  # added after the body limit, so it runs first: no body is read without it
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    cors = cors or {}
    app.add_middleware(  # outermost: preflights are answered before the key is checked
        CORSMiddleware,
        allow_origins=cors.get("allow_origins", ["*"]),
        allow_methods=cors.get("allow_methods", ["*"]),
        allow_headers=cors.get("allow_headers", ["*"]),
        allow_credentials=cors.get("allow_credentials", False),
    )
    completions = OpenAIServingCompletion(engine, names, chat_template)
    chat = OpenAIServingChat(
        engine,
        names,
        chat_template,
        enable_auto_tool_choice,
        tool_call_parser,
        response_role,
        reasoning_parser,
    )
    completions.log_requests = chat.log_requests = log_requests
    completions.enable_prompt_tokens_details = enable_prompt_tokens_details
    chat.enable_prompt_tokens_details = enable_prompt_tokens_details
    responses = OpenAIServingResponses(chat)
    base = OpenAIServing(engine, names, chat_template)
    for serving in (completions, chat, base):
        serving.content_format = chat_template_content_format
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        content_type = request.headers.get("content-type")
        if not _is_json(content_type):
            return error_response(
                APIError(415, f"Content-Type must be application/json, got {content_type!r}")
            )
        message, param = _validation_message(exc)
        return error_response(bad_request(message, param))

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge):
        return error_response(too_large_error(max_request_body_bytes))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        if exc.status_code == 404 and exc.detail == "Not Found":  # no route has this path
            message = (
                f"Invalid URL ({request.method} {request.url.path}): this endpoint is not "
                f"supported by this server, which serves {_ENDPOINTS}."
            )
            return error_response(APIError(404, message, code="unsupported_endpoint"))
        err = APIError(exc.status_code, str(exc.detail), type=kind)
        return JSONResponse(err.body.model_dump(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError):
        return error_response(APIError(503, str(exc), type="server_error"))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("internal error on %s", request.url.path)
        err = APIError(500, f"internal server error: {type(exc).__name__}", type="server_error")
        return error_response(err)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        if engine.errored:
            return error_response(APIError(503, "the engine has stopped", type="server_error"))
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedjax.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    def card(model_id: str) -> ModelCard:
        return ModelCard(
            id=model_id, created=created, root=mc.model, max_model_len=mc.max_model_len
        )

    @app.get("/v1/models", response_model=ModelList)
    async def list_models() -> ModelList:
        return ModelList(data=[card(n) for n in names])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERRORS)
    async def get_model(model_id: str) -> ModelCard:
        base.check_model(model_id)
        return card(model_id)

    @app.post("/v1/completions", responses=_ERRORS)
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await _cancel_on_disconnect(raw_request, completions.create(request))

    @app.post("/v1/chat/completions", responses=_ERRORS)
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await _cancel_on_disconnect(raw_request, chat.create(request))

    @app.post("/v1/responses", responses=_ERRORS)
    async def create_response(request: ResponsesRequest, raw_request: Request):
        return await _cancel_on_disconnect(raw_request, responses.create(request))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(request: TokenizeRequest) -> Response:
        return await base.tokenize(request)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(request: DetokenizeRequest) -> Response:
        return await base.detokenize(request)

    return app


# ------------------------------------------------------------------------------ serve


def _load_chat_template(value: str | None) -> str | None:
    """The `--chat-template` value as template text: Jinja text itself (it holds "{{" or
    "{%"), else the path of a file holding it.

    Raises:
        ValueError: a file that cannot be read, or text that is not valid Jinja.
    """
    if value is None:
        return None
    text = value
    if "{{" not in value and "{%" not in value:
        try:
            text = Path(value).read_text()
        except OSError as e:
            raise ValueError(
                f"cannot read --chat-template {value!r}: {e.strerror or e} (give a file, or the "
                "template's Jinja text)"
            ) from e
    import jinja2

    try:
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template is not a valid Jinja template: {e}") from e
    return text


def _freeze_gc_heap() -> None:
    """Moves every object alive once the engine has started (the libraries' and the model's
    Python objects, over half a million) into the garbage collector's permanent generation,
    as vLLM does after its warm-up. A request that allocates many objects (prompt logprobs:
    21 entries for each of thousands of positions) sets off full collections, which walked
    them all while holding the GIL, and so the event loop: up to 0.3 s for 8,192 positions,
    0.08 s with the heap frozen. Objects made later are collected as before."""
    gc.collect()
    gc.freeze()
    logger.info("froze %d objects out of the garbage collector's way", gc.get_freeze_count())


def run_server(ns: argparse.Namespace, sock: socket.socket | None = None) -> int:
    """Checks the model path and binds host:port (unless `sock` is that bound socket:
    `cli_args.check_serve_args`), then builds the engine from the parsed flags and serves
    it until SIGTERM/SIGINT.

    Returns:
        0 after a graceful shutdown.

    Raises:
        ValueError: an invalid engine argument or chat template, a model path that does not
            exist, or an address that cannot be bound (all before the model loads).
    """
    import uvicorn

    from pagedjax.engine_args import EngineArgs

    args = EngineArgs.from_cli_args(ns)
    if ns.model_tag is not None:
        args.model = ns.model_tag
    chat_template = _load_chat_template(ns.chat_template)
    if sock is None:
        sock = check_serve_args(ns)
    try:
        engine = AsyncLLM.from_engine_args(args)
    except BaseException:
        sock.close()
        raise
    app = build_app(
        engine,
        api_key=ns.api_key,
        chat_template=chat_template,
        max_request_body_bytes=ns.max_request_body_bytes,
        enable_auto_tool_choice=ns.enable_auto_tool_choice,
        tool_call_parser=ns.tool_call_parser,
        response_role=ns.response_role,
        reasoning_parser=ns.reasoning_parser,
        chat_template_content_format=ns.chat_template_content_format,
        cors={
            "allow_origins": ns.allowed_origins,
            "allow_methods": ns.allowed_methods,
            "allow_headers": ns.allowed_headers,
            "allow_credentials": ns.allow_credentials,
        },
        log_requests=ns.enable_log_requests,
        enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
    )
    _freeze_gc_heap()
    config = uvicorn.Config(
        app,
        host=ns.host,
        port=ns.port,
        log_level=ns.uvicorn_log_level,
        access_log=not ns.disable_uvicorn_access_log,
        timeout_graceful_shutdown=ns.shutdown_timeout,
    )
    name = ", ".join(engine.model_config.served_model_names)
    host = f"[{ns.host}]" if ":" in ns.host else ns.host
    port = sock.getsockname()[1]

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:  # listening: only now is the address worth printing
                logger.info("serving %s on http://%s:%d", name, host, port)

    # uvicorn re-raises the signal that stopped it once it has shut down gracefully; these
    # handlers (restored by uvicorn afterwards) absorb it, so the process exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        with sock:
            Server(config).run(sockets=[sock])
    finally:
        engine.shutdown()
    return 0
