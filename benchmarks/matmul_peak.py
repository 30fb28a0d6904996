"""The machine's measured matmul peak, and the FLOPs a workload needs of a model.

    python -m benchmarks.matmul_peak [--dtype float32] [--out peak.json]

The peak is the best FLOP/s of one jitted `x @ w` (2 M K N FLOPs per call, calls timed one
by one, best of 10) over square sizes 512..2048 and the model's own shapes with M = 256 and
1024 tokens, in the same process setup as the engine (JAX on the default device, every
core). `benchmarks.throughput` runs it in its own process next to the engines, so the
engine's fraction of the peak is measured on the same machine in the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def matmul_peak(dtype: str = "float32") -> dict:
    """Best FLOP/s of a jitted matmul and the shape it was reached at."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    shapes = [(n, n, n) for n in (512, 1024, 2048)]
    shapes += [(m, 576, 1536) for m in (256, 1024)] + [(m, 1536, 576) for m in (256, 1024)]
    best = {"flops_per_s": 0.0}
    rng = np.random.default_rng(0)
    f = jax.jit(lambda a, b: a @ b)
    for m, k, n in shapes:
        a = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
        b = jnp.asarray(rng.standard_normal((k, n), np.float32), dtype)
        f(a, b).block_until_ready()
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            f(a, b).block_until_ready()
            times.append(time.perf_counter() - t0)
        rate = 2 * m * k * n / min(times)
        if rate > best["flops_per_s"]:
            best = {"flops_per_s": rate, "shape_mkn": [m, k, n]}
    return {"dtype": dtype, **best}


def workload_flops(arch, reqs: list[dict]) -> dict:
    """FLOPs a workload needs of a Llama-family model, the usual count (Kaplan et al., 2020,
    and the PaLM paper's appendix B): 2 x (non-embedding weights) per token computed, the LM
    head (2 D V) per token sampled, and 4 N H x (context length) per token and layer for the
    attention scores and values (causal: the tokens before it and itself).

    Args:
        arch: `models.llama.LlamaArchConfig`.
        reqs: requests with prompt_token_ids and output_len (greedy, all tokens generated).

    Returns:
        {"total": FLOPs, "matmul": ..., "lm_head": ..., "attention": ...}.
    """
    D, F, L = arch.hidden_size, arch.intermediate_size, arch.num_hidden_layers
    N, K, H, V = arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim, arch.vocab_size
    per_layer = D * N * H + 2 * D * K * H + N * H * D + 3 * D * F
    matmul = lm_head = attention = 0
    for r in reqs:
        p, o = len(r["prompt_token_ids"]), r["output_len"]
        computed = p + o - 1  # the last sampled token is never fed back
        matmul += 2 * L * per_layer * computed
        lm_head += 2 * D * V * o
        attention += 4 * N * H * L * computed * (computed + 1) // 2
    return {
        "total": matmul + lm_head + attention,
        "matmul": matmul,
        "lm_head": lm_head,
        "attention": attention,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", default=None)
    ns = p.parse_args(argv)
    result = matmul_peak(ns.dtype)
    print(json.dumps(result), file=sys.stderr)
    if ns.out:
        with open(ns.out, "w") as f:
            json.dump(result, f)
    return result


if __name__ == "__main__":
    main()
