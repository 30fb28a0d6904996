"""Native CPU matmul over GGUF quantized blocks: y = x @ W[layer] (`csrc/gguf_linear_cpu.cc`).

The kernel multiplies float32 activations by a `gguf_quant.GGUFWeight` without ever holding
its float32 weights: each work item dequantizes four rows of W at a time into a small buffer
and multiplies them with every row of x, so a step reads each weight block once. It takes a
whole stack of layers [L, N, row_bytes] and the layer index, reading the layer in place
(inside the model's `lax.scan`, XLA would otherwise copy each layer's slice out of the stack).

`ops.linear.linear` runs it for a `GGUFWeight` marked `native` (`use_native`, done by the
engine under `linear_backend="cpu"`) in steps of at most `MAX_TOKENS` tokens; larger steps
dequantize the layer inside the step and use XLA's dot (`gguf_quant.matmul_xla`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.ops import cpu_kernels
from pagedjax.ops.gguf_quant import GGML_TYPE_IDS, GGUF_FORMATS, GGUFWeight

TARGET = "pagedjax_gguf_linear_cpu"
# Steps of more tokens than this dequantize the layer and use XLA's dot instead (there the
# dequantization is small next to the dot, which XLA blocks for large M).
MAX_TOKENS = 128


def matmul(
    x: jax.Array,
    w: GGUFWeight,
    layer: jax.Array | int = 0,
    num_rows: jax.Array | int | None = None,
    *,
    isa: str | None = None,
) -> jax.Array:
    """x @ W[layer] in float32, for the first `num_rows` rows of x.

    Args:
        x: [M, K] activations (any float dtype; computed in float32).
        w: a `GGUFWeight` of a stack [L, N, row_bytes] (or of one layer [N, row_bytes], read
            as a stack of one).
        layer: scalar int32 index into the L axis (traced or not).
        num_rows: scalar int32 (traced or not): rows [0, num_rows) of x are multiplied, the
            others give zeros; None: all M.
        isa: the kernel's ISA path (`cpu_kernels.ISAS`); None: `cpu_kernels.default_isa()`.

    Returns:
        [M, N] float32.

    Raises:
        RuntimeError: the native kernels are unavailable.
        ValueError: shapes that disagree, K not a multiple of the vector width's block, or an
            ISA path this CPU cannot run.
    """
    target = cpu_kernels.target(TARGET, isa)
    blocks = w.blocks if w.blocks.ndim == 3 else w.blocks[None]
    if x.ndim != 2 or x.shape[1] != w.in_features:
        raise ValueError(f"GGUF matmul: x {x.shape} and a weight of K={w.in_features} disagree")
    bs, nbytes = GGUF_FORMATS[w.qtype]
    call = jax.ffi.ffi_call(
        target, jax.ShapeDtypeStruct((x.shape[0], blocks.shape[1]), jnp.float32)
    )
    rows = x.shape[0] if num_rows is None else num_rows
    return call(
        x.astype(jnp.float32),
        blocks,
        jnp.asarray(layer, jnp.int32).reshape(()),
        jnp.asarray(rows, jnp.int32).reshape(()),
        qtype=GGML_TYPE_IDS[w.qtype],
        block_values=bs,
        block_bytes=nbytes,
    )


def use_native(params: dict) -> dict:
    """The params pytree with every `GGUFWeight` marked `native` (multiplied by this kernel in
    small steps; the stacks read in place by the layer scan, `ops.linear.reads_in_place`)."""

    def mark(w):
        return w.replace(native=True) if isinstance(w, GGUFWeight) else w

    return jax.tree.map(mark, params, is_leaf=lambda w: isinstance(w, GGUFWeight))
