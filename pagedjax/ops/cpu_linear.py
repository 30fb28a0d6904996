"""Native float32 matmul for the CPU over a stacked weight: y = x @ W[layer] (`cpu_kernels`).

Inside the model's `lax.scan` over layers, XLA's CPU backend copies each layer's weight out of
the stacked [L, in, out] array before every dot (a dynamic-slice); at decode batch sizes the
copy costs about half as much as the dot. `csrc/linear_cpu.cc` takes the whole stacked array
and the layer index and reads the layer in place, with a blocked GEMM (packed operands, a
6 x 16 register micro-kernel) over XLA's intra-op thread pool. Part of the "cpu" backend:
`models.llama` runs the float32 linear layers of steps of up to `MAX_TOKENS` tokens through it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.ops.cpu_kernels import available, unavailable_reason

TARGET = "pagedjax_linear_cpu"
# The model uses the kernel for steps of at most this many tokens (decode and small mixed
# steps). Larger steps keep XLA's dot: there the weight copy is small next to the dot, and
# XLA's dot was as fast or faster in the standard workload's 1,024- and 2,048-token steps.
MAX_TOKENS = 128


def supports(w) -> bool:
    """True for a weight the kernel multiplies: a float32 array (not a quantized weight)."""
    return isinstance(w, jax.Array | np.ndarray) and jnp.dtype(w.dtype) == jnp.float32


def matmul(
    x: jax.Array,
    w: jax.Array,
    layer: jax.Array | int = 0,
    num_rows: jax.Array | int | None = None,
) -> jax.Array:
    """x @ W[layer], in float32, for the first `num_rows` rows of x.

    Args:
        x: [M, K] activations (any float dtype; computed in float32).
        w: float32 [L, K, N] stacked weights.
        layer: scalar int32 index into the L axis (traced or not).
        num_rows: scalar int32 (traced or not): only rows [0, num_rows) of x are multiplied,
            the others give zeros; clipped to [0, M]. None: all M. A step padded to its
            shape bucket passes its number of real tokens, so padding costs no arithmetic.

    Returns:
        [M, N] float32.

    Raises:
        RuntimeError: the kernels are unavailable (`cpu_kernels.available()` is False).
        ValueError: w is not float32, or the shapes disagree.
    """
    if not available():
        raise RuntimeError(f"native CPU kernels unavailable: {unavailable_reason()}")
    if jnp.dtype(w.dtype) != jnp.float32:
        raise ValueError(f"native CPU matmul multiplies float32 weights, not {w.dtype}")
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"native CPU matmul: x [M, K] and w [L, K, N] disagree on K: {x.shape}, {w.shape}"
        )
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), jnp.float32))
    rows = x.shape[0] if num_rows is None else num_rows
    return call(
        x.astype(jnp.float32),
        w,
        jnp.asarray(layer, jnp.int32).reshape(()),
        jnp.asarray(rows, jnp.int32).reshape(()),
    )
