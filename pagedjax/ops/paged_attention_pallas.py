"""Ragged paged attention as one Pallas kernel: decode tokens and prefill chunks in one call.

Backend: the Pallas **Triton** backend (`jax.experimental.pallas.triton`), chosen explicitly by
passing its `CompilerParams`. It is the one Pallas GPU backend that lowers under both JAX
versions of this project (jax 0.10 here, jax 0.11 on the GPU machine), that Triton builds for
GPUs from sm_80 on (fp8 casts: sm_89 on), and in which gathers from a page pool are plain
indexing. JAX deprecates it (jax 0.11 warns at each lowering); Mosaic GPU, its successor, needs
sm_90 and a different, explicitly pipelined programming model. The kernel
is reached only through `ops.attention.ragged_paged_attention(backend="pallas")` with the
signature every implementation shares, so a Mosaic GPU or jax-triton (`triton_call`) version
can replace this file without touching a caller. On CPU it runs with `interpret=True`.

Algorithm (flash attention with an online softmax, after Dao et al., "FlashAttention", 2022;
the flat ragged layout and the packing of a GQA group into the rows of one tile follow vLLM's
unified Triton attention kernel):

- The flat batch of T query tokens is cut into *query blocks* of `BQ` consecutive tokens of
  one sequence (`_query_blocks`, a few small jnp ops on the metadata, in XLA). The padding
  tokens after the last sequence form one more pseudo-sequence with no KV, so their rows come
  out zero without a separate pass.
- Grid (query blocks, KV heads). A program takes the `BQ` tokens of its block times the `G`
  query heads that share its KV head: `BLOCK_M = BQ * G` rows (row r is token r // G,
  head r % G; rows beyond it are padding), so K/V are read once per group, never repeated.
- It walks its sequence's block table `kv_step_tokens` at a time (whole pages, gathered from
  the page pool by indexing inside the kernel), up to the last position of its block, and
  keeps a running max, denominator and accumulator in float32. Each key position is masked
  causally against each row's own position, so decode rows, prefill rows and a prefill
  chunk's cached prefix are the same case.
- fp8 pages are cast to the compute dtype after the load; the scalar K scale is folded into
  the softmax scale and the V scale is applied to the output.
- Sliding window (a runtime scalar beside the layer index, so it may be traced): the walk
  starts at the step holding the first position the window of the block's first row reaches,
  and each row masks the positions before its own window. Logit soft-cap (static): the
  scaled scores become cap * tanh(scores / cap) before the mask. Without them (None) the
  kernel traces none of this (the window operand is then 0, unread).

KV cache layout: the engine's `[L, num_blocks, block_size, K, H]` is read as is (a token's H
values are contiguous; a head-major page layout `[L, num_blocks, K, block_size, H]` would give
the loads longer contiguous runs, but the kernel does not need it).

Constraints (Triton wants power-of-two tensor sizes): head dim H and block_size powers of two,
H >= 16 (`unsupported_reason`; `attention_backend="auto"` falls back to "xla" on a GPU when
the model breaks them); q in float32, bfloat16 or float16; K/V in one float dtype (or fp8 with
scales).
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pagedjax.ops.attention_metadata import AttentionMetadata, soft_cap, window_start

_NEG = -1e30  # finite "minus infinity": keeps the online softmax free of inf - inf
Q_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_block_m(num_tokens: int, num_seqs: int, group: int) -> int:
    """Rows per program: 16 (the smallest MMA tile) when the step may be all decode, i.e. when
    the token bucket holds no more tokens than sequences; 64 for prefill-sized buckets. Never
    fewer than one GQA group (rounded up to a power of two). Untuned on a GPU."""
    rows = 16 if num_tokens <= num_seqs else 64
    return max(rows, _next_pow2(group))


def default_kv_step_tokens(head_dim: int, block_size: int) -> int:
    """KV tokens per inner step: 16 KiB of bf16 K per step (64 tokens at H=128, 128 at H=64),
    capped at 128 tokens, and at least one page. Untuned on a GPU."""
    return max(block_size, min(128, 8192 // head_dim))


def _query_blocks(md: AttentionMetadata, num_tokens: int, block_q: int) -> jax.Array:
    """The query blocks of the step, one row each: [NQB, 4] int32 of
    (block-table row, first flat token, number of tokens, position of the first token).

    Sequence s owns tokens query_start_loc[s] : query_start_loc[s + 1]; its last token sits at
    position seq_lens[s] - 1. The padding tokens after the last sequence form a pseudo-sequence
    with KV length 0 (positions < 0: they attend to nothing and come out zero). Rows past the
    last block have 0 tokens. NQB = floor((T + min(S + 1, T) * (BQ - 1)) / BQ) bounds the
    number of blocks for any split of T tokens over S + 1 sequences.
    """
    T = num_tokens
    S = md.seq_lens.shape[0]
    qsl = md.query_start_loc  # [S + 1]
    total = qsl[S]
    q_lens = jnp.concatenate([qsl[1:] - qsl[:-1], (T - total)[None]])  # [S + 1]
    kv_lens = jnp.concatenate([md.seq_lens, jnp.zeros((1,), jnp.int32)])  # [S + 1]
    n_blocks = (q_lens + block_q - 1) // block_q  # [S + 1]
    ends = jnp.cumsum(n_blocks)  # [S + 1]
    nqb = (T + min(S + 1, T) * (block_q - 1)) // block_q
    i = jnp.arange(nqb, dtype=jnp.int32)  # [NQB]
    seq = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)  # [NQB]; S + 1: unused
    used = seq <= S
    seq = jnp.minimum(seq, S)
    j = i - (ends[seq] - n_blocks[seq])  # block index within its sequence
    q_start = qsl[seq] + j * block_q
    q_len = jnp.where(used, jnp.clip(q_lens[seq] - j * block_q, 0, block_q), 0)
    first_pos = kv_lens[seq] - q_lens[seq] + j * block_q
    table_row = jnp.minimum(seq, S - 1)
    return jnp.stack([table_row, q_start, q_len, first_pos], axis=1).astype(jnp.int32)


def _kernel(
    blocks_ref,  # [NQB, 4] int32 (table row, first token, tokens, first position)
    layer_ref,  # [2] int32 (layer, sliding window: <= 0 for none)
    scales_ref,  # [2] float32 (sm_scale * k_scale, v_scale)
    tables_ref,  # [S, B'] int32, B' a multiple of pages_per_step
    q_ref,  # [T, N, H]
    k_ref,  # [L, num_blocks, block_size, K, H]
    v_ref,  # [L, num_blocks, block_size, K, H]
    o_ref,  # [T + BLOCK_M, N, H]; rows >= T are scratch for padding rows of a tile
    *,
    group: int,
    block_m: int,
    pages_per_step: int,
    compute_dtype,
    windowed: bool,
    logit_soft_cap: float | None,
):
    i = pl.program_id(0)
    kv_head = pl.program_id(1)
    num_tokens = q_ref.shape[0]
    block_size, head_dim = k_ref.shape[2], k_ref.shape[4]
    step = pages_per_step * block_size  # C, KV tokens per inner step
    seq = blocks_ref[i, 0]
    q_start = blocks_ref[i, 1]
    q_len = blocks_ref[i, 2]
    first_pos = blocks_ref[i, 3]

    @pl.when(q_len > 0)
    def _():
        layer = layer_ref[0]
        qk_scale = scales_ref[0]
        v_scale = scales_ref[1]
        row = jnp.arange(block_m, dtype=jnp.int32)  # [BLOCK_M]
        tok = row // group  # token of the row within the block
        heads = kv_head * group + row % group  # [BLOCK_M] query head of the row
        valid = tok < q_len  # [BLOCK_M]
        out_row = jnp.where(valid, q_start + tok, num_tokens + row)  # [BLOCK_M]
        q = q_ref[jnp.minimum(out_row, num_tokens - 1), heads, :]  # [BLOCK_M, H]
        q = q.astype(compute_dtype)
        q_pos = first_pos + tok  # [BLOCK_M]
        kv_end = first_pos + q_len  # KV tokens the block's last row attends to
        num_steps = jnp.maximum(kv_end + step - 1, 0) // step
        first_step = 0
        if windowed:
            window = layer_ref[1]
            q_lo = window_start(q_pos, window)  # [BLOCK_M] first position each row sees
            first_step = window_start(first_pos, window) // step

        def body(c, carry):
            m, l, acc = carry  # [BLOCK_M], [BLOCK_M], [BLOCK_M, H] float32
            pages = tables_ref[seq, pl.ds(c * pages_per_step, pages_per_step)]  # [P]
            k = k_ref[layer, pages, :, kv_head, :].reshape(step, head_dim)  # [C, H]
            v = v_ref[layer, pages, :, kv_head, :].reshape(step, head_dim)  # [C, H]
            s = jax.lax.dot_general(
                q,
                k.astype(compute_dtype),
                (((1,), (1,)), ((), ())),
                preferred_element_type=jnp.float32,
            )  # [BLOCK_M, C]
            kv_pos = c * step + jnp.arange(step, dtype=jnp.int32)  # [C]
            mask = kv_pos[None, :] <= q_pos[:, None]  # [BLOCK_M, C]
            if windowed:
                mask &= kv_pos[None, :] >= q_lo[:, None]
            s = jnp.where(mask, soft_cap(s * qk_scale, logit_soft_cap), _NEG)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))  # [BLOCK_M]
            p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)  # [BLOCK_M, C]
            alpha = jnp.exp(m - m_new)  # [BLOCK_M]
            # Keys past the sequence end may hold anything (even NaN in a reused fp8 page):
            # zero them so that 0 * garbage cannot reach the accumulator.
            v = jnp.where((kv_pos < kv_end)[:, None], v.astype(compute_dtype), 0)  # [C, H]
            pv = jax.lax.dot_general(
                p.astype(compute_dtype),
                v,
                (((1,), (0,)), ((), ())),
                preferred_element_type=jnp.float32,
            )  # [BLOCK_M, H]
            return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

        init = (
            jnp.full((block_m,), _NEG, jnp.float32),
            jnp.zeros((block_m,), jnp.float32),
            jnp.zeros((block_m, head_dim), jnp.float32),
        )
        _, l, acc = jax.lax.fori_loop(first_step, num_steps, body, init)
        out = acc * (v_scale / jnp.maximum(l, 1e-30))[:, None]  # [BLOCK_M, H]
        o_ref[out_row, heads, :] = out.astype(o_ref.dtype)


def _compute_dtype(q_dtype, kv_dtype):
    """The dtype both matmul operands are cast to: q's when the cache holds the same dtype or
    a 1-byte (fp8) dtype, float32 otherwise."""
    if kv_dtype == q_dtype or jnp.dtype(kv_dtype).itemsize == 1:
        return q_dtype
    return jnp.float32


def unsupported_reason(head_dim: int, block_size: int) -> str | None:
    """Why the kernel cannot take this head dim / block size (None when it can)."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"the pallas kernel needs a power-of-two head dim >= 16, not {head_dim}"
    if block_size < 1 or block_size & (block_size - 1):
        return f"the pallas kernel needs a power-of-two block_size, not {block_size}"
    return None


def _check(q, k_cache, v_cache, sm_scale):
    H = q.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError(
            f"K and V caches differ: {k_cache.shape} {k_cache.dtype} vs "
            f"{v_cache.shape} {v_cache.dtype}"
        )
    if k_cache.ndim != 5 or k_cache.shape[4] != H:
        raise ValueError(f"KV cache {k_cache.shape} is not [L, blocks, block_size, K, {H}]")
    if jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in Q_DTYPES]:
        raise ValueError(f"pallas attention takes float32/bfloat16/float16 queries, not {q.dtype}")
    if not jnp.issubdtype(k_cache.dtype, jnp.floating):
        raise ValueError(f"pallas attention needs a floating-point KV cache, not {k_cache.dtype}")
    if reason := unsupported_reason(H, k_cache.shape[2]):
        raise ValueError(reason)
    if not isinstance(sm_scale, numbers.Real) or not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be a finite Python number, not {sm_scale!r}")


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "logit_soft_cap",
        "block_m",
        "kv_step_tokens",
        "num_warps",
        "num_stages",
        "interpret",
    ),
)
def _pallas_attention(
    q,
    k_cache,
    v_cache,
    layer,
    md,
    k_scale,
    v_scale,
    sliding_window,
    *,
    sm_scale: float,
    logit_soft_cap: float | None,
    block_m: int | None,
    kv_step_tokens: int | None,
    num_warps: int,
    num_stages: int,
    interpret: bool,
):
    T, N, H = q.shape
    K = k_cache.shape[3]
    G = N // K
    S, B = md.block_tables.shape
    block_size = k_cache.shape[2]
    block_m = block_m or default_block_m(T, S, G)
    if block_m < max(16, G) or block_m & (block_m - 1):
        raise ValueError(f"block_m ({block_m}) must be a power of two >= max(16, N // K = {G})")
    block_q = block_m // G
    step = kv_step_tokens or default_kv_step_tokens(H, block_size)
    pages = max(1, step // block_size)
    if pages & (pages - 1):
        raise ValueError(f"kv_step_tokens ({step}) must be a power-of-two number of pages")
    tables = md.block_tables  # [S, B]
    if B % pages:
        tables = jnp.pad(tables, ((0, 0), (0, pages - B % pages)))  # [S, B'] null-block pad
    blocks = _query_blocks(md, T, block_q)  # [NQB, 4]
    window = 0 if sliding_window is None else sliding_window
    layer = jnp.stack(
        [jnp.asarray(x, jnp.int32).reshape(()) for x in (layer, window)]
    )  # [2] (layer, window)
    k_scale = 1.0 if k_scale is None else k_scale
    v_scale = 1.0 if v_scale is None else v_scale
    scales = jnp.stack(
        [
            jnp.float32(sm_scale) * jnp.asarray(k_scale, jnp.float32).reshape(()),
            jnp.asarray(v_scale, jnp.float32).reshape(()),
        ]
    )  # [2]
    kernel = functools.partial(
        _kernel,
        group=G,
        block_m=block_m,
        pages_per_step=pages,
        compute_dtype=_compute_dtype(q.dtype, k_cache.dtype),
        windowed=sliding_window is not None,
        logit_soft_cap=logit_soft_cap,
    )
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        kernel,
        grid=(blocks.shape[0], K),
        in_specs=[any_spec] * 7,
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct((T + block_m, N, H), q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention",
    )(blocks, layer, scales, tables, q, k_cache, v_cache)  # [T + BLOCK_M, N, H]
    return out[:T]


def paged_attention_pallas(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    k_scale=None,
    v_scale=None,
    sliding_window=None,
    logit_soft_cap: float | None = None,
    block_m: int | None = None,
    kv_step_tokens: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
) -> jax.Array:
    """See `ops.attention.ragged_paged_attention`. q: [T, N, H] -> [T, N, H] in q's dtype.

    Reads `query_start_loc`, `seq_lens` and `block_tables` of `md` (not its tile fields).

    Args:
        sliding_window, logit_soft_cap: as in `ragged_paged_attention` (the window an int or
            an int32 scalar, may be traced; <= 0 or None: none; the cap a static float).
        block_m: rows per program (a power of two >= 16 and >= N // K; 16 is the smallest
            tile Triton's tensor-core dot takes); default `default_block_m`.
        kv_step_tokens: KV tokens per inner step (a power-of-two number of pages); default
            `default_kv_step_tokens`.
        num_warps, num_stages: Triton launch parameters (ignored when interpreting).
        interpret: run the kernel in Pallas' interpreter; default: when JAX's default
            backend is the CPU.

    Raises:
        ValueError: dtypes, head dim, block size or tile sizes outside the constraints in the
            module docstring.
    """
    _check(q, k_cache, v_cache, sm_scale)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    return _pallas_attention(
        q,
        k_cache,
        v_cache,
        layer,
        md,
        k_scale,
        v_scale,
        sliding_window,
        sm_scale=float(sm_scale),
        logit_soft_cap=None if logit_soft_cap is None else float(logit_soft_cap),
        block_m=block_m,
        kv_step_tokens=kv_step_tokens,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
