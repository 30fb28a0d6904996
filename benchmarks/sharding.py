"""Device layouts side by side: step time and the collectives XLA put in each compiled step.

    python -m benchmarks.sharding [--model PATH] [--num-layers 2] [--devices 8]
        [--layouts single,pp2,...] [--out results/sharding.json]

For each layout (single device, TP, PP, PP x TP, DP, DP x TP) the engine serves the same batch
(--num-requests prompts of --prompt-len tokens, --max-tokens greedy tokens each); the result
gives the median decode step time, the prefill time, and the number of collective operations
of each kind (all-reduce, all-gather, reduce-scatter, collective-permute, all-to-all) in the
compiled HLO of the largest and the smallest token bucket. Without a GPU it runs on CPU
devices simulated with XLA_FLAGS=--xla_force_host_platform_device_count (set here before jax
is imported): the collectives are real, the times only show the overhead of the layout on a
shared CPU. Default model: a tiny random Llama (4 query heads, 2 KV heads, --num-layers
layers) written on the fly; a layer count the pipeline size does not divide gives uneven
stages (vLLM's split, or the layout's `pp_layer_partition`), and the result names each
stage's layers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

LAYOUTS = {
    "single": {},
    "tp2": {"tensor_parallel_size": 2},
    "tp4": {"tensor_parallel_size": 4},
    "pp2": {"pipeline_parallel_size": 2},
    "pp2-tp2": {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
    "pp4": {"pipeline_parallel_size": 4},
    "pp2-part12": {"pipeline_parallel_size": 2, "pp_layer_partition": "1,2"},
    "dp2": {"data_parallel_size": 2},
    "dp2-tp2": {"data_parallel_size": 2, "tensor_parallel_size": 2},
}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def count_collectives(hlo: str) -> dict[str, int]:
    """Collective instructions in an HLO module's text (async start/done pairs count once)."""
    counts = {}
    for op in COLLECTIVES:
        counts[op] = len(re.findall(rf"= \S+ {op}(?:-start)?\(", hlo))
    return counts


def run_layout(model: str, name: str, ns) -> dict:
    import numpy as np

    from pagedjax import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="float32",
        max_model_len=ns.max_model_len,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_num_seqs=ns.num_requests,
        kv_cache_memory_bytes=ns.kv_cache_memory_bytes,
        use_tqdm_on_load=False,
        disable_log_stats=True,
        compilation_cache_dir="",
        **LAYOUTS[name],
    )
    eng = llm.llm_engine
    replica = getattr(eng, "replicas", [eng])[0]
    exes = replica.runner.steps.executables
    keys = sorted(exes)
    hlo = {f"bucket_{k}": count_collectives(exes[k].as_text()) for k in (keys[0], keys[-1])}
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0.0, max_tokens=ns.max_tokens, ignore_eos=True)
    for i in range(ns.num_requests):
        ids = rng.integers(10, 250, size=ns.prompt_len).tolist()
        eng.add_request(str(i), {"prompt_token_ids": ids}, params)
    times, prefill, started = [], 0.0, set()
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        if len(started) < ns.num_requests:  # some prompt is still being prefilled
            prefill += dt
        else:
            times.append(dt)
        started |= {o.request_id for o in outs}
    return {
        "layout": LAYOUTS[name],
        "mesh": replica.layout["mesh"],
        "stage_layers": replica.layout["stage_layers"],
        "replicas": len(getattr(eng, "replicas", [eng])),
        "param_bytes_per_device": replica.layout["param_bytes_per_device"],
        "kv_cache_bytes_per_device": replica.layout["kv_cache_bytes_per_device"],
        "decode_step_ms_median": 1000 * statistics.median(times) if times else None,
        "prefill_s": prefill,
        "collectives": hlo,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: a tiny random Llama)")
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    p.add_argument("--num-layers", type=int, default=2, help="layers of the default model")
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=64 << 20)
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    if "jax" not in sys.modules:
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={ns.devices}")
    from benchmarks.common import environment

    model = ns.model
    if model is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        import conftest

        folder = Path(tempfile.mkdtemp()) / "tiny"
        model = str(conftest.make_checkpoint(folder, num_hidden_layers=ns.num_layers))
    layers = ns.num_layers if ns.model is None else None
    result = {"model": model, "num_layers": layers, "layouts": {}, "env": environment()}
    for i, name in enumerate(ns.layouts.split(",")):  # a layout named twice: "name#i" again
        key = f"{name}#{i}" if name in result["layouts"] else name
        result["layouts"][key] = r = run_layout(model, name, ns)
        print(
            f"{name:8} mesh {r['mesh']} x{r['replicas']} stages {r['stage_layers']}  decode step "
            f"{r['decode_step_ms_median']:.1f} ms  prefill {r['prefill_s']:.2f} s  "
            f"collectives {r['collectives']}",
            file=sys.stderr,
        )
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        with open(ns.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
