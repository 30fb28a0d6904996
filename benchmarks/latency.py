"""Latency of one batch, and where a step's time goes (also `pagedjax bench latency`).

    python -m benchmarks.latency [--batch-size 8,64,256] [--input-len 128] [--output-len 16]
        [--waiting 0,64,1024] [--reps 3] [--speculative-config JSON]
        [--kv-cache-dtype auto|fp8] [--cpu-kernel-isa auto|avx512|avx2|portable]
        [--out benchmarks/results/latency.json]

For each batch size B: B requests of `--input-len` random prompt tokens (distinct per
request, so that no prefix is shared) are added at once, greedy, EOS ignored, `--output-len`
tokens each. Reported per batch size (medians over `--reps` after one warm-up batch):

- prefill_s: from the first step until every request has its first token (B x input-len
  prompt tokens, over several steps when they exceed `--max-num-batched-tokens`), i.e. the
  time to first token of the batch's last request;
- decode_step_s: one decode step (B tokens), i.e. the time per output token of each request;
- e2e_s: the whole batch, prefill to the last token;
- the split of a decode step (`LLMEngine.last_step_timing`): scheduling, building the
  step's inputs on the host, device (dispatch of the compiled step until its sampled ids are
  on the host: compute + transfers), and the host work after it (scheduler update, stop
  checks, detokenization, outputs); host_fraction = (step - device) / step.

With `--speculative-config` (vLLM's JSON, e.g. '{"method": "ngram",
"num_speculative_tokens": 4}') a decode step verifies proposals, so it may yield several
tokens per request: decode_tok_s (output tokens after the first, per request, over the time
from the batch's last first token to its end) is the figure to compare, and the row carries
the acceptance counters of the run.

`--waiting N` adds N more requests that cannot run (max_num_seqs = B), to show that the host
part of a step does not grow with the waiting queue.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

from benchmarks.common import environment, median

PHASES = ("schedule_s", "prepare_s", "device_s", "update_s", "total_s")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _prompts(rnd: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    return [[rnd.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run_batch(llm, batch: int, waiting: int, ns, rnd: random.Random) -> dict:
    """One batch of `batch` requests (+ `waiting` queued ones); returns its timings."""
    from pagedjax import SamplingParams

    eng = llm.llm_engine
    vocab = eng.config.model_config.arch.vocab_size
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=ns.output_len)
    ids = []
    for i, p in enumerate(_prompts(rnd, batch + waiting, ns.input_len, vocab)):
        rid = f"r{rnd.random()}-{i}"
        ids.append(rid)
        eng.add_request(rid, {"prompt_token_ids": p}, params)
    running = set(ids[:batch])
    t0 = time.perf_counter()
    first: set[str] = set()
    prefill_s = None
    decode: list[dict] = []
    while running:
        outs = eng.step()
        timing = eng.last_step_timing
        for o in outs:
            if o.request_id in running and o.outputs[0].token_ids:
                first.add(o.request_id)
            if o.finished:
                running.discard(o.request_id)
        if prefill_s is None:
            if first >= set(ids[:batch]):
                prefill_s = time.perf_counter() - t0
        elif timing.num_seqs == batch and running:
            decode.append(timing.as_dict())
    e2e = time.perf_counter() - t0
    eng.abort_request(ids[batch:])
    assert not eng.has_unfinished_requests()
    return {"prefill_s": prefill_s, "e2e_s": e2e, "decode_steps": decode}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="default: the SmolLM2-135M GGUF")
    p.add_argument("--batch-size", type=_ints, default=[8, 64, 256])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--waiting", type=_ints, default=[0], help="extra queued requests")
    p.add_argument(
        "--reps", "--num-iters", type=int, default=3, help="timed runs (vLLM's --num-iters)"
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | fp8 | fp8_e5m2")
    p.add_argument("--cpu-kernel-isa", default="auto", help="auto | avx512 | avx2 | portable")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--speculative-config", default=None, help="JSON, as vLLM's")
    p.add_argument("--out", default="benchmarks/results/latency.json")
    ns = p.parse_args(argv)

    from pagedjax import LLM

    B = max(ns.batch_size)
    max_len = ns.input_len + ns.output_len
    t0 = time.perf_counter()
    llm = LLM(
        **({"model": ns.model} if ns.model else {}),
        dtype=ns.dtype,
        kv_cache_dtype=ns.kv_cache_dtype,
        cpu_kernel_isa=ns.cpu_kernel_isa,
        max_model_len=max_len,
        max_num_seqs=B,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        enable_prefix_caching=False,
        disable_log_stats=True,
        use_tqdm_on_load=False,
        speculative_config=ns.speculative_config,
    )
    startup = time.perf_counter() - t0
    eng = llm.llm_engine
    rnd = random.Random(0)
    rows = []
    for batch in ns.batch_size:
        eng.scheduler.config = _with_max_num_seqs(eng.scheduler.config, batch)
        for waiting in ns.waiting:
            run_batch(llm, batch, waiting, ns, rnd)  # warm-up: buckets, caches, allocator
            runs = [run_batch(llm, batch, waiting, ns, rnd) for _ in range(ns.reps)]
            steps = [s for r in runs for s in r["decode_steps"]]
            split = {k: median([s[k] for s in steps]) for k in PHASES} if steps else {}
            row = {
                "batch_size": batch,
                "waiting": waiting,
                "input_len": ns.input_len,
                "output_len": ns.output_len,
                "prefill_s": median([r["prefill_s"] for r in runs]),
                "e2e_s": median([r["e2e_s"] for r in runs]),
                "decode_step_s": split.get("total_s"),
                "decode_split": split,
                "host_fraction": (
                    (split["total_s"] - split["device_s"]) / split["total_s"] if split else None
                ),
                "decode_steps_measured": len(steps),
                "decode_tok_s": median(
                    [batch * (ns.output_len - 1) / (r["e2e_s"] - r["prefill_s"]) for r in runs]
                ),
            }
            if eng.speculator is not None:
                row["spec_decode"] = dataclasses.asdict(eng.speculator.stats)
            rows.append(row)
            print(
                f"B={batch:4d} waiting={waiting:5d}  prefill {row['prefill_s'] * 1e3:8.1f} ms  "
                f"decode step {split.get('total_s', 0) * 1e3:7.1f} ms  "
                f"(schedule {split.get('schedule_s', 0) * 1e3:.2f}, "
                f"prepare {split.get('prepare_s', 0) * 1e3:.2f}, "
                f"device {split.get('device_s', 0) * 1e3:.1f}, "
                f"update {split.get('update_s', 0) * 1e3:.2f} ms; "
                f"host {100 * (row['host_fraction'] or 0):.1f} %)",
                file=sys.stderr,
                flush=True,
            )
    result = {
        "benchmark": "latency",
        "dtype": ns.dtype,
        "kv_cache_dtype": ns.kv_cache_dtype,
        "cpu_kernel_isa": eng.config.model_config.cpu_kernel_isa,
        "startup_s": startup,
        "compile_s": eng.compile_seconds,
        "speculative_config": ns.speculative_config,
        "rows": rows,
        "env": environment(),
    }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


def _with_max_num_seqs(cfg, n: int):
    """The scheduler config with max_num_seqs = n (<= what the runner was built for): the
    batch sizes of one run share one engine and its compiled steps."""
    import dataclasses

    return dataclasses.replace(cfg, max_num_seqs=n)


if __name__ == "__main__":
    main()
