"""Ragged paged attention in XLA loops: the fast path on CPU.

Two parts, both flash-style (online softmax over chunks of `kv_chunk_pages` pages, after
Dao et al., FlashAttention, 2022), with loop bounds read from the data so that the work
follows the longest context actually present rather than `max_model_len`:

1. Decode rows: the last query token of every sequence, all S at once. The loop runs over
   KV chunks up to max(seq_lens); each turn gathers one chunk of every sequence's pages.
   In a decode-only step this is all the attention there is.
2. Prefill tiles: sequences with more than one query token are cut (on the host) into tiles
   of `query_tile_size` consecutive tokens. A loop over the valid tiles computes each tile
   against its sequence's KV chunks up to the tile's last position, causally masked, and
   writes its rows back (a sequence's last token is written again, with the same value).

Padding tokens and sequences produce zeros. The output is assembled in a buffer with
`query_tile_size` spare rows, so that padding rows and tiles that run past T never touch a
real row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.ops.attention import AttentionMetadata, dequantize_pages

_NEG = -1e30  # finite "minus infinity": keeps the online softmax free of inf - inf


def _online_update(m, l, acc, scores, mask, v):
    """One online-softmax step. scores: [..., C]; mask like scores; v: einsum-ready values."""
    scores = jnp.where(mask, scores, _NEG)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + p.sum(axis=-1), acc * alpha[..., None], p


def _decode_rows(q, k_cache, v_cache, layer, md, sm_scale, k_scale, v_scale):
    """Attention of each sequence's last query token. Returns [S, K, G, H] float32."""
    T, N, H = q.shape
    K = k_cache.shape[3]
    G = N // K
    S = md.seq_lens.shape[0]
    block_size = k_cache.shape[2]
    P = md.kv_chunk_pages
    C = P * block_size
    idx = jnp.minimum(md.last_token_index, T - 1)
    qd = q[idx].reshape(S, K, G, H).astype(jnp.float32) * sm_scale  # [S, K, G, H]
    num_chunks = (jnp.max(md.seq_lens) + C - 1) // C

    def body(c, carry):
        m, l, acc = carry
        pages = jax.lax.dynamic_slice_in_dim(md.block_tables, c * P, P, axis=1)  # [S, P]
        kc = dequantize_pages(k_cache[layer, pages], k_scale).reshape(S, C, K, H)
        vc = dequantize_pages(v_cache[layer, pages], v_scale).reshape(S, C, K, H)
        scores = jnp.einsum("SKGH,SCKH->SKGC", qd, kc)
        kpos = c * C + jnp.arange(C)
        mask = (kpos[None, :] < md.seq_lens[:, None])[:, None, None, :]  # [S, 1, 1, C]
        m, l, acc, p = _online_update(m, l, acc, scores, mask, vc)
        return m, l, acc + jnp.einsum("SKGC,SCKH->SKGH", p, vc)

    init = (
        jnp.full((S, K, G), _NEG, jnp.float32),
        jnp.zeros((S, K, G), jnp.float32),
        jnp.zeros((S, K, G, H), jnp.float32),
    )
    _, l, acc = jax.lax.fori_loop(0, num_chunks, body, init)
    return acc / jnp.maximum(l, 1e-30)[..., None]


def _prefill_tiles(q_pad, out, k_cache, v_cache, layer, md, sm_scale, k_scale, v_scale):
    """Attention of the prefill tiles, written into `out` [T + Tq, N, H] float32."""
    _, N, H = q_pad.shape
    K = k_cache.shape[3]
    G = N // K
    Tq = md.query_tile_size
    block_size = k_cache.shape[2]
    P = md.kv_chunk_pages
    C = P * block_size
    pos_pad = jnp.pad(md.positions, (0, Tq))  # [T + Tq]

    def tile(i, out):
        s = md.tile_seq[i]
        q0, q_len, kv_len = md.tile_q_start[i], md.tile_q_len[i], md.tile_kv_len[i]
        qt = jax.lax.dynamic_slice_in_dim(q_pad, q0, Tq, axis=0)  # [Tq, N, H]
        qt = qt.reshape(Tq, K, G, H).astype(jnp.float32) * sm_scale
        qpos = jax.lax.dynamic_slice_in_dim(pos_pad, q0, Tq)  # [Tq]
        rows = jnp.arange(Tq) < q_len  # [Tq]
        table = md.block_tables[s]  # [B]

        def chunk(c, carry):
            m, l, acc = carry
            pages = jax.lax.dynamic_slice_in_dim(table, c * P, P)  # [P]
            kc = dequantize_pages(k_cache[layer, pages], k_scale).reshape(C, K, H)
            vc = dequantize_pages(v_cache[layer, pages], v_scale).reshape(C, K, H)
            scores = jnp.einsum("TKGH,CKH->KGTC", qt, kc)
            kpos = c * C + jnp.arange(C)
            mask = (kpos[None, :] <= qpos[:, None]) & rows[:, None]  # [Tq, C]
            m, l, acc, p = _online_update(m, l, acc, scores, mask[None, None], vc)
            return m, l, acc + jnp.einsum("KGTC,CKH->KGTH", p, vc)

        init = (
            jnp.full((K, G, Tq), _NEG, jnp.float32),
            jnp.zeros((K, G, Tq), jnp.float32),
            jnp.zeros((K, G, Tq, H), jnp.float32),
        )
        _, l, acc = jax.lax.fori_loop(0, (kv_len + C - 1) // C, chunk, init)
        o = acc / jnp.maximum(l, 1e-30)[..., None]  # [K, G, Tq, H]
        o = o.transpose(2, 0, 1, 3).reshape(Tq, N, H)
        cur = jax.lax.dynamic_slice_in_dim(out, q0, Tq, axis=0)
        new = jnp.where(rows[:, None, None], o, cur)
        return jax.lax.dynamic_update_slice_in_dim(out, new, q0, axis=0)

    return jax.lax.fori_loop(0, md.num_tiles, tile, out)


def paged_attention_xla(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    md: AttentionMetadata,
    *,
    sm_scale: float,
    k_scale=None,
    v_scale=None,
) -> jax.Array:
    """See `ops.attention.ragged_paged_attention`. q: [T, N, H] -> [T, N, H].

    `block_tables` must have a multiple of `md.kv_chunk_pages` columns.
    """
    T, N, H = q.shape
    Tq = md.query_tile_size
    S = md.seq_lens.shape[0]
    out = jnp.zeros((T + Tq, N, H), jnp.float32)
    decode = _decode_rows(q, k_cache, v_cache, layer, md, sm_scale, k_scale, v_scale)
    decode = decode.reshape(S, N, H)
    out = out.at[md.last_token_index].set(decode)
    q_pad = jnp.pad(q, ((0, Tq), (0, 0), (0, 0)))
    out = _prefill_tiles(q_pad, out, k_cache, v_cache, layer, md, sm_scale, k_scale, v_scale)
    return out[:T].astype(q.dtype)
