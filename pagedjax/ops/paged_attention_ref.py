"""Reference ragged paged attention in plain jnp: the ground truth for the other paths.

Every query token gathers its sequence's whole block table ([B * block_size] KV tokens),
masks what lies after its own position (and, under a sliding window, what lies before its
window) and takes a dense softmax. Simple enough to check
by eye; it materialises [T, B * block_size, K, H], so it is for tests and tiny models.
It derives each token's sequence and position from `query_start_loc` and `seq_lens` alone,
independently of the tile metadata the faster paths use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.ops.attention_metadata import (
    AttentionMetadata,
    dequantize_pages,
    soft_cap,
    window_start,
)


def paged_attention_reference(
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
) -> jax.Array:
    """See `ops.attention.ragged_paged_attention`. q: [T, N, H] -> [T, N, H].

    Every KV position of the block table is scored; the window and the causal limit are one
    mask (no KV is skipped)."""
    T, N, H = q.shape
    K = k_cache.shape[3]
    S, B = md.block_tables.shape
    block_size = k_cache.shape[2]
    qsl = md.query_start_loc  # [S + 1]
    tok = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.searchsorted(qsl[1:], tok, side="right").astype(jnp.int32)  # [T]
    valid = tok < qsl[S]  # [T] real (non-padding) tokens
    seq = jnp.minimum(seq, S - 1)
    # A token's position: the sequence's KV length minus how many of its queries follow it.
    qpos = md.seq_lens[seq] - (qsl[seq + 1] - tok)  # [T]
    k = k_cache[layer, md.block_tables[seq]].reshape(T, B * block_size, K, H)
    v = v_cache[layer, md.block_tables[seq]].reshape(T, B * block_size, K, H)
    qg = q.reshape(T, K, N // K, H).astype(jnp.float32)
    k, v = dequantize_pages(k, k_scale), dequantize_pages(v, v_scale)
    scores = soft_cap(jnp.einsum("tkgh,tlkh->tkgl", qg, k) * sm_scale, logit_soft_cap)
    kpos = jnp.arange(B * block_size)
    mask = (kpos[None, :] <= qpos[:, None]) & valid[:, None]  # [T, B*bs]
    if sliding_window is not None:
        mask &= kpos[None, :] >= window_start(qpos, sliding_window)[:, None]
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask[:, None, None, :], probs, 0.0)  # padding rows: all masked -> 0
    out = jnp.einsum("tkgl,tlkh->tkgh", probs, v)
    return out.reshape(T, N, H).astype(q.dtype)
