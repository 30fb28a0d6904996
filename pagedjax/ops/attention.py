"""Ragged paged attention: the one entry point the model calls, and its step metadata.

A step's batch is flat and ragged: the query tokens of all S sequences lie back to back,
sequence s owning tokens `query_start_loc[s] : query_start_loc[s + 1]` (decode: one token;
prefill chunk: many). Each query token attends causally to every KV token of its own
sequence up to and including its own position, read from the paged cache through the
sequence's block table. The new tokens' K/V are already in the cache when this is called.

Implementations (all share `tests/test_attention.py`):
    "reference"  `paged_attention_ref`: dense, per token, obviously right, memory-hungry.
    "xla"        `paged_attention_xla`: flash-style online softmax over KV chunks in XLA loops;
                 runs anywhere, sharded or not.
    "cpu"        `cpu_attention.paged_attention`: a native C++ kernel (an XLA FFI custom
                 call) that reads pages in place; the fast path on one CPU device. The
                 engine holds float32 weights pre-packed under this backend, and the model
                 runs the linear layers of decode-sized steps and the LM head through the
                 native `cpu_linear.matmul`.
    "pallas"     `paged_attention_pallas`: the Pallas kernel (GPU; `interpret=True` on CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

BACKENDS = ("reference", "xla", "cpu", "pallas")


@struct.dataclass
class AttentionMetadata:
    """Per-step attention inputs, built on the host by the runner (all int32).

    Attributes:
        slot_mapping: [T] physical KV slot of each token (`block * block_size + offset`);
            padding tokens map into the null block 0.
        positions: [T] absolute position of each token (0 for padding).
        seq_lens: [S] KV length of each sequence after this step (0 for padding rows).
        query_start_loc: [S + 1] start of each sequence's queries in the flat batch; padding
            rows repeat the total number of real tokens.
        block_tables: [S, B] physical block ids of each sequence (0 = null block padding).
        last_token_index: [S] flat index of each sequence's last query token, T for padding
            rows (the XLA path computes every sequence's last token as a decode row).
        tile_seq: [NT] sequence of each prefill query tile (sequences with more than one
            query token are cut into tiles of `query_tile_size` tokens).
        tile_q_start: [NT] flat index of a tile's first query token.
        tile_q_len: [NT] number of real query tokens in the tile (<= query_tile_size).
        tile_kv_len: [NT] KV tokens the tile's last query attends to (its position + 1).
        num_tiles: [] number of valid tiles.
        query_tile_size: static; query tokens per prefill tile.
        kv_chunk_pages: static; KV pages processed per inner step of the XLA path.
    """

    slot_mapping: jax.Array
    positions: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    block_tables: jax.Array
    last_token_index: jax.Array
    tile_seq: jax.Array
    tile_q_start: jax.Array
    tile_q_len: jax.Array
    tile_kv_len: jax.Array
    num_tiles: jax.Array
    query_tile_size: int = struct.field(pytree_node=False, default=32)
    kv_chunk_pages: int = struct.field(pytree_node=False, default=8)

    @classmethod
    def from_arrays(cls, arrays, **static) -> AttentionMetadata:
        """The metadata fields (`METADATA_FIELDS`) picked from a mapping of named arrays, e.g.
        `PackedLayout.unpack`'s; `static`: query_tile_size, kv_chunk_pages."""
        return cls(**{f: arrays[f] for f in METADATA_FIELDS}, **static)


# The array fields of AttentionMetadata, in order (the packed layout names them the same).
METADATA_FIELDS = (
    "slot_mapping",
    "positions",
    "seq_lens",
    "query_start_loc",
    "block_tables",
    "last_token_index",
    "tile_seq",
    "tile_q_start",
    "tile_q_len",
    "tile_kv_len",
    "num_tiles",
)


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

    Returns:
        [T, N, H] in q's dtype; rows of padding tokens are zero.

    Raises:
        ValueError: unknown backend, or N not a multiple of K.
    """
    if q.shape[1] % k_cache.shape[3]:
        raise ValueError(
            f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k_cache.shape[3]})"
        )
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
        )
        return out.astype(q.dtype)
    elif backend == "pallas":
        from pagedjax.ops.paged_attention_pallas import paged_attention_pallas as impl
    else:
        raise ValueError(f"attention backend {backend!r} is unknown; choose one of {BACKENDS}")
    return impl(q, k_cache, v_cache, layer, md, sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale)


def dequantize_pages(pages: jax.Array, scale: jax.Array | float | None) -> jax.Array:
    """Pages read from the cache, in float32 (times `scale` for a quantized cache)."""
    pages = pages.astype(jnp.float32)
    return pages if scale is None else pages * scale
