"""The flags of `pagedjax serve` that are the server's own (vLLM's names); engine flags come
from `EngineArgs.add_cli_args`. Kept apart from the app so that building the command-line
parser imports neither FastAPI nor jax."""

from __future__ import annotations

import argparse


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (vLLM's names); engine flags come from EngineArgs."""
    parser.add_argument("model_tag", nargs="?", default=None, help="Model (same as --model).")
    g = parser.add_argument_group("server")
    g.add_argument(
        "--host", default="127.0.0.1", help="Address to listen on (0.0.0.0: all interfaces)."
    )
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="Require this key (Bearer) on /v1/*.")
    g.add_argument("--chat-template", default=None, help="A chat template file or string.")
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="Seconds in-flight requests may take to finish after SIGTERM; then aborted.",
    )
    g.add_argument("--uvicorn-log-level", default="info")
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
