"""Offline throughput of pagedjax on a workload file (default: the standard 64-request one).

    python -m benchmarks.throughput [--workload FILE] [--out results/throughput.json]
        [engine flags, e.g. --max-num-batched-tokens 512]

Each request is sent as exact prompt token ids, greedy, EOS ignored, and generates exactly
its output_len tokens. Compile time is reported apart: the engine compiles every shape bucket
at start-up, before the clock starts.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

from benchmarks.common import (
    STANDARD_WORKLOAD,
    environment,
    load_workload,
    shared_prefix_workload,
)


def run(workload: str, engine_kwargs: dict) -> dict:
    from pagedjax import LLM, SamplingParams

    reqs = shared_prefix_workload() if workload == "shared-prefix" else load_workload(workload)
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    startup = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["output_len"]) for r in reqs
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    assert n_out == sum(r["output_len"] for r in reqs), "every request must give output_len tokens"
    eng = llm.llm_engine
    stats = eng.scheduler.stats()
    return {
        "engine": "pagedjax",
        "workload": str(workload),
        "num_requests": len(reqs),
        "prompt_tokens": n_in,
        "output_tokens": n_out,
        "wall_s": wall,
        "requests_per_s": len(reqs) / wall,
        "output_tokens_per_s": n_out / wall,
        "total_tokens_per_s": (n_in + n_out) / wall,
        "startup_s": startup,
        "compile_s": eng.compile_seconds,
        "engine_steps": eng.stat_logger.num_steps,
        "prefix_cache_hit_rate": stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1),
        "prompt_tokens_computed": stats.prompt_tokens_computed,
        "preemptions": stats.num_preemptions,
        "engine_args": {k: v for k, v in engine_kwargs.items()},
        "env": environment(),
    }


def main(argv=None) -> None:
    from pagedjax.config import EngineArgs

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--workload",
        default=str(STANDARD_WORKLOAD),
        help="A workload file, or 'shared-prefix' (64 requests, one 200-token "
        "prefix, 16-64 own tokens, 32 output tokens).",
    )
    p.add_argument("--out", default=None, help="Write the result as JSON here.")
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    defaults = EngineArgs()
    kwargs = {
        k: getattr(ns, k)
        for k in EngineArgs.field_names()
        if getattr(ns, k) != getattr(defaults, k)
    }
    kwargs.setdefault("disable_log_stats", True)
    result = run(ns.workload, kwargs)
    print(json.dumps({k: v for k, v in result.items() if k != "env"}, indent=1))
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
