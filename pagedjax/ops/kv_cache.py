"""The paged KV cache: its layout, its allocation and the scatter of new K/V by slot mapping.

Layout: two arrays, K and V, each [L, num_blocks, block_size, K, H] (layers, physical blocks,
slots in a block, KV heads, head dim). A token's physical slot is
`block_id * block_size + offset`; block 0 is the reserved null block that padding tokens
write into and padding block-table entries point at, so no real token ever lives there.

Dtype (`kv_cache_dtype`, vLLM's names): "auto" stores K/V in the model dtype; "fp8" (=
"fp8_e4m3") stores float8_e4m3fn and "fp8_e5m2" float8_e5m2, a quarter of float32's bytes.
A quantized cache holds `value / scale`, saturated at the format's largest finite value, with
one float32 scale per layer for K and one for V (vLLM's per-tensor `k_scale` / `v_scale`):
the checkpoint's when it has them, else 1.0 (vLLM's default without calibrated scales).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pagedjax.ops.choices import FP8_KV_CACHE_DTYPES
from pagedjax.ops.quant import to_fp8

# (k_cache, v_cache), each [L, num_blocks, block_size, K, H].
KVCache = tuple[jax.Array, jax.Array]


def kv_cache_jnp_dtype(kv_cache_dtype: str, model_dtype):
    """The array dtype of the cache: the model dtype for "auto", else the float8 format.

    Raises:
        ValueError: an unknown `kv_cache_dtype` (the message lists the known ones).
    """
    if kv_cache_dtype == "auto":
        return jnp.dtype(model_dtype)
    if kv_cache_dtype not in FP8_KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be 'auto' or one of {sorted(FP8_KV_CACHE_DTYPES)}, "
            f"got {kv_cache_dtype!r}"
        )
    return jnp.dtype(FP8_KV_CACHE_DTYPES[kv_cache_dtype])


def is_quantized_cache(dtype) -> bool:
    """True for a float8 cache, whose values are read as `value * scale`."""
    return jnp.dtype(dtype) in {jnp.dtype(d) for d in FP8_KV_CACHE_DTYPES.values()}


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
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    *,
    native: bool = False,
) -> KVCache:
    """Scatters one layer's new K/V into their slots (quantizing them for a float8 cache).

    Args:
        k_cache, v_cache: [L, num_blocks, block_size, K, H].
        layer: scalar layer index (may be traced inside `lax.scan`).
        k, v: [T, K, H] the new keys and values of the step's tokens.
        slot_mapping: [T] int32 physical slot of each token (padding tokens: a slot of block 0).
        k_scale, v_scale: a float8 cache's scalar float32 scales of this layer (None: 1.0):
            the cache stores `saturate(k / k_scale)`. Ignored for a cache in a wider dtype.
        native: write through the native CPU call (`cpu_kernels`, the "cpu" attention
            backend's), which copies only the T new rows, in place. XLA's CPU scatter into a
            float8 array (or its uint8 view) passes over the whole cache; into a float32 one it
            is about nine small ops per layer (index arithmetic, bounds checks, two dynamic
            updates): in a one-request decode step of the default model, 16 us per layer
            against 3 us for the call (a profile).

    Returns:
        The updated (k_cache, v_cache); in place when the caller donates the cache.

    Raises:
        RuntimeError: `native` where the native kernels are unavailable.
    """
    if native:
        return _write_native(
            k_cache,
            v_cache,
            layer,
            _to_cache(k, k_cache.dtype, k_scale),
            _to_cache(v, v_cache.dtype, v_scale),
            slot_mapping,
        )
    block_size = k_cache.shape[2]
    blocks = slot_mapping // block_size  # [T]
    offsets = slot_mapping % block_size  # [T]
    return (
        _scatter(k_cache, layer, blocks, offsets, _to_cache(k, k_cache.dtype, k_scale)),
        _scatter(v_cache, layer, blocks, offsets, _to_cache(v, v_cache.dtype, v_scale)),
    )


def _write_native(k_cache, v_cache, layer, k, v, slot_mapping) -> KVCache:
    """The native CPU write (`csrc/kv_write_cpu.cc`): rows k, v [T, K, H] (the cache's
    dtype) into their slots of layer `layer`, the caches aliased to the results."""
    from pagedjax.ops import cpu_kernels

    out = tuple(jax.ShapeDtypeStruct(c.shape, c.dtype) for c in (k_cache, v_cache))
    call = jax.ffi.ffi_call(
        cpu_kernels.target("pagedjax_kv_write_cpu"), out, input_output_aliases={0: 0, 1: 1}
    )
    return call(
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32).reshape(()),
        k,
        v,
        slot_mapping.astype(jnp.int32),
    )


def _scatter(cache, layer, blocks, offsets, x):
    """cache[layer, blocks, offsets] = x. A float8 cache is written through a uint8 view: XLA
    CPU turns a scatter into a float8 array into a pass over the whole array."""
    if not is_quantized_cache(cache.dtype):
        return cache.at[layer, blocks, offsets].set(x)
    u8 = functools.partial(jax.lax.bitcast_convert_type, new_dtype=jnp.uint8)
    out = u8(cache).at[layer, blocks, offsets].set(u8(x))
    return jax.lax.bitcast_convert_type(out, cache.dtype)


def _to_cache(x: jax.Array, dtype, scale) -> jax.Array:
    """x [T, K, H] in the cache's dtype: divided by `scale` and saturated for float8."""
    if not is_quantized_cache(dtype):
        return x.astype(dtype)
    x32 = x.astype(jnp.float32)
    return to_fp8(x32 if scale is None else x32 / scale, dtype)
