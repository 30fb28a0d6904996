"""Native ragged paged attention for the CPU: a C++ XLA FFI custom call (`cpu_kernels`).

`csrc/paged_attention_cpu.cc` reads each sequence's K/V rows in place from the paged cache
through its block table, over XLA's intra-op thread pool; the XLA path
(`paged_attention_xla`) must gather every KV chunk into a temporary before its dots, which on
CPU costs more than the arithmetic. It is part of the "cpu" attention backend: decode rows and
prefill chunks alike, one device (the custom call has no sharding rule). A sliding window is a
runtime operand (it may differ per layer inside a scan over layers) and the kernel skips the
blocks before an item's windows; a logit soft-cap is an attribute. The library is built on
first use, one build per ISA path (see `cpu_kernels`). A float8 cache is read directly, its
bytes converted to float32 in vector registers.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.ops import cpu_kernels

TARGET = "pagedjax_paged_attention_cpu"
QUERY_TILE = 16  # queries of one sequence per work item (they share each block read)
# Cache dtypes the kernel reads (a float8 cache through a byte -> float32 table).
SUPPORTED_CACHE_DTYPES = tuple(
    jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2)
)


def supports(cache_dtype) -> bool:
    """True for a cache dtype the kernel reads."""
    return jnp.dtype(cache_dtype) in SUPPORTED_CACHE_DTYPES


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: jax.Array | int,
    seq_lens: jax.Array,
    query_start_loc: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float,
    k_scale: jax.Array | float | None = None,
    v_scale: jax.Array | float | None = None,
    sliding_window: jax.Array | int | None = None,
    logit_soft_cap: float | None = None,
    query_tile: int = QUERY_TILE,
    isa: str | None = None,
) -> jax.Array:
    """Causal attention of each query token over its sequence's paged context (native CPU).

    Args:
        q: [T, N, H] queries, flat and ragged (any float dtype; computed in float32).
        k_cache, v_cache: [L, num_blocks, block_size, K, H] float32, bfloat16 or float8.
        layer: scalar index into the L axis.
        seq_lens: [S] int32 context length of each sequence after the step (0: padding).
        query_start_loc: [S + 1] int32; sequence s owns queries [qsl[s], qsl[s + 1]), the
            last at position seq_lens[s] - 1. Tokens past qsl[S] are padding.
        block_tables: [S, B] int32 physical block ids; must cover each context.
        sm_scale: softmax scale.
        k_scale, v_scale: a float8 cache's scalar scales (None: 1.0).
        sliding_window: a query at position p sees positions j with
            p - sliding_window < j <= p; an int or an int32 scalar (may be traced); None or
            <= 0: full causal attention.
        logit_soft_cap: scores = cap * tanh(scores / cap) after the softmax scale; None:
            none.
        query_tile: queries of one sequence per work item.
        isa: the kernel's ISA path (`cpu_kernels.ISAS`); None: `cpu_kernels.default_isa()`.

    Returns:
        [T, N, H] float32; padding rows are zero.

    Raises:
        RuntimeError: the kernel is unavailable (`cpu_kernels.available()` is False).
        ValueError: a cache dtype the kernel does not read, or an ISA path this CPU cannot run.
    """
    target = cpu_kernels.target(TARGET, isa)
    if not supports(k_cache.dtype):
        raise ValueError(
            f"native CPU attention reads {SUPPORTED_CACHE_DTYPES}, not {k_cache.dtype}"
        )
    scales = jnp.stack(
        [jnp.asarray(1.0 if s is None else s, jnp.float32).reshape(()) for s in (k_scale, v_scale)]
    )
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q.astype(jnp.float32),
        k_cache,
        v_cache,
        jnp.asarray(layer, jnp.int32).reshape(()),
        seq_lens.astype(jnp.int32),
        query_start_loc.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        jnp.asarray(0 if sliding_window is None else sliding_window, jnp.int32).reshape(()),
        scales,
        sm_scale=np.float32(sm_scale),
        logit_soft_cap=np.float32(logit_soft_cap or 0.0),
        query_tile=np.int64(query_tile),
    )
