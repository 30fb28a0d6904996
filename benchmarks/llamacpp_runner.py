"""llama.cpp (`llama-cpp-python`) as a peer engine for `benchmarks.gguf`, in its own process.

    /path/to/llamacpp-venv/bin/python benchmarks/llamacpp_runner.py MODEL.gguf --n-threads 2

Run with the Python of a virtual environment where `llama-cpp-python` is installed (built from
source, so that its kernels are compiled for this CPU); it imports `llama_cpp` and the standard
library only, never pagedjax or JAX. It loads the GGUF file once (`Llama(model_path, n_ctx,
n_threads, n_threads_batch)`, everything else llama.cpp's default: mmap, no flash attention,
its CPU repacking of the weights where it does that) and answers one request per line of stdin:

    in:   {"prompt_token_ids": [...], "max_tokens": 128}
    out:  RUNNER {"decode_tok_s": ..., "token_ids": [...], "rss_bytes": ..., "peak_rss_bytes": ...}

Each request starts from an empty context (`Llama.reset`) and is decoded greedily
(`Llama.generate(temp=0)`, which never stops at EOS by itself) for exactly `max_tokens` tokens;
decode tok/s = (max_tokens - 1) / (time from the first generated token to the last), the
measure `benchmarks.gguf` uses for pagedjax. The first line printed after loading is
`RUNNER {"version", "system_info", "n_threads", "load_s"}`; results are the lines that start
with `RUNNER` (llama.cpp may log to the same streams). The memory figures are the process's
VmRSS and VmHWM (/proc/self/status), after the request.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PREFIX = "RUNNER "


def _memory() -> dict:
    try:
        with open("/proc/self/status") as f:
            rows = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return {}
    return {
        "rss_bytes": int(rows["VmRSS"].split()[0]) * 1024,
        "peak_rss_bytes": int(rows["VmHWM"].split()[0]) * 1024,
    }


def _say(obj: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def decode(llm, prompt: list[int], max_tokens: int) -> dict:
    """One greedy request of exactly `max_tokens` new tokens; its decode tok/s and tokens."""
    llm.reset()
    tokens: list[int] = []
    first = last = 0.0
    for tok in llm.generate(prompt, temp=0.0, reset=True):
        last = time.perf_counter()
        if not tokens:
            first = last
        tokens.append(int(tok))
        if len(tokens) == max_tokens:
            break
    tok_s = (max_tokens - 1) / (last - first) if max_tokens > 1 else float("nan")
    return {"decode_tok_s": tok_s, "token_ids": tokens, **_memory()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="the GGUF file")
    p.add_argument("--n-threads", type=int, required=True, help="decode and prompt threads")
    p.add_argument("--n-ctx", type=int, default=512, help="context length (tokens)")
    ns = p.parse_args(argv)

    import llama_cpp

    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        ns.model,
        n_ctx=ns.n_ctx,
        n_threads=ns.n_threads,
        n_threads_batch=ns.n_threads,
        verbose=False,
    )
    info = llama_cpp.llama_print_system_info()
    _say(
        {
            "version": llama_cpp.__version__,
            "system_info": info.decode() if isinstance(info, bytes) else str(info),
            "n_threads": ns.n_threads,
            "n_ctx": ns.n_ctx,
            "load_s": time.perf_counter() - t0,
        }
    )
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        _say(decode(llm, req["prompt_token_ids"], req["max_tokens"]))


if __name__ == "__main__":
    main()
