"""Native float32 matmul for the CPU over a stacked weight: y = x @ W[layer] (`cpu_kernels`).

Inside the model's `lax.scan` over layers, XLA's CPU backend copies each layer's weight out of
the stacked [L, in, out] array before every dot (a dynamic-slice); at decode batch sizes the
copy costs about half as much as the dot. `csrc/linear_cpu.cc` takes the whole stacked array
and the layer index and reads the layer in place, with a blocked GEMM (packed operands, a
6 x 16 register micro-kernel) over XLA's intra-op thread pool.

The kernel takes its weight pre-packed in the micro-kernel's 16-column panel layout, a
`PackedWeight` (`pack`), and reads each panel as one sequential stream (at decode sizes 10-40 %
faster than packing the weight on each call). The engine packs the float32 linear weights and
the LM head once at load under `linear_backend="cpu"` (`pack_params`).

A `PackedWeight` is one of the weight kinds of `ops.linear.linear`, the model's one linear
entry point: a layer of a packed stack (`ops.linear.LayerView`) and a packed LM head, run
through `matmul` on the step's real rows only, in steps of every size: each output element
is one chain of fused multiply-adds over k in order, whatever the number of rows, so a
request's logits do not depend on what else is in its step (the engine's `batch_invariant`,
on by default). With `batch_invariant=False` the stack's `max_rows` is `MAX_TOKENS`: a layer
in a larger step multiplies with XLA's dot, unpacked (`unpack`, a transposing copy small next
to a dot of that size), whose rounding depends on the step's shape.

`grouped_matmul` is the mixture-of-experts form over a packed [L, E, K, N] expert stack: tiles
of rows sorted by expert, each run of one expert's tiles against that expert read in place,
in one call at every step size (`ops.linear.expert_linear`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pagedjax.ops import cpu_kernels
from pagedjax.ops.quant import EXPERT_WEIGHTS, LINEAR_WEIGHTS

TARGET = "pagedjax_linear_cpu"
GROUPED_TARGET = "pagedjax_grouped_linear_cpu"
# With `batch_invariant=False`, `ops.linear` uses the kernel on a layer of a packed stack for
# steps of at most this many tokens and XLA's dot on larger ones.
MAX_TOKENS = 128
PANEL = 16  # columns per panel of a PackedWeight (the kernel's NR)


@struct.dataclass
class PackedWeight:
    """A float32 [L, K, N] linear weight in the kernel's panel layout.

    Attributes:
        panels: float32 [L, ceil(N / 16), K, 16]: panels[l, p, k, c] = W[l, k, 16 p + c],
            zeros past column N.
        n: N, the number of output columns (static).
        max_rows: 0 (the default): a layer of the stack (`ops.linear.LayerView`) runs through
            the native matmul at every step size, so that each row is reduced in one order
            whatever the step (batch invariance); > 0: steps of more rows than this use
            XLA's dot on the unpacked layer instead (static; the engine's
            `batch_invariant=False` sets MAX_TOKENS).
    """

    panels: jax.Array
    n: int = struct.field(pytree_node=False)
    max_rows: int = struct.field(pytree_node=False, default=0)

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape: [L, K, N], or [K, N] for one layer's slice."""
        *lead, _, k, _ = self.panels.shape
        return (*lead, k, self.n)

    @property
    def dtype(self):
        return self.panels.dtype


def pack(w: jax.Array) -> PackedWeight:
    """[L, K, N] float32 -> `PackedWeight` (a copy).

    Raises:
        ValueError: w is not a float32 [L, K, N] array.
    """
    if w.ndim != 3 or jnp.dtype(w.dtype) != jnp.float32:
        raise ValueError(f"pack takes a float32 [L, K, N] weight, not {w.dtype} {w.shape}")
    L, K, N = w.shape
    P = -(-N // PANEL)
    padded = jnp.pad(w, ((0, 0), (0, 0), (0, P * PANEL - N)))
    return PackedWeight(padded.reshape(L, K, P, PANEL).transpose(0, 2, 1, 3), N)


def unpack(w: PackedWeight) -> jax.Array:
    """`pack` undone (a copy): panels [..., P, K, 16] -> [..., K, N], for the whole stack or
    one layer's slice of it."""
    *lead, P, K, _ = w.panels.shape
    return jnp.swapaxes(w.panels, -3, -2).reshape(*lead, K, P * PANEL)[..., : w.n]


def pack_params(params: dict, max_rows: int = 0) -> dict:
    """The params pytree with its float32 linear weights (`quant.LINEAR_WEIGHTS` of
    params["layers"]) replaced by `PackedWeight`s (a mixture-of-experts model's router
    [L, D, E] too, so that its logits, and so each token's choice of experts and their
    weights, do not depend on the step's other rows; and its expert stacks [L, E, K, N], as
    panels [L, E, P, K, 16]: `ops.linear.expert_linear`), and
    the LM head packed as params["lm_head"], a `PackedWeight` of [1, D, V]; other leaves
    (quantized weights, norms, embeddings) unchanged. With tied embeddings the packed LM
    head is a second, transposed copy of the embedding matrix (V x D float32: 113 MB for
    SmolLM2-135M). Each weight is converted on its own, so the extra memory at any time is
    one weight's. `max_rows`: the layers' `PackedWeight.max_rows` (0: native at every step
    size)."""
    layers = dict(params["layers"])
    pack_jit = jax.jit(pack)
    for name in (*LINEAR_WEIGHTS, "router"):
        if supports(layers.get(name)) and not isinstance(layers[name], PackedWeight):
            packed = jax.block_until_ready(pack_jit(layers[name]))
            layers[name] = packed.replace(max_rows=max_rows)
    for name in EXPERT_WEIGHTS:  # [L, E, K, N] -> panels [L, E, P, K, 16]
        w = layers.get(name)
        if supports(w) and w.ndim == 4:
            L, E, K, N = w.shape
            p = jax.block_until_ready(pack_jit(w.reshape(L * E, K, N)))
            layers[name] = PackedWeight(p.panels.reshape(L, E, *p.panels.shape[1:]), p.n)
    out = {**params, "layers": layers}
    head = params.get("lm_head")
    if head is None and supports(params.get("embed_tokens")):
        out["lm_head"] = jax.block_until_ready(
            jax.jit(lambda e: pack(e.T[None]))(params["embed_tokens"])
        )
    elif supports(head) and not isinstance(head, PackedWeight):
        out["lm_head"] = jax.block_until_ready(pack_jit(head[None]))
    return out


def unpack_params(params: dict, tie_word_embeddings: bool) -> dict:
    """`pack_params` undone: every `PackedWeight` back to [L, K, N] (the LM head to [D, V],
    or dropped when `tie_word_embeddings`)."""
    layers = {
        name: unpack(w) if isinstance(w, PackedWeight) else w
        for name, w in params["layers"].items()
    }
    out = {**params, "layers": layers}
    if isinstance(out.get("lm_head"), PackedWeight):
        if tie_word_embeddings:
            del out["lm_head"]
        else:
            out["lm_head"] = unpack(out["lm_head"])[0]
    return out


def supports(w) -> bool:
    """True for a weight `pack_params` packs: a float32 array (not a quantized weight)."""
    return isinstance(w, jax.Array | np.ndarray) and jnp.dtype(w.dtype) == jnp.float32


def matmul(
    x: jax.Array,
    w: PackedWeight,
    layer: jax.Array | int = 0,
    num_rows: jax.Array | int | None = None,
    *,
    isa: str | None = None,
) -> jax.Array:
    """x @ W[layer], in float32, for the first `num_rows` rows of x.

    Args:
        x: [M, K] activations (any float dtype; computed in float32).
        w: a `PackedWeight` of float32 [L, K, N] stacked weights.
        layer: scalar int32 index into the L axis (traced or not).
        num_rows: scalar int32 (traced or not): only rows [0, num_rows) of x are multiplied,
            the others give zeros; clipped to [0, M]. None: all M. A step padded to its
            shape bucket passes its number of real tokens, so padding costs no arithmetic.
        isa: the kernel's ISA path (`cpu_kernels.ISAS`); None: `cpu_kernels.default_isa()`.

    Returns:
        [M, N] float32.

    Raises:
        RuntimeError: the kernels are unavailable (`cpu_kernels.available()` is False).
        ValueError: w is not a `PackedWeight` ([L, K, N] float32), the shapes disagree, or
            an ISA path this CPU cannot run.
    """
    target = cpu_kernels.target(TARGET, isa)
    if not isinstance(w, PackedWeight) or len(w.shape) != 3:
        raise ValueError(f"native CPU matmul takes a PackedWeight of [L, K, N], not {w!r:.80}")
    if x.ndim != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(
            f"native CPU matmul: x [M, K] and w [L, K, N] disagree on K: {x.shape}, {w.shape}"
        )
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], w.n), jnp.float32))
    rows = x.shape[0] if num_rows is None else num_rows
    return call(
        x.astype(jnp.float32),
        w.panels,
        jnp.asarray(layer, jnp.int32).reshape(()),
        jnp.asarray(rows, jnp.int32).reshape(()),
    )


def grouped_matmul(
    x: jax.Array,
    w: PackedWeight,
    layer: jax.Array | int,
    expert: jax.Array,
    *,
    isa: str | None = None,
) -> jax.Array:
    """The grouped matmul of a mixture-of-experts layer over a packed expert stack:
    y[t] = x[t] @ W[layer, expert[t]], in float32, in one native call.

    Consecutive tiles of one expert are multiplied together, reading that expert's panels
    in place once per call: the bytes read follow the experts the step uses, not the number
    of experts. Each row's result is bit-identical to `matmul` of that row alone on the same
    expert (one chain of fused multiply-adds over k per element).

    Args:
        x: [n_tiles, m, K] activations (any float dtype; computed in float32), tiles sorted
            by expert (`models.moe_layer.group_layout`).
        w: a `PackedWeight` of float32 [L, E, K, N] expert stacks (panels
            [L, E, ceil(N / 16), K, 16]: `pack_params`).
        layer: scalar int32 index into the L axis (traced or not).
        expert: [n_tiles] int32: each tile's expert; a tile whose expert is outside [0, E)
            (assignments to experts held on another device) gives zeros.
        isa: as in `matmul`.

    Returns:
        [n_tiles, m, N] float32.

    Raises:
        RuntimeError: the kernels are unavailable.
        ValueError: w is not a packed [L, E, K, N] stack, or the shapes disagree.
    """
    target = cpu_kernels.target(GROUPED_TARGET, isa)
    if not isinstance(w, PackedWeight) or len(w.shape) != 4:
        raise ValueError(f"grouped matmul takes a PackedWeight of [L, E, K, N], not {w!r:.80}")
    if x.ndim != 3 or x.shape[2] != w.shape[2] or expert.shape != x.shape[:1]:
        raise ValueError(
            "grouped matmul: x [n_tiles, m, K], expert [n_tiles] and w [L, E, K, N] disagree: "
            f"{x.shape}, {expert.shape}, {w.shape}"
        )
    out = jax.ShapeDtypeStruct((*x.shape[:2], w.n), jnp.float32)
    return jax.ffi.ffi_call(target, out)(
        x.astype(jnp.float32),
        w.panels,
        jnp.asarray(layer, jnp.int32).reshape(()),
        expert.astype(jnp.int32),
    )
