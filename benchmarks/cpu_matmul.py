"""The native CPU matmul per ISA path against XLA's dot, from decode to prefill sizes.

    python -m benchmarks.cpu_matmul [--m 1,8,64,128,512,1024,2048] [--trials 7]
        [--isas avx512,avx2] [--out benchmarks/results/cpu_matmul.json]

For each M and each of SmolLM2-135M's linear shapes (K x N: 576 x 576 (o_proj), 576 x 1536
(gate / up), 1536 x 576 (down), 576 x 49152 (the LM head, M <= 128 only: a step samples at
most its sequences' last tokens)), one weight stacked over 30 layers as the engine holds it:
  - "native-<isa>": `cpu_linear.matmul` on the packed stack (layer 7, read in place), every
    ISA path this CPU runs (`cpu_kernels.runnable_isas()`);
  - "xla-scan-slice": XLA's dot on layer 7 dynamically sliced out of the unpacked stack, as
    the model's scan over layers gets it (the slice copies the layer);
  - "xla-dot": XLA's dot on a plain [K, N] weight (no slice: the best XLA can do).
Each is one jitted call timed alone, the best of `--trials`; GFLOP/s = 2 M K N / time. The
machine's matmul peak (`benchmarks.matmul_peak`, XLA's best float32 dot) is measured in the
same run, and each rate is given as a fraction of it. Threads: XLA's pool (every core the
process may use). Timings on a shared machine are noisy: the cases alternate in one loop.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import environment

SHAPES = [(576, 576), (576, 1536), (1536, 576), (576, 49152)]
LAYERS, LAYER = 30, 7


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=_ints, default=[1, 8, 64, 128, 512, 1024, 2048])
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--isas", default=None, help="comma-separated ISA paths (default: all)")
    p.add_argument("--out", default="benchmarks/results/cpu_matmul.json")
    ns = p.parse_args(argv)

    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.matmul_peak import matmul_peak
    from pagedjax.ops import cpu_kernels, cpu_linear

    peak = matmul_peak("float32")
    isas = ns.isas.split(",") if ns.isas else cpu_kernels.runnable_isas()
    rng = np.random.default_rng(0)
    rows = []
    for K, N in SHAPES:
        L = 1 if N > 10000 else LAYERS
        layer = 0 if L == 1 else LAYER
        w = jnp.asarray(rng.standard_normal((L, K, N), np.float32))
        packed = jax.block_until_ready(jax.jit(cpu_linear.pack)(w))
        plain = jax.block_until_ready(w[layer])
        for M in ns.m:
            if N > 10000 and M > 128:
                continue
            x = jnp.asarray(rng.standard_normal((M, K), np.float32))
            fns = {
                f"native-{isa}": (
                    jax.jit(functools.partial(cpu_linear.matmul, isa=isa)),
                    (x, packed, jnp.int32(layer)),
                )
                for isa in isas
            }
            fns["xla-scan-slice"] = (
                jax.jit(lambda x, w, i: x @ jax.lax.dynamic_index_in_dim(w, i, 0, False)),
                (x, w, jnp.int32(layer)),
            )
            fns["xla-dot"] = (jax.jit(lambda x, w: x @ w), (x, plain))
            best = {name: float("inf") for name in fns}
            for f, args in fns.values():
                jax.block_until_ready(f(*args))
            for _ in range(ns.trials):  # the cases alternate
                for name, (f, args) in fns.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(*args))
                    best[name] = min(best[name], time.perf_counter() - t0)
            flops = 2 * M * K * N
            for name, s in best.items():
                rate = flops / s
                rows.append(
                    {
                        "impl": name,
                        "m": M,
                        "k": K,
                        "n": N,
                        "seconds": s,
                        "gflops": rate / 1e9,
                        "fraction_of_peak": rate / peak["flops_per_s"],
                    }
                )
            line = "  ".join(f"{n} {flops / s / 1e9:6.1f}" for n, s in best.items())
            print(f"M={M:5d} K={K:5d} N={N:6d}  GFLOP/s: {line}", file=sys.stderr, flush=True)
    result = {
        "benchmark": "cpu_matmul",
        "peak": peak,
        "isas": list(isas),
        "rows": rows,
        "env": environment(),
    }
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
