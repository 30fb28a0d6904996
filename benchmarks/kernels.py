"""Ragged paged-attention kernels against each other: time, bytes/s, FLOP/s, share of peak.

    python -m benchmarks.kernels [--out benchmarks/results/kernels-gpu.json] [--quick]
        [--batch-sizes 1,64] [--context-lens 512,2048,8192] [--query-lens 1,16,128]
        [--num-heads 32 --num-kv-heads 8 --head-dim 128 --block-size 16 --dtype bfloat16]
    python -m benchmarks.kernels --plot-only FILE.json     # the PNG from an earlier JSON

Implementations: "pallas" (ops/paged_attention_pallas.py; interpreted on CPU), "xla"
(ops/paged_attention_xla.py), "cpu" (ops/cpu_attention.py, the native C++ kernel; CPU only),
"reference" (ops/paged_attention_ref.py; skipped where its dense
gather would pass `--reference-max-gib`), and on a GPU JAX's own decode-only kernel
`jax.experimental.pallas.ops.gpu.paged_attention` ("jax_decode", query length 1 only; it is
skipped on CPU, where only its interpreter would run).

A case is `batch` sequences, each with `context_len` KV tokens after the step of which the
last `query_len` are this step's queries (the rest is cached prefix), pages scattered at random
over the pool. Each timed call runs `--reps` times inside one jitted `fori_loop` whose next
query depends on the last output (nothing hoisted, one dispatch; fewer reps when one call
takes long); the best of `--trials` is reported per call. Defaults: the sizes above on a GPU,
bfloat16, 32 query / 8 KV heads of 128 (Llama-3-8B's attention); smaller ones, float32, on CPU.

Bytes are the least traffic a kernel needs: every sequence's K and V pages once, q read and the
output written once. FLOPs are 4 * N * H per (query token, attended key) pair (QK^T and PV).
The device's peak bandwidth is measured in the same run with a device-to-device copy and a
streaming `x ^ 1` over a large buffer (bytes read + written / time) and a row sum of it (bytes
read / time); the largest of the three is the peak, and each kernel's bytes/s is reported as a
fraction of it. (On CPU the copy and `x ^ 1` write into memory the client maps afresh for every
call, so their page faults, not the memory, set their speed: 5-8 GB/s where the row sum reads
35-80 GB/s on a 2-vCPU Zen 5 VM. The paged-attention kernels mostly read, as the row sum does;
a case whose pages fit in the last-level cache, 32 MiB there, can pass 100 % of it.)

Writes JSON (environment, configuration, peak, one row per implementation and case) and a PNG
plot next to it when matplotlib is importable (the GPU machine may lack it: `--plot-only`
makes the plot later, anywhere).
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings
from pathlib import Path

from benchmarks.common import HERE, environment

IMPLS = ("pallas", "xla", "cpu", "reference", "jax_decode")


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def measure_peak_bandwidth(gib: float, trials: int) -> dict:
    """Device-to-device copy and `x ^ 1` over `gib` GiB (bytes read + written per second) and
    a sum of its 4 KiB rows (bytes read per second): the best of each, and the largest as
    `peak_bytes_per_s`."""
    import jax
    import jax.numpy as jnp

    n = int(gib * 2**30) // 4 // 1024 * 1024
    x = jax.block_until_ready(jnp.arange(n, dtype=jnp.uint32))  # [n]
    out = {"buffer_bytes": 4 * n}
    cases = (
        ("copy", jax.jit(jnp.copy), 2),
        ("xor", jax.jit(lambda a: a ^ 1), 2),
        ("read", jax.jit(lambda a: jnp.sum(a.reshape(-1, 1024), axis=1)), 1),
    )
    for name, fn, passes in cases:
        jax.block_until_ready(fn(x))
        best = math.inf
        for _ in range(trials):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(x))
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_bytes_per_s"] = passes * 4 * n / best
    out["peak_bytes_per_s"] = max(out[f"{name}_bytes_per_s"] for name, _, _ in cases)
    del x
    return out


def make_case(batch, context_len, query_len, *, heads, kv_heads, head_dim, block_size, dtype, seed):
    """Random q, one-layer K/V pool and the step's metadata for one benchmark case."""
    import jax.numpy as jnp
    import numpy as np

    from pagedjax.executor.input_batch import BatchBuilder, SeqInput
    from pagedjax.executor.model_runner import KV_CHUNK_TOKENS, QUERY_TILE_SIZE
    from pagedjax.ops.attention import AttentionMetadata

    rng = np.random.default_rng(seed)
    pages = -(-context_len // block_size)
    num_blocks = 1 + batch * pages
    perm = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    seqs = [
        SeqInput(
            np.zeros(query_len, np.int32),
            context_len - query_len,
            perm[s * pages : (s + 1) * pages],
        )
        for s in range(batch)
    ]
    builder = BatchBuilder(
        max_num_batched_tokens=batch * query_len,
        max_num_seqs=batch,
        max_model_len=context_len,
        block_size=block_size,
        query_tile_size=QUERY_TILE_SIZE,
        kv_chunk_pages=max(1, KV_CHUNK_TOKENS // block_size),
    )
    layout, buf = builder.build(seqs)
    a = layout.unpack(buf.copy())
    fields = AttentionMetadata.__dataclass_fields__
    md = AttentionMetadata(
        **{f: jnp.asarray(a[f]) for f in fields if f in a},
        query_tile_size=builder.query_tile_size,
        kv_chunk_pages=builder.kv_chunk_pages,
    )
    shape = (1, num_blocks, block_size, kv_heads, head_dim)
    k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
    T = layout.num_tokens
    q = jnp.asarray(rng.standard_normal((T, heads, head_dim), np.float32), dtype)
    return q, k, v, md, perm[: batch * pages].reshape(batch, pages)


def _impl_fn(name, q, k, v, md, table, context_len):
    """(fn(q) -> [T, N, H], skip reason or None) for one implementation on one case."""

    from pagedjax.ops.attention import ragged_paged_attention

    H = q.shape[2]
    import jax

    if name == "cpu" and jax.default_backend() != "cpu":
        return None, "CPU only (an XLA CPU custom call)"
    if name != "jax_decode":

        def fn(q):
            return ragged_paged_attention(q, k, v, 0, md, sm_scale=H**-0.5, backend=name)

        return fn, None
    if jax.default_backend() != "gpu":
        return None, "GPU only (on CPU only its interpreter would run)"
    if q.shape[0] != table.shape[0]:
        return None, "decode only (query length 1)"
    return jax_decode_fn(k, v, table, context_len, H), None


def jax_decode_fn(k, v, table, context_len, head_dim, interpret=False):
    """fn(q) -> [S, N, H] through `jax.experimental.pallas.ops.gpu.paged_attention`."""
    import jax.numpy as jnp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
    # Its block table needs k_splits partitions of whole compute blocks: pad with null pages.
    k_splits = 16
    per_split = -(-table.shape[1] // k_splits)
    if per_split > 8:
        per_split = -(-per_split // 8) * 8
    pages_per_compute_block = min(8, per_split)
    cols = per_split * k_splits
    tables = jnp.pad(jnp.asarray(table), ((0, 0), (0, cols - table.shape[1])))  # [S, cols]
    k_pages = jnp.transpose(k[0], (2, 0, 1, 3))  # [K, num_blocks, block_size, H]
    v_pages = jnp.transpose(v[0], (2, 0, 1, 3))
    lengths = jnp.full((table.shape[0],), context_len, jnp.int32)  # [S]

    def fn(q):  # it applies no softmax scale: pass q / sqrt(H)
        return paged_attention(
            q * jnp.asarray(head_dim**-0.5, q.dtype),
            k_pages,
            v_pages,
            tables,
            lengths,
            k_splits=k_splits,
            pages_per_compute_block=pages_per_compute_block,
            interpret=interpret,
        )

    return fn


def time_fn(fn, q, reps: int, trials: int, budget_s: float = 0.5) -> tuple[float, object]:
    """Best seconds per call of `fn(q)` over `trials` runs of up to `reps` chained calls (fewer
    when one call is slow: a run aims at `budget_s`)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def loop(q, n):
        def body(_, carry):
            q, _ = carry
            o = fn(q)
            return q + (o[0, 0, 0] * 0).astype(q.dtype), o

        return jax.lax.fori_loop(0, n, body, (q, jnp.zeros_like(q)))[1]

    out = jax.block_until_ready(loop(q, 1))  # compiles
    t0 = time.perf_counter()
    jax.block_until_ready(loop(q, 1))
    n = max(1, min(reps, int(budget_s / (time.perf_counter() - t0))))
    best = math.inf
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(q, n))
        best = min(best, (time.perf_counter() - t0) / n)
    return best, out


def case_costs(batch, context_len, query_len, heads, kv_heads, head_dim, itemsize):
    """(bytes, flops) of one case: K/V once, q and output once; 4 N H per attended pair."""
    kv = 2 * batch * context_len * kv_heads * head_dim * itemsize
    qo = 2 * batch * query_len * heads * head_dim * itemsize
    pairs = batch * sum(context_len - query_len + i + 1 for i in range(query_len))
    return kv + qo, 4 * heads * head_dim * pairs


def run(args) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    on_gpu = jax.default_backend() == "gpu"
    peak = measure_peak_bandwidth(args.peak_gib or (4.0 if on_gpu else 0.25), args.trials)
    print(
        f"peak: copy {peak['copy_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"xor {peak['xor_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"read {peak['read_bytes_per_s'] / 1e9:.1f} GB/s"
    )
    dtype = jnp.dtype(args.dtype)
    rows = []
    for batch in args.batch_sizes:
        for ctx in args.context_lens:
            for ql in args.query_lens:
                if ql > ctx:
                    continue
                q, k, v, md, table = make_case(
                    batch,
                    ctx,
                    ql,
                    heads=args.num_heads,
                    kv_heads=args.num_kv_heads,
                    head_dim=args.head_dim,
                    block_size=args.block_size,
                    dtype=dtype,
                    seed=0,
                )
                nbytes, flops = case_costs(
                    batch,
                    ctx,
                    ql,
                    args.num_heads,
                    args.num_kv_heads,
                    args.head_dim,
                    dtype.itemsize,
                )
                T = batch * ql
                ref_gib = 8 * T * md.block_tables.shape[1] * args.block_size * args.num_kv_heads
                ref_gib = ref_gib * args.head_dim / 2**30  # its float32 K and V gathers
                base = None
                for name in args.impls:
                    row = dict(
                        impl=name,
                        batch=batch,
                        context_len=ctx,
                        query_len=ql,
                        bytes=nbytes,
                        flops=flops,
                    )
                    fn, skip = _impl_fn(name, q, k, v, md, table, ctx)
                    if name == "reference" and ref_gib > args.reference_max_gib:
                        skip = f"its dense gather needs {ref_gib:.1f} GiB"
                    if skip:
                        rows.append({**row, "skipped": skip})
                        continue
                    try:
                        sec, out = time_fn(fn, q, args.reps, args.trials)
                    except Exception as e:  # one failing implementation must not end the run
                        rows.append({**row, "error": f"{type(e).__name__}: {e}"[:2000]})
                        print(f"{name:>10} b={batch} ctx={ctx} q={ql} failed: {e}", flush=True)
                        continue
                    out = np.asarray(out[:T].astype(jnp.float32))
                    if base is None:
                        base = out
                    row.update(
                        time_s=sec,
                        bytes_per_s=nbytes / sec,
                        flops_per_s=flops / sec,
                        fraction_of_peak_bandwidth=nbytes / sec / peak["peak_bytes_per_s"],
                        max_abs_diff_vs_first=float(np.abs(out - base).max()),
                    )
                    rows.append(row)
                    print(
                        f"{name:>10} b={batch:<4} ctx={ctx:<6} q={ql:<4} "
                        f"{sec * 1e6:10.1f} us {nbytes / sec / 1e9:8.1f} GB/s "
                        f"{flops / sec / 1e12:7.2f} TFLOP/s "
                        f"{row['fraction_of_peak_bandwidth']:6.1%} of peak "
                        f"diff {row['max_abs_diff_vs_first']:.1e}",
                        flush=True,
                    )
    return {
        "environment": environment(),
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "plot_only")},
        "peak": peak,
        "results": rows,
    }


def plot(result: dict, path: Path) -> None:
    """Bars of bytes/s per case and implementation, one panel per query length, and the
    measured peak as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["results"] if "time_s" in r]
    qls = sorted({r["query_len"] for r in rows})
    impls = [i for i in IMPLS if any(r["impl"] == i for r in rows)]
    fig, axes = plt.subplots(len(qls), 1, figsize=(10, 3.2 * len(qls)), squeeze=False)
    for ax, ql in zip(axes[:, 0], qls, strict=True):
        cases = sorted({(r["batch"], r["context_len"]) for r in rows if r["query_len"] == ql})
        width = 0.8 / max(len(impls), 1)
        for j, impl in enumerate(impls):
            got = {
                (r["batch"], r["context_len"]): r["bytes_per_s"] / 1e9
                for r in rows
                if r["query_len"] == ql and r["impl"] == impl
            }
            xs = [i + j * width for i, c in enumerate(cases) if c in got]
            ax.bar(xs, [got[c] for c in cases if c in got], width, label=impl)
        ax.axhline(
            result["peak"]["peak_bytes_per_s"] / 1e9,
            color="k",
            ls="--",
            lw=1,
            label="measured peak",
        )
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels([f"b{b} ctx{c}" for b, c in cases], fontsize=8)
        ax.set_yscale("log")
        ax.set_ylabel("GB/s (log)")
        ax.set_title(f"query length {ql}")
        ax.legend(fontsize=7)
    env = result["environment"]
    fig.suptitle(
        f"ragged paged attention, {result['config']['dtype']}, {env['devices'][0]}, "
        f"jax {env['jax']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    import jax

    on_gpu = jax.default_backend() == "gpu"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    p.add_argument("--plot-only", default=None, help="make the PNG of this JSON and stop")
    p.add_argument("--quick", action="store_true", help="one small case per query length")
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--batch-sizes", type=_ints, default=[1, 64] if on_gpu else [1, 8])
    p.add_argument(
        "--context-lens", type=_ints, default=[512, 2048, 8192] if on_gpu else [256, 1024]
    )
    p.add_argument("--query-lens", type=_ints, default=[1, 16, 128] if on_gpu else [1, 16])
    p.add_argument("--num-heads", type=int, default=32 if on_gpu else 8)
    p.add_argument("--num-kv-heads", type=int, default=8 if on_gpu else 2)
    p.add_argument("--head-dim", type=int, default=128 if on_gpu else 64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16" if on_gpu else "float32")
    p.add_argument("--reps", type=int, default=50 if on_gpu else 2)
    p.add_argument("--trials", type=int, default=3 if on_gpu else 2)
    p.add_argument("--peak-gib", type=float, default=None)
    p.add_argument("--reference-max-gib", type=float, default=16.0 if on_gpu else 1.0)
    args = p.parse_args(argv)
    if args.plot_only:
        src = Path(args.plot_only)
        plot(json.loads(src.read_text()), src.with_suffix(".png"))
        return
    if args.quick:
        args.batch_sizes, args.context_lens = args.batch_sizes[-1:], args.context_lens[:1]
    args.impls = [i for i in args.impls.split(",") if i]
    if unknown := set(args.impls) - set(IMPLS):
        p.error(f"unknown implementations {sorted(unknown)}; choose from {IMPLS}")
    out = Path(args.out or HERE / "results" / f"kernels-{jax.default_backend()}.json")
    result = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    try:
        plot(result, out.with_suffix(".png"))
        print(f"wrote {out.with_suffix('.png')}")
    except ImportError:
        print("matplotlib is missing: no plot (run --plot-only on the JSON elsewhere)")


if __name__ == "__main__":
    main()
