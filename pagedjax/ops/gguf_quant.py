"""GGUF quantized weights kept as the file stores them: their layout, dequantization in XLA,
the XLA matmul and the embedding lookup.

A `GGUFWeight` is one of the weight kinds of `ops.linear.linear`. It holds the raw blocks of
a GGUF tensor, row by row as llama.cpp writes them: a linear weight of logical shape [in, out]
(K = in, N = out) is N rows, each the K input values of one output in K / block_size blocks.
The native CPU kernel (`ops.cpu_gguf`, `csrc/gguf_linear_cpu.cc`) multiplies activations by
these blocks in place; the XLA path here dequantizes one layer's blocks inside the step
(`dequantize_blocks`) and multiplies with XLA's dot (large prefill steps, other devices).

Block formats (ggml's, as the `gguf` package reads and writes them; f16 = IEEE half,
little-endian; "q" the stored integer, w the weight it stands for):
    Q8_0  32 values, 34 bytes:  d f16, q int8[32]                        w = d q
    Q4_0  32 values, 18 bytes:  d f16, 16 bytes of nibbles               w = d (q - 8)
    Q4_1  32 values, 20 bytes:  d f16, m f16, 16 bytes of nibbles        w = d q + m
    Q5_0  32 values, 22 bytes:  d f16, qh u32 (5th bits), 16 nibbles    w = d (q - 16)
    Q5_1  32 values, 24 bytes:  d f16, m f16, qh u32, 16 nibbles         w = d q + m
          (nibble byte j holds value j in its low and value j + 16 in its high half; bit j
          of qh is value j's fifth bit)
    Q4_K  256 values, 144 bytes: d f16, dmin f16, 12 bytes of eight 6-bit scales and mins,
          128 bytes of nibbles (32 bytes per 64 values: low halves first sub-block, high
          halves the second)                                           w = d sc q - dmin mn
    Q5_K  256 values, 176 bytes: as Q4_K plus qh[32] (bit i of qh[l] is the fifth bit of
          value l of sub-block i) before the nibbles
    Q6_K  256 values, 210 bytes: ql[128] low nibbles, qh[64] 2-bit highs, int8 scales[16]
          (one per 16 values), d f16 last                               w = d sc (q - 32)
The layouts are ggml's (`ggml-common.h` / `ggml-quants.c` in llama.cpp); the tests check
every format against `gguf.quants.dequantize`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

# format -> (values per block, bytes per block)
GGUF_FORMATS = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
# The format codes the native kernel takes (its `qtype` attribute): ggml's type ids.
GGML_TYPE_IDS = {
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
}


@struct.dataclass
class GGUFWeight:
    """A linear weight of logical shape [..., in, out] in a GGUF block format (a pytree).

    Attributes:
        blocks: uint8 [..., out, in // block_size * bytes_per_block]: row n is output n's
            blocks, as in the file (a stacked weight has a leading L axis).
        qtype: the block format, a key of GGUF_FORMATS (static).
        in_features: K, the input size (static).
        native: True when the engine multiplies it with the native CPU kernel (static; set
            by `ops.cpu_gguf.use_native`), which reads a stack of layers in place.
        activations: what the native kernel multiplies the blocks with (static; the engine's
            `gguf_activations`): "float32", or "int8" (x quantized per 32-value block, integer
            dot products; `ops.cpu_gguf`), "int8" taking effect for the formats of
            `cpu_gguf.INT8_FORMATS` only.
    """

    blocks: jax.Array
    qtype: str = struct.field(pytree_node=False)
    in_features: int = struct.field(pytree_node=False)
    native: bool = struct.field(pytree_node=False, default=False)
    activations: str = struct.field(pytree_node=False, default="float32")

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape [..., in, out] of the float weight it stands for."""
        *lead, n, _ = self.blocks.shape
        return (*lead, self.in_features, n)

    @property
    def dtype(self):
        """The dtype it dequantizes to (float32)."""
        return jnp.dtype(jnp.float32)

    @property
    def nbytes(self) -> int:
        return int(self.blocks.nbytes)


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of K values in a format.

    Raises:
        ValueError: an unknown format, or K not a multiple of its block size.
    """
    if qtype not in GGUF_FORMATS:
        raise ValueError(f"GGUF format {qtype!r} is not kept quantized; kept: {list(GGUF_FORMATS)}")
    bs, nbytes = GGUF_FORMATS[qtype]
    if k % bs:
        raise ValueError(f"GGUF {qtype}: input size {k} is not a multiple of the block {bs}")
    return k // bs * nbytes


# ----------------------------------------------------------------------------- dequantize


def _f16(b: jax.Array, offset: int) -> jax.Array:
    """The little-endian float16 at bytes [offset, offset + 2) of each block -> float32 [...]."""
    return jax.lax.bitcast_convert_type(b[..., offset : offset + 2], jnp.float16).astype(
        jnp.float32
    )


def _nibbles(qs: jax.Array) -> jax.Array:
    """uint8 [..., 16] -> int32 [..., 32]: the low halves (values 0..15), then the high."""
    q = qs.astype(jnp.int32)
    return jnp.concatenate([q & 0xF, q >> 4], axis=-1)


def _fifth_bits(qh: jax.Array) -> jax.Array:
    """uint8 [..., 4] (a little-endian u32) -> int32 [..., 32]: bit j as 16 or 0."""
    bits = jax.lax.bitcast_convert_type(qh, jnp.uint32).astype(jnp.uint32)  # [...]
    j = jnp.arange(32, dtype=jnp.uint32)
    return (((bits[..., None] >> j) & 1) << 4).astype(jnp.int32)


def _k_scales(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The twelve scale bytes of a Q4_K / Q5_K block -> (scales, mins), int32 [..., 8] each:
    sub-blocks 0-3 from the low six bits of bytes 0-3 / 4-7; 4-7 from the nibbles of bytes
    8-11 and the top two bits of bytes 0-3 / 4-7."""
    s = s.astype(jnp.int32)
    sc = jnp.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = jnp.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc, mn


def _k_nibbles(qs: jax.Array) -> jax.Array:
    """uint8 [..., 128] -> int32 [..., 8, 32]: sub-block 2j from the low halves of bytes
    32j .. 32j + 31, sub-block 2j + 1 from their high halves."""
    q = qs.astype(jnp.int32).reshape(*qs.shape[:-1], 4, 1, 32)
    return jnp.concatenate([q & 0xF, q >> 4], axis=-2).reshape(*qs.shape[:-1], 8, 32)


def _dequantize_block(b: jax.Array, qtype: str) -> jax.Array:
    """uint8 [..., bytes_per_block] -> float32 [..., block_size]."""
    if qtype == "Q8_0":
        q = jax.lax.bitcast_convert_type(b[..., 2:34], jnp.int8)
        return _f16(b, 0)[..., None] * q.astype(jnp.float32)
    if qtype == "Q4_0":
        return _f16(b, 0)[..., None] * (_nibbles(b[..., 2:18]) - 8).astype(jnp.float32)
    if qtype == "Q4_1":
        q = _nibbles(b[..., 4:20]).astype(jnp.float32)
        return _f16(b, 0)[..., None] * q + _f16(b, 2)[..., None]
    if qtype == "Q5_0":
        q = (_nibbles(b[..., 6:22]) | _fifth_bits(b[..., 2:6])) - 16
        return _f16(b, 0)[..., None] * q.astype(jnp.float32)
    if qtype == "Q5_1":
        q = (_nibbles(b[..., 8:24]) | _fifth_bits(b[..., 4:8])).astype(jnp.float32)
        return _f16(b, 0)[..., None] * q + _f16(b, 2)[..., None]
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
        sc, mn = _k_scales(b[..., 4:16])  # [..., 8]
        if qtype == "Q4_K":
            q = _k_nibbles(b[..., 16:144])  # [..., 8, 32]
        else:
            qh = b[..., 16:48].astype(jnp.int32)  # [..., 32]
            i = jnp.arange(8, dtype=jnp.int32)[:, None]
            q = _k_nibbles(b[..., 48:176]) | (((qh[..., None, :] >> i) & 1) << 4)
        w = (d * sc)[..., None] * q.astype(jnp.float32) - (dmin * mn)[..., None]
        return w.reshape(*b.shape[:-1], 256)
    if qtype == "Q6_K":
        ql = b[..., 0:128].astype(jnp.int32).reshape(*b.shape[:-1], 2, 2, 32)  # [h, half, l]
        qh = b[..., 128:192].astype(jnp.int32).reshape(*b.shape[:-1], 2, 1, 32)  # [h, 1, l]
        shifts = jnp.array([0, 2, 4, 6], jnp.int32).reshape(4, 1)
        lo = jnp.concatenate([ql & 0xF, ql >> 4], axis=-2)  # [h, 4, l]: q1, q2, q3, q4
        hi = (qh >> shifts) & 3  # [h, 4, l]
        q = (lo | (hi << 4)) - 32
        sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
        w = q.reshape(*b.shape[:-1], 16, 16).astype(jnp.float32) * sc[..., :, None]
        return (_f16(b, 208)[..., None, None] * w).reshape(*b.shape[:-1], 256)
    raise ValueError(f"GGUF format {qtype!r} is not kept quantized; kept: {list(GGUF_FORMATS)}")


def dequantize_blocks(blocks: jax.Array, qtype: str, k: int) -> jax.Array:
    """Rows of GGUF blocks -> their float32 values: uint8 [..., N, row_bytes] -> [..., N, K].

    Raises:
        ValueError: an unknown format, or a row size that does not match K.
    """
    bs, nbytes = GGUF_FORMATS.get(qtype, (0, 0))
    if not bs or blocks.shape[-1] != row_bytes(qtype, k):
        raise ValueError(f"GGUF {qtype}: rows of {blocks.shape[-1]} bytes do not hold {k} values")
    b = blocks.reshape(*blocks.shape[:-1], k // bs, nbytes)
    return _dequantize_block(b, qtype).reshape(*blocks.shape[:-1], k)


def dequantize(w: GGUFWeight, dtype=jnp.float32) -> jax.Array:
    """The float weight [..., in, out] a `GGUFWeight` stands for."""
    return jnp.swapaxes(dequantize_blocks(w.blocks, w.qtype, w.in_features), -1, -2).astype(dtype)


def matmul_xla(x: jax.Array, w: GGUFWeight) -> jax.Array:
    """x @ W on the XLA path: the layer's blocks dequantized inside the step, then XLA's dot.

    x: [T, in]; w: a `GGUFWeight` of one layer ([out, row_bytes] blocks). Returns [T, out]
    in x's dtype (the weight dequantized to x's dtype).
    """
    wt = dequantize_blocks(w.blocks, w.qtype, w.in_features).astype(x.dtype)  # [out, in]
    return jax.lax.dot_general(x, wt, (((x.ndim - 1,), (1,)), ((), ())))


def embedding_rows(w: GGUFWeight, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """The embedding lookup of a GGUF token embedding: only the looked-up rows are
    dequantized. w: the [V, D] embedding stored as rows of blocks (`blocks` [V, row_bytes],
    logical shape [D, V] as the tied LM head reads it); ids [T] int32 -> [T, D] `dtype`."""
    return dequantize_blocks(w.blocks[ids], w.qtype, w.in_features).astype(dtype)
