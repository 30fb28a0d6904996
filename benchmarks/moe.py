"""Mixture-of-experts cost: the MoE block for 8, 16, 32 experts at top-2, the grouped matmul
against `jax.lax.ragged_dot`, and a tiny MoE model against a dense one of the same active
parameters on the standard workload.

    python -m benchmarks.moe [--out benchmarks/results/moe.json] [--skip-workload] [--layers 8]

1. Experts sweep: `models.moe_layer.moe_block` (router included) at fixed top-2 and fixed
   active parameters (D=256, Fe=512 per expert: 1.57 MB of float32 weights) for E = 8, 16,
   32, at decode-sized steps (T=16 and 64 tokens) and a prefill-sized one (T=512): XLA's
   cost-analysis FLOPs of the compiled block, its median wall time, and the number of
   distinct experts the step's tokens chose; on the engine's CPU path (packed stacks, the
   native grouped matmul) and on XLA's (plain stacks). Each sweep runs twice: one layer per
   call (its stack stays in cache between calls) and `--layers` layers per call (a scan over
   per-layer stacks, as a model's step: each layer's experts start cold); times are per
   layer. The goal: the 32-expert block costs at most 1.5x the 8-expert one. (A step that
   chooses more distinct experts must read more weight bytes: at 16 tokens, 32 assignments
   touch all 8 of 8 experts but about 20 of 32; `bytes_vs_8` and `expert_gb_s` say so.)
2. One expert matmul of sorted rows three ways: the grouped matmul (XLA: each tile's expert
   weight gathered, a batched dot), `jax.lax.ragged_dot` (on XLA's CPU backend it computes
   every expert over every row, FLOPs x E), and the native grouped matmul
   (`ops.cpu_linear.grouped_matmul`, one call reading each expert in place), at decode-sized
   (1, 8, 32 tokens) and prefill-sized (256) steps.
3. Workload: random Mixtral (8 experts, top-2, Fe = 512) and Llama (F = 1024: the same active
   MLP parameters) checkpoints, 4 layers, D = 256, SmolLM2's vocabulary size, through the
   engine on `workloads/standard.json`'s request shapes (64 requests, greedy, EOS ignored);
   output tokens per second, A and B alternating, after one untimed run of each.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import environment, load_workload, median
from pagedjax.ops import cpu_kernels, cpu_linear
from pagedjax.ops.linear import LayerView

D, FE = 256, 512


def _timed(fn, *args, reps: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return median(times)


def _native_stack(w: jax.Array) -> cpu_linear.PackedWeight:
    """An [L, E, D, F] expert stack as the engine holds it under linear_backend="cpu": a
    packed [L, E, ...] stack, each layer read in place by the native grouped matmul."""
    L, E, K, N = w.shape
    p = cpu_linear.pack(w.reshape(L * E, K, N))
    return cpu_linear.PackedWeight(p.panels.reshape(L, E, *p.panels.shape[1:]), p.n)


def experts_sweep(
    tokens: int, backend: str, k: int = 2, reps: int = 20, layers: int = 1
) -> list[dict]:
    """The MoE block (router included) for E = 8, 16, 32: FLOPs, and wall times taken
    interleaved (one call of each E per round) so that a busy machine slows all alike.
    backend "xla": plain stacks (the grouped matmul gathers each tile's expert weight);
    "native": packed stacks through the native grouped matmul (the engine's CPU path).
    `layers` > 1: one call runs the block of each of `layers` layers in turn (a scan over
    [layers, E, ...] stacks, each layer with its own router and weights, as a model's step
    does), so a layer's experts are not in cache when it starts, unlike `layers` = 1, where
    the 8-expert stack (12.6 MB) stays cache-resident across the timed calls. Times are per
    layer. `distinct_experts`: the experts a layer's tokens chose, averaged over layers (each
    read once by the native kernel: its weight bytes are `expert_mb` each); `expert_gb_s`:
    those bytes over the per-layer time."""
    from pagedjax.models.moe_layer import moe_block, route

    rng = np.random.default_rng(0)
    native = backend == "native"

    def model(w, routers, x):
        def layer(acc, i):
            lw = {
                name: LayerView(a, i) if native else jax.lax.dynamic_index_in_dim(a, i, 0, False)
                for name, a in w.items()
            }
            ids, weights = route(x, routers[i], k, True)
            return acc + moe_block(lw, x, ids, weights), None

        return jax.lax.scan(layer, jnp.zeros_like(x), jnp.arange(layers, dtype=jnp.int32))[0]

    runs = []
    for E in (8, 16, 32):
        w = {
            "experts_gate": jnp.asarray(rng.normal(0, 0.05, (layers, E, D, FE)), jnp.float32),
            "experts_up": jnp.asarray(rng.normal(0, 0.05, (layers, E, D, FE)), jnp.float32),
            "experts_down": jnp.asarray(rng.normal(0, 0.05, (layers, E, FE, D)), jnp.float32),
        }
        routers = jnp.asarray(rng.normal(0, 0.05, (layers, D, E)), jnp.float32)
        x = jnp.asarray(rng.normal(size=(tokens, D)), jnp.float32)
        chosen = [np.asarray(route(x, routers[i], k, True)[0]) for i in range(layers)]
        distinct = float(np.mean([len(np.unique(c)) for c in chosen]))
        if native:
            w = {name: _native_stack(a) for name, a in w.items()}
        fn = jax.jit(model)
        flops = fn.lower(w, routers, x).compile().cost_analysis()["flops"] / layers
        jax.block_until_ready(fn(w, routers, x))
        runs.append((E, fn, (w, routers, x), flops, distinct, []))
    for _ in range(reps):
        for _, fn, args, _, _, times in runs:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append((time.perf_counter() - t0) / layers)
    mb = 3 * D * FE * 4 / 1e6
    out = [
        dict(
            backend=backend,
            layers=layers,
            num_experts=E,
            tokens=tokens,
            top_k=k,
            flops=flops,
            active_flops=2 * 3 * tokens * k * D * FE,
            distinct_experts=distinct,
            expert_mb=mb,
            step_ms=1e3 * median(times),
            expert_gb_s=distinct * mb / 1e3 / median(times),
        )
        for E, _, _, flops, distinct, times in runs
    ]
    base = out[0]
    for r in out:
        r["flops_vs_8"] = r["flops"] / base["flops"]
        r["time_vs_8"] = r["step_ms"] / base["step_ms"]
        r["bytes_vs_8"] = r["distinct_experts"] / base["distinct_experts"]
    return out


def grouped_vs_ragged(tokens: int, E: int = 8, k: int = 2) -> dict:
    """One expert matmul (x [T*k, D] @ expert [D, Fe]) on rows sorted by expert."""
    from pagedjax.models.moe_layer import group_layout, tile_rows
    from pagedjax.ops.linear import expert_linear

    rng = np.random.default_rng(1)
    A = tokens * k
    group = jnp.asarray(np.sort(rng.integers(0, E, size=A)), jnp.int32)
    x = jnp.asarray(rng.normal(size=(A, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(E, D, FE)), jnp.float32)
    m, n_tiles = tile_rows(A, E)

    def grouped(x, w, group):
        _, dest, tile_group = group_layout(group, E, m, n_tiles)
        rows = jnp.zeros((n_tiles * m, D), x.dtype).at[dest].set(x).reshape(n_tiles, m, D)
        return expert_linear(rows, w, tile_group).reshape(-1, FE)[dest]

    def ragged(x, w, group):
        sizes = jnp.zeros((E,), jnp.int32).at[group].add(1)
        return jax.lax.ragged_dot(x, w, sizes)

    res = {"tokens": tokens, "num_experts": E, "rows": A, "tile_rows": m, "tiles": n_tiles}
    args = (x, w, group)
    want = jax.jit(ragged)(*args)
    np.testing.assert_allclose(jax.jit(grouped)(*args), want, rtol=2e-4, atol=2e-3)
    variants = [("grouped", grouped, args), ("ragged_dot", ragged, args)]
    if cpu_kernels.available():
        # the native grouped matmul reads each expert's rows against its weight in place
        # from a packed stack (one kernel call), instead of XLA's gather of the tiles' weights
        packed = LayerView(_native_stack(w[None]), jnp.asarray(0, jnp.int32))

        def native(x, packed, group):
            _, dest, tile_group = group_layout(group, E, m, n_tiles)
            rows = jnp.zeros((n_tiles * m, D), x.dtype).at[dest].set(x).reshape(n_tiles, m, D)
            return expert_linear(rows, packed, tile_group).reshape(-1, FE)[dest]

        np.testing.assert_allclose(jax.jit(native)(x, packed, group), want, rtol=2e-4, atol=2e-3)
        variants.append(("native", native, (x, packed, group)))
    for name, fn, a in variants:
        f = jax.jit(fn)
        res[f"{name}_flops"] = f.lower(*a).compile().cost_analysis()["flops"]
        res[f"{name}_ms"] = 1e3 * _timed(f, *a)
    return res


def _checkpoint(folder: Path, arch: str) -> Path:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import make_checkpoint

    common = dict(
        vocab_size=49152,
        hidden_size=D,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.05,
    )
    if arch == "mixtral":
        return make_checkpoint(
            folder, "mixtral", num_local_experts=8, intermediate_size=FE, **common
        )
    return make_checkpoint(folder, "llama", intermediate_size=2 * FE, **common)


def workload(reps: int) -> dict:
    from pagedjax import LLM, SamplingParams

    reqs = load_workload()
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True) for r in reqs
    ]
    n_out = sum(r["output_len"] for r in reqs)
    tmp = Path(tempfile.mkdtemp())
    llms = {
        name: LLM(
            str(_checkpoint(tmp / name, name)),
            dtype="float32",
            max_model_len=1024,
            skip_tokenizer_init=True,
            use_tqdm_on_load=False,
            disable_log_stats=True,
        )
        for name in ("mixtral", "llama")
    }
    for llm in llms.values():  # compile the step shapes outside the timed runs
        llm.generate(prompts, params, use_tqdm=False)
    times: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(reps):
        for name, llm in llms.items():  # alternating
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - t0)
    return {
        "requests": len(reqs),
        "output_tokens": n_out,
        "reps": reps,
        **{f"{name}_output_tokens_per_s": n_out / median(ts) for name, ts in times.items()},
        "models": "4 layers, D=256, 4 heads / 2 KV heads, vocab 49152, float32; "
        "mixtral: 8 experts of Fe=512, top-2; llama: F=1024 (same active MLP parameters)",
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/moe.json")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip-workload", action="store_true")
    ap.add_argument(
        "--layers", type=int, default=8, help="layers per call in the cold-weights sweep"
    )
    ns = ap.parse_args(argv)
    result = {
        "environment": environment(),
        "experts_sweep": [
            row
            for backend in ("native", "xla")
            if backend == "xla" or cpu_kernels.available()
            for layers in sorted({1, ns.layers})
            for tokens in (16, 64, 512)
            for row in experts_sweep(tokens, backend, layers=layers)
        ],
        "grouped_vs_ragged_dot": [grouped_vs_ragged(t) for t in (1, 8, 32, 256)],
    }
    if not ns.skip_workload:
        result["workload"] = workload(ns.reps)
    Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ns.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1))
    return result


if __name__ == "__main__":
    main()
