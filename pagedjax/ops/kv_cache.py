"""The paged KV cache: its layout, its allocation and the scatter of new K/V by slot mapping.

Layout: two arrays, K and V, each [L, num_blocks, block_size, K, H] (layers, physical blocks,
slots in a block, KV heads, head dim). A token's physical slot is
`block_id * block_size + offset`; block 0 is the reserved null block that padding tokens
write into and padding block-table entries point at, so no real token ever lives there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# (k_cache, v_cache), each [L, num_blocks, block_size, K, H].
KVCache = tuple[jax.Array, jax.Array]


def kv_cache_shape(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """Shape of each of the K and V arrays."""
    return (num_layers, num_blocks, block_size, num_kv_heads, head_dim)


def kv_cache_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype
) -> int:
    """Bytes one block takes in K and V together, over all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * jnp.dtype(dtype).itemsize


def init_kv_cache(shape: tuple[int, ...], dtype, sharding=None) -> KVCache:
    """Allocates zeroed K and V arrays of `shape` on the device (or with `sharding`)."""
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    return make(), make()


def write_kv(
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> KVCache:
    """Scatters one layer's new K/V into their slots.

    Args:
        k_cache, v_cache: [L, num_blocks, block_size, K, H].
        layer: scalar layer index (may be traced inside `lax.scan`).
        k, v: [T, K, H] the new keys and values of the step's tokens.
        slot_mapping: [T] int32 physical slot of each token (padding tokens: a slot of block 0).

    Returns:
        The updated (k_cache, v_cache); in place when the caller donates the cache.
    """
    block_size = k_cache.shape[2]
    blocks = slot_mapping // block_size  # [T]
    offsets = slot_mapping % block_size  # [T]
    k_cache = k_cache.at[layer, blocks, offsets].set(k.astype(k_cache.dtype))
    v_cache = v_cache.at[layer, blocks, offsets].set(v.astype(v_cache.dtype))
    return k_cache, v_cache
