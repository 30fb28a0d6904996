"""Native CPU matmul over GGUF quantized blocks: y = x @ W[layer] (`csrc/gguf_linear_cpu.cc`).

The kernel multiplies float32 activations by a `gguf_quant.GGUFWeight` without ever holding
its float32 weights: each work item dequantizes four rows of W at a time into a small buffer
and multiplies them with every row of x, so a step reads each weight block once. It takes a
whole stack of layers [L, N, row_bytes] and the layer index, reading the layer in place
(inside the model's `lax.scan`, XLA would otherwise copy each layer's slice out of the stack).

`ops.linear.linear` runs it for a `GGUFWeight` marked `native` (`use_native`, done by the
engine under `linear_backend="cpu"`) in steps of at most `MAX_TOKENS` tokens; larger steps
dequantize the layer inside the step with the same kernel's dequantization (`dequantize`)
and use XLA's dot. (XLA's own dequantization, `gguf_quant.matmul_xla`, the path of other
devices, took 1.6 s more than float32 weights over the standard workload's prefill steps.)

int8 activations (`activations="int8"`, the engine's `gguf_activations="int8"`; formats of
`INT8_FORMATS`, the others keep float32): `csrc/gguf_int8_cpu.cc` quantizes each 32-value
block of x to int8 (scale max|x| / 127, rounded to nearest), as llama.cpp quantizes
activations for its integer dot products (Q8_0, `quantize_row_q8_0`), and multiplies by the
blocks' integers with int32 sums (VNNI `vpdpbusd` on AVX-512 machines that have it, scalar
code elsewhere), scaling per block in float32. It is an approximation of the float32 product:
each activation moves by up to half a quantization step (max|x| / 254 of its block). Where
the VNNI path runs (`int8_every_size`), it takes steps of every size (from 9 rows, weights
repacked in panels, `csrc/gguf_int8_panels.h`, ~2-3x XLA's float32 dot per thread), each row
with the same bits whatever the step's size; elsewhere steps over `MAX_TOKENS` take the
float32 route above.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.ops import cpu_kernels
from pagedjax.ops.gguf_quant import GGML_TYPE_IDS, GGUF_FORMATS, GGUFWeight

TARGET = "pagedjax_gguf_linear_cpu"
TARGET_INT8 = "pagedjax_gguf_linear_int8_cpu"
TARGET_DEQUANTIZE = "pagedjax_gguf_dequantize_cpu"
# The formats the int8-activation kernel takes (32-value blocks); the others run float32.
INT8_FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
ACTIVATIONS = ("float32", "int8")
# Steps of more tokens than this dequantize the layer and use XLA's dot instead (there the
# dequantization is small next to the dot, which XLA blocks for large M), except where
# `int8_every_size`: the int8 kernel's panels are faster than that dot at every size.
MAX_TOKENS = 128


def matmul(
    x: jax.Array,
    w: GGUFWeight,
    layer: jax.Array | int = 0,
    num_rows: jax.Array | int | None = None,
    *,
    isa: str | None = None,
    activations: str | None = None,
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
        activations: "float32" or "int8" (see the module docstring; "int8" on a format
            outside INT8_FORMATS runs float32); None: the weight's own `activations`.

    Returns:
        [M, N] float32.

    Raises:
        RuntimeError: the native kernels are unavailable.
        ValueError: shapes that disagree, K not a multiple of the vector width's block, or an
            ISA path this CPU cannot run.
    """
    activations = activations or w.activations
    if activations not in ACTIVATIONS:
        raise ValueError(f"gguf_activations must be one of {ACTIVATIONS}, got {activations!r}")
    int8 = activations == "int8" and w.qtype in INT8_FORMATS
    target = cpu_kernels.target(TARGET_INT8 if int8 else TARGET, isa)
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


def int8_every_size(w: GGUFWeight, isa: str | None = None) -> bool:
    """Whether `matmul` takes `w` in steps of every size: int8 activations on a format of
    `INT8_FORMATS`, on the avx512 path of a CPU with AVX-512 VNNI (the integer kernel's panel
    path). Else steps of more than `MAX_TOKENS` rows go to `dequantize` and XLA's dot."""
    return (
        w.activations == "int8"
        and w.qtype in INT8_FORMATS
        and (isa or cpu_kernels.default_isa()) == "avx512"
        and cpu_kernels.has_cpu_flag("avx512_vnni")
    )


def dequantize(w: GGUFWeight, layer: jax.Array | int = 0, *, isa: str | None = None) -> jax.Array:
    """The float32 values of layer `layer` of a GGUF stack, [N, K] (output rows, as stored),
    by the native kernel's dequantization: equal to `gguf_quant.dequantize_blocks` of that
    layer within float32 rounding (the kernel fuses scale and offset into one multiply-add).

    Args:
        w: a `GGUFWeight` of a stack [L, N, row_bytes] (or of one layer [N, row_bytes]).
        layer: scalar int32 index into the L axis (traced or not).
        isa: the kernel's ISA path; None: `cpu_kernels.default_isa()`.

    Raises:
        RuntimeError: the native kernels are unavailable.
        ValueError: an ISA path this CPU cannot run.
    """
    target = cpu_kernels.target(TARGET_DEQUANTIZE, isa)
    blocks = w.blocks if w.blocks.ndim == 3 else w.blocks[None]
    bs, nbytes = GGUF_FORMATS[w.qtype]
    call = jax.ffi.ffi_call(
        target, jax.ShapeDtypeStruct((blocks.shape[1], w.in_features), jnp.float32)
    )
    return call(
        blocks,
        jnp.asarray(layer, jnp.int32).reshape(()),
        qtype=GGML_TYPE_IDS[w.qtype],
        block_values=bs,
        block_bytes=nbytes,
    )


def use_native(params: dict, activations: str = "float32") -> dict:
    """The params pytree with every `GGUFWeight` marked `native` (multiplied by this kernel in
    small steps; the stacks read in place by the layer scan, `ops.linear.reads_in_place`) and
    multiplied with `activations` ("float32" | "int8").

    Raises:
        ValueError: an unknown `activations`.
    """
    if activations not in ACTIVATIONS:
        raise ValueError(f"gguf_activations must be one of {ACTIVATIONS}, got {activations!r}")

    def mark(w):
        if isinstance(w, GGUFWeight):
            return w.replace(native=True, activations=activations)
        return w

    return jax.tree.map(mark, params, is_leaf=lambda w: isinstance(w, GGUFWeight))
