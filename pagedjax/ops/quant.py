"""Quantized weights: their layout, quantization on load, dequantization and their matmul.

Every linear layer of the model calls `ops.linear.linear(x, w)`, which hands a
`QuantizedWeight` to `quantized_matmul` here; a fused GPU kernel replaces a method in
`quantized_matmul`, and nowhere else. On CPU (`linear_backend="cpu"`) int8 and AWQ / GPTQ
stacks marked `native` go to the native kernel of `ops.cpu_quant` instead, in steps of up to
128 tokens. This module imports no other weight kind.

Methods (vLLM's `quantization=` values and meanings):
    "int8"  weight-only int8: symmetric per-output-channel scales, activations stay in the
            model dtype: y = (x @ q) * s_w.
    "w8a8"  int8 weights as above and dynamic per-token symmetric int8 activations
            (s_x = max|x_t| / 127); the matmul multiplies int8 by int8 accumulating in int32
            (`preferred_element_type`), then rescales: y = (x_q @ q) * s_x * s_w.
    "fp8"   float8_e4m3fn weights with per-output-channel scales (s_w = max|w_col| / 448) and
            per-token dynamic activation scales (s_x = max|x_t| / 448), or a checkpoint's
            static per-tensor `input_scale`; products accumulate in float32.
    "awq", "gptq"  4-bit weights with per-group scales and zero points,
            w = (q - z[group]) * s[group], from AutoAWQ / GPTQ checkpoints
            (`models.quant_loader` converts both packings into the one layout below).

Layout of a `QuantizedWeight` (a pytree; when stacked for the model every leaf has a leading
L axis, written `...` below, and `lax.scan` hands each layer its slice):
    qweight  int8 [..., in, out] (int8, w8a8) | float8_e4m3fn [..., in, out] (fp8)
             | int32 [..., in // 8, out] (int4: input row 8r + j of column o sits in bits
             4j .. 4j + 3 of qweight[r, o], GPTQ's sequential order)
    scales   float32 [..., out] (int8, w8a8, fp8) | float32 [..., G, out] (int4; G groups of
             `group_size` consecutive input rows)
    zeros    int4 only: int8 [..., G, out], the integer that stands for 0.0 (0 .. 16)
    perm     int4 with GPTQ act-order only: int32 [..., in]; rows are stored sorted by group,
             so the layer computes x[..., perm] @ W_sorted (= x @ W)
    input_scale  fp8 with a static activation scale only: float32 [...]

Scales are float32 whatever the model dtype; embeddings, norms and the LM head are never
quantized (as in vLLM, whose quantized linear methods cover the decoder's linear layers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pagedjax.ops.choices import INT4_METHODS, QUANTIZE_ON_LOAD
from pagedjax.ops.choices import QUANTIZATION_METHODS as METHODS

# The decoder's linear layers, the params under "layers/" that quantization replaces.
LINEAR_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A mixture-of-experts model's expert stacks [L, E, in, out] (`models.moe`): quantized on load
# too (int8, w8a8, fp8), each expert with its own per-output-channel scales [L, E, out].
EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")
QUANTIZED_WEIGHTS = LINEAR_WEIGHTS + EXPERT_WEIGHTS
INT8_MAX = 127.0
FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(FP8_DTYPE).max)  # 448
_TINY = 1e-12  # floor of an amax, so that an all-zero row or column gets a finite scale


@struct.dataclass
class QuantizedWeight:
    """A quantized [in, out] weight (see the module docstring for every field's layout).

    Attributes:
        qweight, scales, zeros, perm, input_scale: arrays (None where a method has none).
        method: one of METHODS (static: part of the pytree structure).
        in_features: the unpacked input size `in` (static).
        native: False (the default): `quantized_matmul` (XLA) on the layer's slice; True: a
            stack [L, ...] read in place by the native CPU kernel in small steps
            (`ops.cpu_quant`, marked by `cpu_quant.use_native` under `linear_backend="cpu"`;
            same layout, static).
    """

    qweight: jax.Array
    scales: jax.Array
    zeros: jax.Array | None = None
    perm: jax.Array | None = None
    input_scale: jax.Array | None = None
    method: str = struct.field(pytree_node=False, default="int8")
    in_features: int = struct.field(pytree_node=False, default=0)
    native: bool = struct.field(pytree_node=False, default=False)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [..., in, out] of the float weight it stands for."""
        lead = self.scales.shape[:-2] if self.method in INT4_METHODS else self.scales.shape[:-1]
        return (*lead, self.in_features, self.scales.shape[-1])

    @property
    def group_size(self) -> int:
        """Input rows per scale group (int4); `in` for per-channel methods."""
        if self.method in INT4_METHODS:
            return self.in_features // self.scales.shape[-2]
        return self.in_features


# ----------------------------------------------------------------------------- quantize


def quantize_int8(w: jax.Array, method: str = "int8") -> QuantizedWeight:
    """Symmetric per-output-channel int8: s = max_i |w[i, o]| / 127, q = round(w / s).

    w: [..., in, out] float. method: "int8" or "w8a8" (same storage; it decides
    `quantized_matmul`). The rounding error of each weight is at most s / 2.
    """
    w32 = w.astype(jnp.float32)
    scales = jnp.maximum(jnp.max(jnp.abs(w32), axis=-2), _TINY) / INT8_MAX  # [..., out]
    q = jnp.clip(jnp.round(w32 / scales[..., None, :]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return QuantizedWeight(q, scales, method=method, in_features=w.shape[-2])


def quantize_fp8(w: jax.Array) -> QuantizedWeight:
    """float8_e4m3fn with per-output-channel scales s = max_i |w[i, o]| / 448.

    w: [..., in, out] float. Each weight keeps 4 significant bits: a relative error of at
    most 2**-4 (normal values), an absolute one of at most 2**-10 * s (subnormals).
    """
    w32 = w.astype(jnp.float32)
    scales = jnp.maximum(jnp.max(jnp.abs(w32), axis=-2), _TINY) / FP8_MAX  # [..., out]
    q = to_fp8(w32 / scales[..., None, :], FP8_DTYPE)
    return QuantizedWeight(q, scales, method="fp8", in_features=w.shape[-2])


def to_fp8(x: jax.Array, dtype=FP8_DTYPE) -> jax.Array:
    """Casts to a float8 dtype, saturating at its largest finite value (a plain cast of an
    out-of-range value gives NaN in e4m3fn, inf in e5m2), as vLLM's scaled conversions do."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(x, -fmax, fmax).astype(dtype)


_quantize_jit = jax.jit(
    lambda w, method: quantize_fp8(w) if method == "fp8" else quantize_int8(w, method),
    static_argnames="method",
)


def quantize_weight(w: jax.Array, method: str) -> QuantizedWeight:
    """Quantizes one float weight [..., in, out] with a quantize-on-load method.

    Raises:
        ValueError: `method` is not one of QUANTIZE_ON_LOAD (AWQ and GPTQ need a checkpoint).
    """
    if method not in QUANTIZE_ON_LOAD:
        raise ValueError(
            f"quantization {method!r} cannot be computed from float weights; "
            f"quantize-on-load methods: {', '.join(QUANTIZE_ON_LOAD)}"
        )
    return _quantize_jit(w, method=method)


def quantize_params(params: dict, method: str) -> dict:
    """The params pytree with every decoder linear weight and expert stack quantized (others
    unchanged)."""
    layers = dict(params["layers"])
    for name in QUANTIZED_WEIGHTS:
        if name in layers and not isinstance(layers[name], QuantizedWeight):
            layers[name] = quantize_weight(layers[name], method)
    return {**params, "layers": layers}


# ----------------------------------------------------------------------------- dequantize


def unpack_int4_rows(qweight: jax.Array) -> jax.Array:
    """int32 [..., in // 8, out] -> int32 [..., in, out] values 0..15 (row 8r + j from bits
    4j .. 4j + 3 of row r)."""
    shifts = 4 * jnp.arange(8, dtype=jnp.int32)  # [8]
    nibbles = (qweight[..., :, None, :] >> shifts[:, None]) & 0xF  # [..., in/8, 8, out]
    *lead, rows, _, out = nibbles.shape
    return nibbles.reshape(*lead, rows * 8, out)


def _dequantize_sorted(w: QuantizedWeight, dtype) -> jax.Array:
    """The float weight [..., in, out], int4 rows in stored (group-sorted) order."""
    if w.method in ("int8", "w8a8", "fp8"):
        return (w.qweight.astype(jnp.float32) * w.scales[..., None, :]).astype(dtype)
    q = unpack_int4_rows(w.qweight)  # [..., in, out]
    *lead, n_in, out = q.shape
    G = w.scales.shape[-2]
    q = q.reshape(*lead, G, n_in // G, out)  # [..., G, group_size, out]
    deq = (q - w.zeros[..., :, None, :].astype(jnp.int32)).astype(jnp.float32)
    deq = deq * w.scales[..., :, None, :]
    return deq.reshape(*lead, n_in, out).astype(dtype)


def dequantize(w: QuantizedWeight | jax.Array, dtype=jnp.float32) -> jax.Array:
    """The float weight [..., in, out] a quantized weight stands for, rows in the original
    input order (GPTQ act-order undone). A plain array is returned as it is."""
    if not isinstance(w, QuantizedWeight):
        return w
    deq = _dequantize_sorted(w, dtype)
    if w.perm is None:
        return deq
    # Stored row i is original row perm[i].
    inv = jnp.argsort(w.perm, axis=-1)  # [..., in]
    return jnp.take_along_axis(deq, inv[..., :, None], axis=-2)


# ----------------------------------------------------------------------------- matmul


def _contract_last(x: jax.Array, w: jax.Array, acc_dtype) -> jax.Array:
    """x [..., in] times w [in, out] -> [..., out] accumulated in `acc_dtype`."""
    return jax.lax.dot_general(
        x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=acc_dtype
    )


def quantized_matmul(x: jax.Array, w: QuantizedWeight) -> jax.Array:
    """x @ W for a quantized weight of one layer (the method's arithmetic above).

    Args:
        x: [T, in] activations in the model dtype.
        w: a `QuantizedWeight` of one layer (no leading L axis), logical shape [in, out].

    Returns:
        [T, out] in x's dtype.

    Raises:
        ValueError: `w.method` is not one of METHODS.
    """
    if w.method == "int8":
        y = x @ w.qweight.astype(x.dtype)  # [T, out]
        return y * w.scales.astype(x.dtype)
    x32 = x.astype(jnp.float32)
    if w.method == "w8a8":
        amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)  # [T, 1]
        x_scale = jnp.maximum(amax, _TINY) / INT8_MAX
        xq = jnp.clip(jnp.round(x32 / x_scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)  # [T, in]
        acc = _contract_last(xq, w.qweight, jnp.int32)  # [T, out] int32
        return (acc.astype(jnp.float32) * x_scale * w.scales).astype(x.dtype)
    if w.method == "fp8":
        if w.input_scale is not None:  # static per-tensor scale from the checkpoint
            x_scale = w.input_scale.astype(jnp.float32)
        else:
            amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)  # [T, 1]
            x_scale = jnp.maximum(amax, _TINY) / FP8_MAX
        xq = to_fp8(x32 / x_scale, FP8_DTYPE)  # [T, in]
        acc = _contract_last(xq, w.qweight, jnp.float32)  # [T, out]
        return (acc * x_scale * w.scales).astype(x.dtype)
    if w.method in INT4_METHODS:
        if w.perm is not None:
            x = jnp.take(x, w.perm, axis=-1)  # [T, in], the stored row order
        return x @ _dequantize_sorted(w, x.dtype)
    raise ValueError(f"unknown quantization method {w.method!r}; known: {', '.join(METHODS)}")


def weight_bytes(params) -> int:
    """Bytes of every array in a params pytree (quantized leaves at their stored size)."""
    return sum(int(x.nbytes) for x in jax.tree.leaves(params))
