"""float8 KV cache against float32 on CPU: decode step time and how many requests fit.

    python -m benchmarks.kv_cache_fp8 [--batch-size 8,64] [--input-len 256] [--output-len 16]
        [--reps 3] [--kv-cache-memory-bytes 1073741824] [--out benchmarks/results/kv_cache_fp8.json]

Two engines in one process on the default model as `LLM()` loads it (SmolLM2-135M, its Q4_1
blocks kept, float32 activations), the same KV-cache byte budget each: `kv_cache_dtype="auto"`
(float32 pages) and `"fp8"` (float8_e4m3fn pages: a quarter of the bytes). For each batch size
B, B requests of `--input-len` random prompt tokens decode `--output-len` tokens, greedy
(`latency.run_batch`); the engines alternate, `--reps` times after a warm-up each; reported:
the median decode step (B tokens) and its device part. From each engine's start-up log line:
the blocks, the tokens they hold and the maximum concurrency for `max_model_len`-token
requests. Threads: XLA's pool, every core; on a shared machine timings are noisy, hence the
alternation. Last, each engine's greedy chat answer to "What is the capital of France?".
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import sys
from pathlib import Path

from benchmarks.common import environment, median
from benchmarks.latency import run_batch

DTYPES = ("auto", "fp8")


# the engine's start-up line: usable blocks, block size, tokens, maximum concurrency
START_LINE = r"(\d+) blocks of (\d+) tokens(?: and 1 null block)? \((\d+) tokens.*?: ([\d.]+)x"


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=_ints, default=[8, 64])
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument("--out", default="benchmarks/results/kv_cache_fp8.json")
    ns = p.parse_args(argv)

    from pagedjax import LLM

    engines, logs = {}, {}
    for dtype in DTYPES:
        cap = _Capture()
        logging.getLogger("pagedjax").addHandler(cap)
        logging.getLogger("pagedjax").setLevel(logging.INFO)
        engines[dtype] = LLM(
            kv_cache_dtype=dtype,
            max_model_len=ns.max_model_len,
            max_num_seqs=max(ns.batch_size),
            kv_cache_memory_bytes=ns.kv_cache_memory_bytes,
            enable_prefix_caching=False,
            disable_log_stats=True,
            use_tqdm_on_load=False,
        )
        logging.getLogger("pagedjax").removeHandler(cap)
        line = next((m for m in cap.lines if "maximum concurrency" in m), "")
        got = re.search(START_LINE, line)
        logs[dtype] = {
            "log_line": line,
            "num_blocks": int(got.group(1)) if got else None,
            "tokens": int(got.group(3)) if got else None,
            "max_concurrency": float(got.group(4)) if got else None,
        }
        print(f"{dtype}: {line}", file=sys.stderr, flush=True)
    rnd = random.Random(0)
    rows = []
    for batch in ns.batch_size:
        steps: dict[str, list[dict]] = {d: [] for d in DTYPES}
        for d in DTYPES:  # warm-up
            run_batch(engines[d], batch, 0, ns, rnd)
        for _ in range(ns.reps):
            for d in DTYPES:
                steps[d] += run_batch(engines[d], batch, 0, ns, rnd)["decode_steps"]
        for d in DTYPES:
            row = {
                "kv_cache_dtype": d,
                "batch_size": batch,
                "decode_step_s": median([s["total_s"] for s in steps[d]]),
                "decode_device_s": median([s["device_s"] for s in steps[d]]),
                "steps_measured": len(steps[d]),
            }
            rows.append(row)
            print(
                f"B={batch:4d} {d:5s} decode step {row['decode_step_s'] * 1e3:7.1f} ms "
                f"(device {row['decode_device_s'] * 1e3:.1f} ms)",
                file=sys.stderr,
                flush=True,
            )
    from pagedjax import SamplingParams

    chat = [{"role": "user", "content": "What is the capital of France?"}]
    answers = {
        d: engines[d]
        .chat(chat, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
        .outputs[0]
        .text
        for d in DTYPES
    }
    print(f"greedy chat answers: {answers}", file=sys.stderr)
    result = {
        "benchmark": "kv_cache_fp8",
        "chat_answers": answers,
        "config": vars(ns),
        "cpu_kernel_isa": engines["auto"].llm_engine.config.model_config.cpu_kernel_isa,
        "cache": logs,
        "rows": rows,
        "env": environment(),
    }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
