"""Mixture-of-experts cost: the MoE block for 8, 16, 32 experts at top-2, the grouped matmul
against `jax.lax.ragged_dot`, and a tiny MoE model against a dense one of the same active
parameters on the standard workload.

    python -m benchmarks.moe [--out benchmarks/results/moe.json] [--skip-workload]

1. Experts sweep: `models.moe_layer.moe_block` (router included) at fixed top-2 and fixed
   active parameters (D=256, Fe=512 per expert) for E = 8, 16, 32, at a decode-sized step
   (T=16 tokens) and a prefill-sized one (T=512): XLA's cost-analysis FLOPs of the compiled
   block and its median wall time. The goal: the 32-expert block costs at most 1.5x the
   8-expert one.
2. One expert matmul of sorted rows three ways: the grouped matmul (XLA: each tile's expert
   weight gathered, a batched dot), `jax.lax.ragged_dot` (on XLA's CPU backend it computes
   every expert over every row, FLOPs x E), and the native CPU matmul (`ops.cpu_linear`, one
   call per tile reading the tile's expert in place from a packed stack), at decode-sized
   (1, 8, 32 tokens) and prefill-sized (256) steps.
3. Workload: random Mixtral (8 experts, top-2, Fe = 512) and Llama (F = 1024: the same active
   MLP parameters) checkpoints, 4 layers, D = 256, SmolLM2's vocabulary size, through the
   engine on `workloads/standard.json`'s request shapes (64 requests, greedy, EOS ignored);
   output tokens per second, A and B alternating.
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

D, FE = 256, 512


def _timed(fn, *args, reps: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return median(times)


def experts_sweep(tokens: int, k: int = 2, reps: int = 20) -> list[dict]:
    """The MoE block (router included) for E = 8, 16, 32: FLOPs, and wall times taken
    interleaved (one call of each E per round) so that a busy machine slows all alike."""
    from pagedjax.models.moe_layer import moe_block, route

    rng = np.random.default_rng(0)

    def block(w, router, x):
        ids, weights = route(x, router, k, True)
        return moe_block(w, x, ids, weights)

    runs = []
    for E in (8, 16, 32):
        w = {
            "experts_gate": jnp.asarray(rng.normal(0, 0.05, (E, D, FE)), jnp.float32),
            "experts_up": jnp.asarray(rng.normal(0, 0.05, (E, D, FE)), jnp.float32),
            "experts_down": jnp.asarray(rng.normal(0, 0.05, (E, FE, D)), jnp.float32),
        }
        router = jnp.asarray(rng.normal(0, 0.05, (D, E)), jnp.float32)
        x = jnp.asarray(rng.normal(size=(tokens, D)), jnp.float32)
        fn = jax.jit(block)
        flops = fn.lower(w, router, x).compile().cost_analysis()["flops"]
        jax.block_until_ready(fn(w, router, x))
        runs.append((E, fn, (w, router, x), flops, []))
    for _ in range(reps):
        for _, fn, args, _, times in runs:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - t0)
    out = [
        dict(
            num_experts=E,
            tokens=tokens,
            top_k=k,
            flops=flops,
            active_flops=2 * 3 * tokens * k * D * FE,
            step_ms=1e3 * median(times),
        )
        for E, _, _, flops, times in runs
    ]
    base = out[0]
    for r in out:
        r["flops_vs_8"] = r["flops"] / base["flops"]
        r["time_vs_8"] = r["step_ms"] / base["step_ms"]
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
        # the native matmul reads each tile's expert in place from a packed [E, D, Fe] stack
        # (one kernel call per tile), instead of XLA's gather of the tiles' weights
        packed = jax.jit(cpu_linear.pack)(w)

        def native(x, packed, group):
            _, dest, tile_group = group_layout(group, E, m, n_tiles)
            rows = jnp.zeros((n_tiles * m, D), x.dtype).at[dest].set(x).reshape(n_tiles, m, D)
            y = jax.lax.map(lambda t: cpu_linear.matmul(t[0], packed, t[1]), (rows, tile_group))
            return y.reshape(-1, FE)[dest]

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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/moe.json")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--skip-workload", action="store_true")
    ns = ap.parse_args(argv)
    result = {
        "environment": environment(),
        "experts_sweep": experts_sweep(16) + experts_sweep(512),
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
