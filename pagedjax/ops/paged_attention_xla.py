"""Ragged paged attention in XLA loops: the fast path on CPU.

Two parts, both flash-style (online softmax over chunks of `kv_chunk_pages` pages, after
Dao et al., FlashAttention, 2022), with loop bounds read from the data so that the work
follows the longest context actually present rather than `max_model_len`:

1. Decode rows: the last query token of every sequence, sorted by context length and taken
   in blocks of rows; each block loops over KV chunks up to its longest context, each turn
   gathering one chunk of its sequences' pages. In a decode-only step this is all the
   attention there is.
2. Prefill tiles: sequences with more than one query token are cut (on the host) into tiles
   of `query_tile_size` consecutive tokens. A loop over the valid tiles computes each tile
   against its sequence's KV chunks (of `PREFILL_KV_CHUNK_TOKENS`, larger than the decode
   chunks: faster on CPU) up to the tile's last position, causally masked, and writes its
   rows back (a sequence's last token is written again, with the same value).

Under a sliding window both loops start at the chunk holding the first position a window
reaches (of the block's or tile's earliest query) rather than at 0, and mask the positions
before each row's own window; the window may be traced (its loop bounds are data, like the
context lengths). A logit soft-cap is applied to the scores of each chunk before the mask.
Without a window and a cap (None) none of this is traced.

Padding tokens and sequences produce zeros. The output is assembled in a buffer with
`query_tile_size` spare rows, so that padding rows and tiles that run past T never touch a
real row.
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

_NEG = -1e30  # finite "minus infinity": keeps the online softmax free of inf - inf
DECODE_ROW_BLOCK = 8  # decode rows per block (each block loops to its own longest context)
DECODE_TURN_COST_ROWS = 8  # fixed cost of one decode loop turn, in rows of work (CPU, measured)
PREFILL_KV_CHUNK_TOKENS = 128  # KV tokens per inner step of a prefill tile (at least a chunk)


def _online_update(m, l, acc, scores, mask, v):
    """One online-softmax step. scores: [..., C]; mask like scores; v: einsum-ready values."""
    scores = jnp.where(mask, scores, _NEG)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, l * alpha + p.sum(axis=-1), acc * alpha[..., None], p


def _decode_rows(q, k_cache, v_cache, layer, md, sm_scale, k_scale, v_scale, window, cap):
    """Attention of each sequence's last query token. Returns [S, K, G, H] float32.

    The rows are sorted by context length (longest first) and cut into blocks of R rows; each
    block loops over the KV chunks of its own longest context. Small blocks (R =
    DECODE_ROW_BLOCK) read little more than the contexts there are when their lengths are
    ragged, and skip padding rows; one block of all rows has the fewest loop turns when the
    lengths are alike. The step picks the cheaper of the two from the lengths it has, counting
    a loop turn as DECODE_TURN_COST_ROWS rows of work. Under a sliding window a block starts
    at the chunk of its earliest window start.
    """
    T, N, H = q.shape
    K = k_cache.shape[3]
    G = N // K
    S = md.seq_lens.shape[0]
    R = DECODE_ROW_BLOCK
    Sp = -(-S // R) * R  # rows padded to whole blocks
    order = jnp.argsort(-md.seq_lens)  # [S], longest first (stable)
    pad = Sp - S
    seq_lens = jnp.pad(md.seq_lens[order], (0, pad))
    tables = jnp.pad(md.block_tables[order], ((0, pad), (0, 0)))
    idx = jnp.pad(jnp.minimum(md.last_token_index, T - 1)[order], (0, pad))
    qd = q[idx].reshape(Sp, K, G, H).astype(jnp.float32) * sm_scale  # [Sp, K, G, H]
    block_size = k_cache.shape[2]
    P = md.kv_chunk_pages
    C = P * block_size
    if window is not None:
        # First position each row's window reaches; padding rows (length 0) start nowhere.
        starts = window_start(seq_lens - 1, window)
        first_chunk = jnp.where(seq_lens > 0, starts // C, jnp.iinfo(jnp.int32).max)  # [Sp]

    def blocked(R):
        def rows(b, out):
            lens = jax.lax.dynamic_slice_in_dim(seq_lens, b * R, R)  # [R]
            table = jax.lax.dynamic_slice_in_dim(tables, b * R, R)  # [R, B]
            qb = jax.lax.dynamic_slice_in_dim(qd, b * R, R)  # [R, K, G, H]
            if window is not None:
                lo = jax.lax.dynamic_slice_in_dim(starts, b * R, R)  # [R]
                c0 = jax.lax.dynamic_slice_in_dim(first_chunk, b * R, R).min()

            def body(c, carry):
                m, l, acc = carry
                pages = jax.lax.dynamic_slice_in_dim(table, c * P, P, axis=1)  # [R, P]
                kc = dequantize_pages(k_cache[layer, pages], k_scale).reshape(R, C, K, H)
                vc = dequantize_pages(v_cache[layer, pages], v_scale).reshape(R, C, K, H)
                scores = soft_cap(jnp.einsum("SKGH,SCKH->SKGC", qb, kc), cap)
                kpos = c * C + jnp.arange(C)
                mask = kpos[None, :] < lens[:, None]  # [R, C]
                if window is not None:
                    mask &= kpos[None, :] >= lo[:, None]
                mask = mask[:, None, None, :]  # [R, 1, 1, C]
                m, l, acc, p = _online_update(m, l, acc, scores, mask, vc)
                return m, l, acc + jnp.einsum("SKGC,SCKH->SKGH", p, vc)

            init = (
                jnp.full((R, K, G), _NEG, jnp.float32),
                jnp.zeros((R, K, G), jnp.float32),
                jnp.zeros((R, K, G, H), jnp.float32),
            )
            end = (lens[0] + C - 1) // C
            _, l, acc = jax.lax.fori_loop(0 if window is None else c0, end, body, init)
            o = acc / jnp.maximum(l, 1e-30)[..., None]
            return jax.lax.dynamic_update_slice_in_dim(out, o, b * R, axis=0)

        return jax.lax.fori_loop(0, Sp // R, rows, jnp.zeros((Sp, K, G, H), jnp.float32))

    if Sp == R:
        out = blocked(R)
    else:

        def cost(r):  # loop turns x (rows per turn + the fixed cost of a turn)
            ends = (seq_lens[::r] + C - 1) // C
            if window is None:
                turns = jnp.sum(ends)
            else:
                turns = jnp.sum(jnp.maximum(ends - first_chunk.reshape(-1, r).min(axis=1), 0))
            return turns * (r + DECODE_TURN_COST_ROWS)

        out = jax.lax.cond(cost(R) < cost(Sp), lambda: blocked(R), lambda: blocked(Sp))
    return jnp.zeros((S, K, G, H), jnp.float32).at[order].set(out[:S])


def _prefill_tiles(
    q_pad, out, k_cache, v_cache, layer, md, sm_scale, k_scale, v_scale, window, cap
):
    """Attention of the prefill tiles, written into `out` [T + Tq, N, H] float32."""
    _, N, H = q_pad.shape
    K = k_cache.shape[3]
    G = N // K
    Tq = md.query_tile_size
    block_size = k_cache.shape[2]
    P = max(md.kv_chunk_pages, PREFILL_KV_CHUNK_TOKENS // block_size)
    C = P * block_size
    B = md.block_tables.shape[1]
    tables = jnp.pad(md.block_tables, ((0, 0), (0, -(-B // P) * P - B)))  # whole chunks
    pos_pad = jnp.pad(md.positions, (0, Tq))  # [T + Tq]

    def tile(i, out):
        s = md.tile_seq[i]
        q0, q_len, kv_len = md.tile_q_start[i], md.tile_q_len[i], md.tile_kv_len[i]
        qt = jax.lax.dynamic_slice_in_dim(q_pad, q0, Tq, axis=0)  # [Tq, N, H]
        qt = qt.reshape(Tq, K, G, H).astype(jnp.float32) * sm_scale
        qpos = jax.lax.dynamic_slice_in_dim(pos_pad, q0, Tq)  # [Tq]
        rows = jnp.arange(Tq) < q_len  # [Tq]
        table = tables[s]  # [B rounded up to P]
        if window is not None:
            lo = window_start(qpos, window)  # [Tq]; positions are consecutive from qpos[0]

        def chunk(c, carry):
            m, l, acc = carry
            pages = jax.lax.dynamic_slice_in_dim(table, c * P, P)  # [P]
            kc = dequantize_pages(k_cache[layer, pages], k_scale).reshape(C, K, H)
            vc = dequantize_pages(v_cache[layer, pages], v_scale).reshape(C, K, H)
            scores = soft_cap(jnp.einsum("TKGH,CKH->KGTC", qt, kc), cap)
            kpos = c * C + jnp.arange(C)
            mask = (kpos[None, :] <= qpos[:, None]) & rows[:, None]  # [Tq, C]
            if window is not None:
                mask &= kpos[None, :] >= lo[:, None]
            m, l, acc, p = _online_update(m, l, acc, scores, mask[None, None], vc)
            return m, l, acc + jnp.einsum("KGTC,CKH->KGTH", p, vc)

        init = (
            jnp.full((K, G, Tq), _NEG, jnp.float32),
            jnp.zeros((K, G, Tq), jnp.float32),
            jnp.zeros((K, G, Tq, H), jnp.float32),
        )
        c0 = 0 if window is None else lo[0] // C
        _, l, acc = jax.lax.fori_loop(c0, (kv_len + C - 1) // C, chunk, init)
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
    sliding_window=None,
    logit_soft_cap: float | None = None,
) -> jax.Array:
    """See `ops.attention.ragged_paged_attention`. q: [T, N, H] -> [T, N, H].

    `block_tables` must have a multiple of `md.kv_chunk_pages` columns.
    """
    T, N, H = q.shape
    Tq = md.query_tile_size
    S = md.seq_lens.shape[0]
    out = jnp.zeros((T + Tq, N, H), jnp.float32)
    extra = (sliding_window, logit_soft_cap)
    decode = _decode_rows(q, k_cache, v_cache, layer, md, sm_scale, k_scale, v_scale, *extra)
    decode = decode.reshape(S, N, H)
    out = out.at[md.last_token_index].set(decode)
    q_pad = jnp.pad(q, ((0, Tq), (0, 0), (0, 0)))
    out = _prefill_tiles(
        q_pad, out, k_cache, v_cache, layer, md, sm_scale, k_scale, v_scale, *extra
    )
    return out[:T].astype(q.dtype)
