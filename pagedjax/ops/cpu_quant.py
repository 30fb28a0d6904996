"""Native CPU matmul over int8 and AWQ / GPTQ int4 weights: y = x @ W[layer]
(`csrc/quant_linear_cpu.cc`).

The kernel multiplies float32 activations by a `quant.QuantizedWeight` of method "int8"
(weight-only) or "awq" / "gptq" (4-bit), in the layout `ops.quant` gives them (qweight
[L, in, out] int8 or [L, in // 8, out] int32, scales, zeros): no re-layout at load, and the
float32 weights are never materialised. It dequantizes one panel of output columns at a time
in registers (or, for more than 4 rows, into a small float buffer) and accumulates x times the
dequantized weights in float32, every output by one chain of fused multiply-adds over the
input index in order, so a row's result does not depend on the step's size. It takes the
whole stack of layers and the layer index, reading the layer in place (inside the model's
`lax.scan`, XLA would otherwise copy each layer's slice out of the stack). GPTQ act-order:
x's columns are gathered into the stored row order first (`x[:, perm[layer]]`).

`ops.linear.linear` runs it for a `QuantizedWeight` marked `native` (`use_native`, done by
the engine under `linear_backend="cpu"`) in steps of at most `MAX_TOKENS` tokens; larger
steps slice the layer and take `quant.quantized_matmul` (XLA). Not covered, and left on XLA:
"w8a8" and "fp8" (their activations are quantized too), mixture-of-experts expert stacks
[L, E, in, out], and int4 weights whose group size is not a multiple of 8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.ops import cpu_kernels
from pagedjax.ops.choices import INT4_METHODS
from pagedjax.ops.quant import LINEAR_WEIGHTS, QuantizedWeight

TARGETS = {"int8": "pagedjax_quant_int8_linear_cpu", "int4": "pagedjax_quant_int4_linear_cpu"}
# Steps of more tokens than this take `quant.quantized_matmul` (XLA) instead.
MAX_TOKENS = 128


def supports(w) -> bool:
    """True for a weight the kernel multiplies: a stacked [L, in, out] `QuantizedWeight` of
    method "int8", or of "awq" / "gptq" with a group size that is a multiple of 8."""
    if not isinstance(w, QuantizedWeight) or len(w.shape) != 3:
        return False
    if w.method == "int8":
        return w.qweight.ndim == 3
    return w.method in INT4_METHODS and w.in_features % 8 == 0 and w.group_size % 8 == 0


def matmul(
    x: jax.Array,
    w: QuantizedWeight,
    layer: jax.Array | int = 0,
    num_rows: jax.Array | int | None = None,
    *,
    isa: str | None = None,
) -> jax.Array:
    """x @ W[layer] in float32, for the first `num_rows` rows of x.

    Args:
        x: [M, K] activations (any float dtype; computed in float32).
        w: a `QuantizedWeight` ("int8", "awq" or "gptq") of a stack [L, K, N], or of one
            layer [K, N] (read as a stack of one).
        layer: scalar int32 index into the L axis (traced or not).
        num_rows: scalar int32 (traced or not): rows [0, num_rows) of x are multiplied, the
            others give zeros; clipped to [0, M]. None: all M.
        isa: the kernel's ISA path (`cpu_kernels.ISAS`); None: `cpu_kernels.default_isa()`.

    Returns:
        [M, N] float32.

    Raises:
        RuntimeError: the native kernels are unavailable.
        ValueError: a method the kernel does not take, x's K not the weight's, an int4 group
            size that is not a multiple of 8, or an ISA path this CPU cannot run.
    """
    if not isinstance(w, QuantizedWeight) or w.method not in ("int8", *INT4_METHODS):
        raise ValueError(f"native quantized matmul takes int8 / awq / gptq weights, not {w!r:.80}")
    if x.ndim != 2 or x.shape[1] != w.in_features:
        raise ValueError(
            f"quantized matmul: x {x.shape} and a weight of K={w.in_features} disagree"
        )
    int4 = w.method in INT4_METHODS
    if int4 and (w.in_features % 8 or w.group_size % 8):
        raise ValueError(f"native int4 matmul needs groups of a multiple of 8 rows, not {w.shape}")
    if len(w.shape) == 2:  # one layer: a stack of one
        w = jax.tree.map(lambda a: a[None], w)
    target = cpu_kernels.target(TARGETS["int4" if int4 else "int8"], isa)
    layer = jnp.asarray(layer, jnp.int32).reshape(())
    rows = jnp.asarray(x.shape[0] if num_rows is None else num_rows, jnp.int32).reshape(())
    x = x.astype(jnp.float32)
    if w.perm is not None:  # GPTQ act-order: stored row i is input perm[i]
        x = jnp.take(x, jax.lax.dynamic_index_in_dim(w.perm, layer, 0, False), axis=1)
    call = jax.ffi.ffi_call(
        target, jax.ShapeDtypeStruct((x.shape[0], w.scales.shape[-1]), jnp.float32)
    )
    if int4:
        return call(x, w.qweight, w.scales, w.zeros, layer, rows)
    return call(x, w.qweight, w.scales, layer, rows)


def use_native(params: dict) -> dict:
    """The params pytree with every decoder linear weight `supports` takes marked `native`
    (multiplied by this kernel in small steps; the stacks read in place by the layer scan,
    `ops.linear.reads_in_place`). Other leaves, expert stacks included, are unchanged."""
    layers = dict(params["layers"])
    for name in LINEAR_WEIGHTS:
        if supports(layers.get(name)):
            layers[name] = layers[name].replace(native=True)
    return {**params, "layers": layers}
