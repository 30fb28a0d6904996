"""The one entry point of every linear layer: `linear(x, w)`, dispatched on the weight's kind.

The model (`models.llama`: the seven linear layers of each decoder layer and the LM head)
never looks at how a weight is stored; it calls `linear(x, w)` and this module picks the
matmul. Weight kinds:
    plain      a float array [in, out] (the model dtype): XLA's dot, x @ w.
    quantized  an `ops.quant.QuantizedWeight` of one layer (int8, w8a8, fp8, awq / gptq
               int4; layouts in `ops.quant`): `quant.quantized_matmul`; a stack marked
               `native` (int8, awq / gptq: `ops.cpu_quant.use_native`, the engine's
               `linear_backend="cpu"`) is read in place as a `LayerView` by the native kernel
               (`ops.cpu_quant.matmul`) in steps of up to `cpu_quant.MAX_TOKENS` tokens, else
               its layer is sliced and goes to `quantized_matmul`.
    packed     float32 weights pre-packed in the native CPU matmul's panel layout
               (`ops.cpu_linear.PackedWeight`, `cpu_linear.pack_params`, the engine's
               `linear_backend="cpu"`), either a `LayerView` (layer i of a stacked
               [L, in, out] weight, read in place by the kernel) or a `PackedWeight` holding
               one weight ([in, out], or a stack of one, [1, in, out]: the LM head).
    gguf       GGUF quantized blocks kept as in the file (`ops.gguf_quant.GGUFWeight`): the
               native kernel (`ops.cpu_gguf.matmul`) in steps of up to `cpu_gguf.MAX_TOKENS`
               tokens (every step with int8 activations on AVX-512 VNNI,
               `cpu_gguf.int8_every_size`) when the weight is marked `native` (a stack then
               read in place, as a `LayerView`) and in larger steps the layer dequantized by
               the native kernel (`cpu_gguf.dequantize`) and XLA's dot; a weight not marked
               `native`: the layer dequantized inside the step by XLA and XLA's dot
               (`gguf_quant.matmul_xla`).
A new kind is one more branch of `linear` and, if it is stored stacked and read in place, of
`reads_in_place`; nothing in the model changes.

Stacked weights and `lax.scan`: the model scans its layers over weights stacked on a leading
L axis. `split_layers` splits those weights into the ones the scan slices (plain and quantized
leaves, handed to the scan as xs, as usual) and the ones read in place (packed stacks, kept
out of xs: inside the scan, XLA's CPU backend copies each layer's slice out of the stack
before a dot, the copy the native kernel exists to avoid); `layer_weights` gives the scan body
its layer's weights, the in-place ones as `LayerView`s, so that the body runs every linear
layer the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from pagedjax.ops import cpu_gguf, cpu_linear, cpu_quant
from pagedjax.ops.gguf_quant import GGUFWeight, matmul_xla
from pagedjax.ops.quant import QuantizedWeight, quantized_matmul

Weight = Any  # jax.Array | QuantizedWeight | cpu_linear.PackedWeight | GGUFWeight | LayerView


@struct.dataclass
class LayerView:
    """Layer `index` of a stacked weight, read in place (a pytree).

    Attributes:
        stack: a `cpu_linear.PackedWeight` of float32 [L, in, out], a native
            `gguf_quant.GGUFWeight` of [L, out, row_bytes] blocks, or a native
            `quant.QuantizedWeight` stack (logical shape [L, in, out]).
        index: scalar int32 (traced or not), the layer in [0, L).
    """

    stack: cpu_linear.PackedWeight | GGUFWeight | QuantizedWeight
    index: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [in, out] of the one layer's weight."""
        return self.stack.shape[1:]


def linear(x: jax.Array, w: Weight, *, num_rows: jax.Array | int | None = None) -> jax.Array:
    """The linear layer x @ W, whatever kind of weight W is (see the module docstring).

    Args:
        x: [T, in] activations in the model dtype.
        w: the weight of one layer, logical shape [in, out]: a plain array, a
            `QuantizedWeight`, a `LayerView` of a packed stack, or a `PackedWeight` holding
            one weight ([in, out] or [1, in, out]).
        num_rows: scalar int32 (traced or not), the number of real rows of x (they come
            first; a step padded to its shape bucket passes its real token count), or None:
            all T. The packed kind multiplies only these rows and gives zeros past them; the
            others compute every row, so rows past `num_rows` are unspecified.

    Returns:
        [T, out] in x's dtype (a packed weight computes in float32 and casts back).

    Raises:
        ValueError: a `PackedWeight` of a stack of more than one layer (index it with a
            `LayerView`), a quantized weight of an unknown method, or shapes that disagree.
        RuntimeError: a packed weight in a step the native kernel runs, where the kernels
            are unavailable (`cpu_kernels.available()` is False).
    """
    if isinstance(w, QuantizedWeight):
        return quantized_matmul(x, w)
    if isinstance(w, LayerView) and isinstance(w.stack, QuantizedWeight):
        return _quant_linear(x, w, num_rows)
    if isinstance(w, GGUFWeight) or (isinstance(w, LayerView) and isinstance(w.stack, GGUFWeight)):
        return _gguf_linear(x, w, num_rows)
    if isinstance(w, LayerView):
        if w.stack.max_rows and x.shape[0] > w.stack.max_rows:
            return _unpacked_dot(x, w)
        return cpu_linear.matmul(x, w.stack, w.index, num_rows).astype(x.dtype)
    if isinstance(w, cpu_linear.PackedWeight):
        # One weight, not a stack: unpacking would copy all of it on every call.
        if len(w.shape) == 2:
            w = cpu_linear.PackedWeight(w.panels[None], w.n)
        if w.shape[0] != 1:
            raise ValueError(
                f"linear takes one layer's weight; a packed stack {w.shape} needs a LayerView"
            )
        return cpu_linear.matmul(x, w, 0, num_rows).astype(x.dtype)
    return x @ w


def _unpacked_dot(x: jax.Array, w: LayerView) -> jax.Array:
    """XLA's dot on layer w.index of the stack, unpacked (a transposing copy): the
    `batch_invariant=False` engine's path for steps of more than `max_rows` tokens, where
    the copy is small next to the dot (rows then depend on the step's size in their last
    bits: XLA picks its blocking by shape)."""
    layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, w.index, 0, False), w.stack)
    return x @ cpu_linear.unpack(layer).astype(x.dtype)


def _gguf_linear(x: jax.Array, w: GGUFWeight | LayerView, num_rows) -> jax.Array:
    """A GGUF weight (one layer's, or a `LayerView` of a native stack): the native kernel for
    a native weight in a step of up to `cpu_gguf.MAX_TOKENS` rows (of any size where
    `cpu_gguf.int8_every_size`), its layer dequantized by the native kernel and XLA's dot in
    larger steps; XLA alone for other weights."""
    stack, index = (w.stack, w.index) if isinstance(w, LayerView) else (w, 0)
    if stack.native and (x.shape[0] <= cpu_gguf.MAX_TOKENS or cpu_gguf.int8_every_size(stack)):
        return cpu_gguf.matmul(x, stack, index, num_rows).astype(x.dtype)
    if stack.native:
        wt = cpu_gguf.dequantize(stack, index).astype(x.dtype)  # [out, in]
        return jax.lax.dot_general(x, wt, (((x.ndim - 1,), (1,)), ((), ())))
    if isinstance(w, LayerView):
        stack = stack.replace(blocks=jax.lax.dynamic_index_in_dim(stack.blocks, index, 0, False))
    return matmul_xla(x, stack)


def _quant_linear(x: jax.Array, w: LayerView, num_rows) -> jax.Array:
    """A `LayerView` of a native `QuantizedWeight` stack: the native kernel in a step of up to
    `cpu_quant.MAX_TOKENS` rows, else the layer sliced and `quantized_matmul` (XLA)."""
    if x.shape[0] <= cpu_quant.MAX_TOKENS:
        return cpu_quant.matmul(x, w.stack, w.index, num_rows).astype(x.dtype)
    layer = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, w.index, 0, False), w.stack)
    return quantized_matmul(x, layer.replace(native=False))


def reads_in_place(w: Weight) -> bool:
    """True for a stacked weight kind that `linear` reads layer by layer in place (a
    `cpu_linear.PackedWeight` of [L, in, out], a native `GGUFWeight` or `QuantizedWeight`
    stack), which `lax.scan` must not slice."""
    if isinstance(w, GGUFWeight | QuantizedWeight):
        return w.native
    return isinstance(w, cpu_linear.PackedWeight)


def split_layers(layers: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Splits stacked per-layer params (every leaf with a leading L axis) into
    (sliced, in_place): `sliced` for `lax.scan`'s xs (plain and quantized weights, norms,
    biases, scales), `in_place` the stacks `reads_in_place` (packed weights)."""
    in_place = {name: w for name, w in layers.items() if reads_in_place(w)}
    sliced = {name: w for name, w in layers.items() if name not in in_place}
    return sliced, in_place


def layer_weights(
    sliced: Mapping[str, Any], in_place: Mapping[str, Any], index: jax.Array
) -> dict[str, Any]:
    """Layer `index`'s params inside the scan body: `sliced` (the scan's slice of the first
    part of `split_layers`) and a `LayerView(stack, index)` for each in-place stack.

    Args:
        sliced: the layer's slice of the sliced params (no leading L axis).
        in_place: the in-place stacks, whole.
        index: scalar int32, the layer (the scan's counter).
    """
    index = jnp.asarray(index, jnp.int32)
    return {**sliced, **{name: LayerView(w, index) for name, w in in_place.items()}}


def expert_linear(x: jax.Array, w: Weight, expert: jax.Array) -> jax.Array:
    """The grouped matmul of a mixture-of-experts layer: tile t of `x` times expert
    `expert[t]`'s weight, for every tile at once, whatever kind the expert stack is.

    Args:
        x: [n_tiles, m, in] activations in the model dtype (m rows per tile, all routed to
            one expert), tiles sorted by expert.
        w: a stack of expert weights, logical shape [E, in, out]: a plain array or a
            `QuantizedWeight` (int8, w8a8, fp8) whose leaves lead with E.
        expert: [n_tiles] int32 in [0, E], the expert of each tile; E marks a tile of
            assignments to experts held on another device (expert parallelism), whose rows
            the caller drops: the native kernel writes zeros there, the XLA paths compute
            them with expert E - 1.

    Returns:
        [n_tiles, m, out] in x's dtype. On XLA each tile reads one expert's weight (a gather
        of n_tiles weights), so the FLOPs are 2 * n_tiles * m * in * out, whatever E is.
        A `LayerView` of a packed expert stack (`cpu_linear.pack_params`, the engine's
        `linear_backend="cpu"`) is one native call at every step size
        (`cpu_linear.grouped_matmul`): each run of one expert's tiles reads that expert in
        place, once.

    Raises:
        ValueError: a weight kind the grouped matmul does not take (packed CPU panels; int4).
    """
    if isinstance(w, LayerView):
        stack = w.stack
        if not isinstance(stack, cpu_linear.PackedWeight):
            raise ValueError(f"a layer view of {type(stack).__name__} is not an expert stack")
        return cpu_linear.grouped_matmul(x, stack, w.index, expert).astype(x.dtype)
    if isinstance(w, cpu_linear.PackedWeight):
        raise ValueError("a packed expert stack is read through a LayerView of its layer")
    expert = jnp.minimum(expert, w.shape[0] - 1)
    if isinstance(w, QuantizedWeight):
        if w.method not in ("int8", "w8a8", "fp8"):
            raise ValueError(f"expert weights quantized as {w.method!r} are not supported")
        picked = jax.tree.map(lambda a: jnp.take(a, expert, axis=0), w)
        return jax.vmap(quantized_matmul)(x, picked)
    picked = jnp.take(w, expert, axis=0)  # [n_tiles, in, out]
    return jnp.einsum("tmi,tio->tmo", x, picked.astype(x.dtype))
