"""The flags of `pagedjax serve` that are the server's own (vLLM's names); engine flags come
from `EngineArgs.add_cli_args`. Kept apart from the app so that building the command-line
parser, and the checks that need no engine (`check_serve_args`: the model path exists, the
address can be bound), import neither FastAPI nor jax: a mistake there fails in a second,
before the model loads."""

from __future__ import annotations

import argparse
import errno
import json
import socket

# the keys of pagedjax.server.tool_parsers.TOOL_PARSERS (not imported here: see above)
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
# the keys of pagedjax.server.reasoning_parsers.REASONING_PARSERS
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")


def _port(text: str) -> int:
    """--port's type: an int in [0, 65535] (argparse reports anything else as a usage error)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0-65535, got {port}")
    return port


def _json_list(text: str) -> list[str]:
    """The CORS flags' type: a JSON list of strings (vLLM's format, e.g. '["*"]')."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(
            f"must be a JSON list of strings (e.g. '[\"*\"]'), got {text!r}"
        )
    return value


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (vLLM's names); engine flags come from EngineArgs."""
    parser.add_argument("model_tag", nargs="?", default=None, help="Model (same as --model).")
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: all interfaces)."
    )
    g.add_argument("--port", type=_port, default=8000, help="TCP port (0-65535; 0: any free one).")
    g.add_argument("--api-key", default=None, help="Require this key (Bearer) on /v1/*.")
    g.add_argument("--chat-template", default=None, help="A chat template file or string.")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='Serve tool_choice="auto" (the default with tools): the model decides, and its '
        "output is read by --tool-call-parser.",
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=TOOL_CALL_PARSERS,
        help="How the model writes tool calls: hermes (<tool_call>{...}</tool_call>: "
        "Hermes, Qwen2.5, Qwen3) or llama3_json (Llama 3.1/3.2 JSON).",
    )
    g.add_argument(
        "--chat-template-content-format",
        default="auto",
        choices=("auto", "string", "openai"),
        help="Messages' content as the chat template reads it: string (text parts joined), "
        "openai (a list of text parts), or auto (openai for a template that loops over it).",
    )
    g.add_argument(
        "--reasoning-parser",
        default=None,
        choices=REASONING_PARSER_NAMES,
        help="Return a chat reply's thinking (before </think>) as message.reasoning: "
        "deepseek_r1 (every reply thinks) or qwen3 (unless enable_thinking is false).",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="Seconds in-flight requests may take to finish after SIGTERM; then aborted.",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=16 * 1024 * 1024,
        help="Larger request bodies are refused with 413 before they are parsed (default: 16 MiB).",
    )
    g.add_argument(
        "--response-role",
        default="assistant",
        help="The role of chat replies after a generation prompt (vLLM's; default assistant).",
    )
    for flag, what in (("origins", "Origins"), ("methods", "HTTP methods"), ("headers", "Headers")):
        g.add_argument(
            f"--allowed-{flag}",
            type=_json_list,
            default=["*"],
            help=f"CORS: {what} browsers may use, a JSON list (vLLM's default: '[\"*\"]').",
        )
    g.add_argument(
        "--allow-credentials", action="store_true", help="CORS: allow credentials (cookies)."
    )
    g.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="Chat and completion usage carries prompt_tokens_details.cached_tokens, the prompt "
        "tokens served from the prefix cache (vLLM's; /v1/responses always reports them).",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="Log each request at INFO: its id, endpoint, prompt token count and sampling "
        "parameters (not its text).",
    )
    g.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="Accepted for vLLM compatibility: requests are logged only with "
        "--enable-log-requests.",
    )
    g.add_argument("--uvicorn-log-level", default="info")
    g.add_argument("--disable-uvicorn-access-log", action="store_true")


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port, not yet listening (uvicorn listens on it once the
    engine is up), so that a busy port is found before the model loads.

    Raises:
        ValueError: the address cannot be bound (in use, not an address of this machine).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "the port is already in use" if e.errno == errno.EADDRINUSE else e.strerror
        raise ValueError(
            f"cannot listen on {host}:{port}: {why} (is another server running there? "
            "choose another --port)"
        ) from e
    return sock


def check_serve_args(ns: argparse.Namespace) -> socket.socket:
    """What `pagedjax serve` checks before loading anything: the model path (the default
    model when none is given) names a loadable checkpoint, and --host/--port can be bound.

    Returns:
        The bound socket, for `run_server`.

    Raises:
        ValueError: a missing model path, --enable-auto-tool-choice without
            --tool-call-parser, or an address that cannot be bound.
    """
    from pagedjax.models.sources import resolve_model_source

    if getattr(ns, "enable_auto_tool_choice", False) and ns.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json)")

    resolve_model_source(
        ns.model_tag if ns.model_tag is not None else ns.model, getattr(ns, "revision", None)
    )
    return bind_socket(ns.host, ns.port)
