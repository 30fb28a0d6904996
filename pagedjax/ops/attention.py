"""Ragged paged attention: the one entry point the model calls, dispatching to a backend.

A step's batch is flat and ragged: the query tokens of all S sequences lie back to back,
sequence s owning tokens `query_start_loc[s] : query_start_loc[s + 1]` (decode: one token;
prefill chunk: many). Each query token attends causally to every KV token of its own
sequence up to and including its own position, read from the paged cache through the
sequence's block table. The new tokens' K/V are already in the cache when this is called.

Two options of some model families, in every implementation:
    sliding window    (Mistral, Qwen2, Gemma 2/3 local layers) a query at position p sees
                      only the KV positions j with p - window < j <= p: `window` tokens,
                      itself included, as Hugging Face's sliding-window mask
                      (`kv_idx > q_idx - sliding_window` on top of the causal mask). The
                      window may be traced (Gemma 3 scans over layers with a window per
                      layer; 0 there means full attention). The fast paths start their KV
                      loops at the first block a window reaches instead of masking from 0.
    logit soft-cap    (Gemma 2) scores = cap * tanh(scores / cap), after the softmax scale
                      and before the mask and softmax; a static Python float.
Off (None) they cost nothing: the reference, XLA and Pallas paths trace no window or cap
code, and the native kernel reads a window operand of 0 (a scalar test per work item). A
traced window costs its mask and loop-bound arithmetic even when its value is 0.

Implementations (all share `tests/test_attention.py`):
    "reference"  `paged_attention_ref`: dense, per token, obviously right, memory-hungry.
    "xla"        `paged_attention_xla`: flash-style online softmax over KV chunks in XLA loops;
                 runs anywhere, sharded or not.
    "cpu"        `cpu_attention.paged_attention`: a native C++ kernel (an XLA FFI custom
                 call) that reads pages in place; the fast path on one CPU device. It
                 concerns attention only: whether the linear layers run on weights
                 pre-packed for the native `cpu_linear.matmul` is the engine's separate
                 `linear_backend` setting.
    "pallas"     `paged_attention_pallas`: the Pallas kernel (GPU; `interpret=True` on CPU).

The step metadata the implementations share lives in `attention_metadata`; the
implementations import it from there and never this module, which imports them.
"""

from __future__ import annotations

import jax

from pagedjax.ops.attention_metadata import (
    METADATA_FIELDS,
    AttentionMetadata,
    check_sliding_window,
    check_soft_cap,
)
from pagedjax.ops.choices import ATTENTION_BACKENDS as BACKENDS

# The metadata is re-exported: the model and the engine import it from here, with the entry point.
__all__ = ["BACKENDS", "METADATA_FIELDS", "AttentionMetadata", "ragged_paged_attention"]


def ragged_paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    backend: str = "xla",
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    sliding_window: jax.Array | int | None = None,
    logit_soft_cap: float | None = None,
) -> jax.Array:
    """Causal attention of each query token over its own sequence's paged KV.

    Args:
        q: [T, N, H] queries (RoPE applied).
        k_cache, v_cache: [L, num_blocks, block_size, K, H]; N must be a multiple of K (GQA:
            query head n reads KV head n // (N // K); K/V are never repeated in memory).
        layer: scalar index into the L axis.
        md: the step's `AttentionMetadata`.
        sm_scale: softmax scale, usually 1 / sqrt(H).
        backend: "reference", "xla", "cpu" or "pallas".
        k_scale, v_scale: for a quantized cache (e.g. float8_e4m3fn), the scalar float32
            scales of this layer's K and V: a cached value means `value * scale`. None for
            a cache in the compute dtype.
        sliding_window: attend to the last `sliding_window` positions only, the query's own
            included: a query at position p sees KV positions j with
            p - sliding_window < j <= p (Hugging Face's convention for Mistral, Qwen2 and
            Gemma 2/3). A Python int, or an int32 scalar array that may be traced (a
            per-layer window inside a scan over layers). None or a value <= 0: full causal
            attention; a window longer than the context changes nothing.
        logit_soft_cap: Gemma 2's attention-logit soft-capping: the scaled scores become
            cap * tanh(scores / cap) before the mask and softmax. None (no cap) or a
            positive Python float (static: it selects code at trace time).

    Returns:
        [T, N, H] in q's dtype; rows of padding tokens are zero.

    Raises:
        ValueError: unknown backend, N not a multiple of K, a window that is not an integer
            scalar, or a cap that is not a positive Python number.
    """
    if q.shape[1] % k_cache.shape[3]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k_cache.shape[3]})"
        )
    sliding_window = check_sliding_window(sliding_window)
    logit_soft_cap = check_soft_cap(logit_soft_cap)
    extra = dict(sliding_window=sliding_window, logit_soft_cap=logit_soft_cap)
    if backend == "reference":
        from pagedjax.ops.paged_attention_ref import paged_attention_reference as impl
    elif backend == "xla":
        from pagedjax.ops.paged_attention_xla import paged_attention_xla as impl
    elif backend == "cpu":
        from pagedjax.ops.cpu_attention import paged_attention

        out = paged_attention(
            q,
            k_cache,
            v_cache,
            layer,
            md.seq_lens,
            md.query_start_loc,
            md.block_tables,
            sm_scale=sm_scale,
            k_scale=k_scale,
            v_scale=v_scale,
            **extra,
        )
        return out.astype(q.dtype)
    elif backend == "pallas":
        from pagedjax.ops.paged_attention_pallas import paged_attention_pallas as impl
    else:
        raise ValueError(f"attention backend {backend!r} is unknown; choose one of {BACKENDS}")
    return impl(
        q, k_cache, v_cache, layer, md, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, **extra
    )
