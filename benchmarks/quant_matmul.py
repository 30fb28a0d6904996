"""The native quantized CPU matmul (`ops.cpu_quant`) against XLA's `quantized_matmul`.

    python -m benchmarks.quant_matmul [--m 1,8,64] [--trials 7] [--isas avx512]
        [--out benchmarks/results/quant_matmul.json]

One [576 -> 1536] layer (SmolLM2-135M's gate / up projection) stacked over 30 layers as the
engine holds it, for int8 weight-only (per-output-channel scales) and AWQ int4 (groups of
128), at each M:
  - "native-<isa>": `cpu_quant.matmul` on the stack (layer 7, read in place), each ISA path
    asked for (default: every path this CPU runs);
  - "xla-scan-slice": `quant.quantized_matmul` on layer 7 dynamically sliced out of the
    stack, as the model's scan over layers gets it (the slice copies the layer).
Each is one jitted call timed alone, the best of `--trials`; GFLOP/s = 2 M K N / time.
Threads: XLA's pool (every core the process may use). Timings on a shared machine are
noisy: the cases alternate in one loop.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import environment

K, N = 576, 1536
LAYERS, LAYER = 30, 7


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--m", type=_ints, default=[1, 8, 64])
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--isas", default=None, help="comma-separated ISA paths (default: all)")
    p.add_argument("--out", default="benchmarks/results/quant_matmul.json")
    ns = p.parse_args(argv)

    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from pagedjax.ops import cpu_kernels, cpu_quant, quant

    isas = ns.isas.split(",") if ns.isas else cpu_kernels.runnable_isas()
    rng = np.random.default_rng(0)
    weights = {
        "int8": quant.quantize_int8(jnp.asarray(rng.standard_normal((LAYERS, K, N), np.float32))),
        "awq-g128": quant.QuantizedWeight(
            jnp.asarray(rng.integers(0, 2**32, (LAYERS, K // 8, N), np.uint32).view(np.int32)),
            jnp.asarray(rng.uniform(0.001, 0.05, (LAYERS, K // 128, N)), jnp.float32),
            zeros=jnp.asarray(rng.integers(0, 17, (LAYERS, K // 128, N)), jnp.int8),
            method="awq",
            in_features=K,
        ),
    }
    sliced = jax.jit(
        lambda x, w, i: quant.quantized_matmul(
            x, jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, False), w)
        )
    )
    rows = []
    for method, w in weights.items():
        w = jax.block_until_ready(w)
        for M in ns.m:
            x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
            i = jnp.int32(LAYER)
            fns = {
                f"native-{isa}": jax.jit(functools.partial(cpu_quant.matmul, isa=isa))
                for isa in isas
            }
            fns["xla-scan-slice"] = sliced
            best = {name: float("inf") for name in fns}
            for f in fns.values():
                jax.block_until_ready(f(x, w, i))
            for _ in range(ns.trials):  # the cases alternate
                for name, f in fns.items():
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(x, w, i))
                    best[name] = min(best[name], time.perf_counter() - t0)
            flops = 2 * M * K * N
            for name, s in best.items():
                rows.append(
                    {
                        "method": method,
                        "impl": name,
                        "m": M,
                        "k": K,
                        "n": N,
                        "seconds": s,
                        "gflops": flops / s / 1e9,
                    }
                )
            line = "  ".join(f"{n} {s * 1e6:8.1f} us" for n, s in best.items())
            print(f"{method:8s} M={M:3d}: {line}", file=sys.stderr, flush=True)
    result = {"benchmark": "quant_matmul", "isas": list(isas), "rows": rows, "env": environment()}
    out = Path(ns.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
