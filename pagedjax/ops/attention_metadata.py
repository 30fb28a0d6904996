"""The step metadata of ragged paged attention, shared by every implementation.

`AttentionMetadata` (built on the host by the runner, unpacked in the jitted step),
`METADATA_FIELDS` (its array fields, in packed order), `dequantize_pages` (a quantized
cache's pages in float32), and the two score modifiers of some model families:
`window_start` (sliding-window attention) and `soft_cap` (attention-logit soft-capping),
with the checks of their arguments. The implementations (`paged_attention_ref/xla/pallas`,
`cpu_attention`) import these from here; `attention` dispatches to them.
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class AttentionMetadata:
    """Per-step attention inputs, built on the host by the runner (all int32).

    Attributes:
        slot_mapping: [T] physical KV slot of each token (`block * block_size + offset`);
            padding tokens map into the null block 0.
        positions: [T] absolute position of each token (0 for padding).
        seq_lens: [S] KV length of each sequence after this step (0 for padding rows).
        query_start_loc: [S + 1] start of each sequence's queries in the flat batch; padding
            rows repeat the total number of real tokens.
        block_tables: [S, B] physical block ids of each sequence (0 = null block padding).
        last_token_index: [S] flat index of each sequence's last query token, T for padding
            rows (the XLA path computes every sequence's last token as a decode row).
        tile_seq: [NT] sequence of each prefill query tile (sequences with more than one
            query token are cut into tiles of `query_tile_size` tokens).
        tile_q_start: [NT] flat index of a tile's first query token.
        tile_q_len: [NT] number of real query tokens in the tile (<= query_tile_size).
        tile_kv_len: [NT] KV tokens the tile's last query attends to (its position + 1).
        num_tiles: [] number of valid tiles.
        query_tile_size: static; query tokens per prefill tile.
        kv_chunk_pages: static; KV pages processed per inner step of the XLA path.
    """

    slot_mapping: jax.Array
    positions: jax.Array
    seq_lens: jax.Array
    query_start_loc: jax.Array
    block_tables: jax.Array
    last_token_index: jax.Array
    tile_seq: jax.Array
    tile_q_start: jax.Array
    tile_q_len: jax.Array
    tile_kv_len: jax.Array
    num_tiles: jax.Array
    query_tile_size: int = struct.field(pytree_node=False, default=32)
    kv_chunk_pages: int = struct.field(pytree_node=False, default=8)

    @classmethod
    def from_arrays(cls, arrays, **static) -> AttentionMetadata:
        """The metadata fields (`METADATA_FIELDS`) picked from a mapping of named arrays, e.g.
        `PackedLayout.unpack`'s; `static`: query_tile_size, kv_chunk_pages."""
        return cls(**{f: arrays[f] for f in METADATA_FIELDS}, **static)


# The array fields of AttentionMetadata, in order (the packed layout names them the same).
METADATA_FIELDS = (
    "slot_mapping",
    "positions",
    "seq_lens",
    "query_start_loc",
    "block_tables",
    "last_token_index",
    "tile_seq",
    "tile_q_start",
    "tile_q_len",
    "tile_kv_len",
    "num_tiles",
)


def dequantize_pages(pages: jax.Array, scale: jax.Array | float | None) -> jax.Array:
    """Pages read from the cache, in float32 (times `scale` for a quantized cache)."""
    pages = pages.astype(jnp.float32)
    return pages if scale is None else pages * scale


def check_sliding_window(window):
    """The `sliding_window` argument of `ragged_paged_attention`, normalised: None for no
    window (None, or a Python int <= 0), else the window as given (a positive Python int, or
    an int32 scalar array, traced or not, in which a value <= 0 means no window).

    Raises:
        ValueError: a non-integer window, or an array that is not a scalar.
    """
    if window is None:
        return None
    if isinstance(window, numbers.Integral):
        return int(window) if window > 0 else None
    if jnp.ndim(window) != 0 or not jnp.issubdtype(jnp.result_type(window), jnp.integer):
        raise ValueError(f"sliding_window must be an int or an integer scalar, not {window!r}")
    return window


def window_start(pos: jax.Array, window) -> jax.Array:
    """The first KV position a query at `pos` attends to: `pos - window + 1` (at least 0)
    under a sliding window of `window` tokens, the query's own included (Hugging Face's
    convention: key j is visible when pos - window < j <= pos); 0 when `window` is None or
    <= 0 (full causal attention). `window` may be traced."""
    if window is None:
        return jnp.zeros_like(pos)
    w = jnp.asarray(window, jnp.int32)
    return jnp.where(w > 0, jnp.maximum(pos - w + 1, 0), 0).astype(pos.dtype)


def check_soft_cap(cap) -> float | None:
    """The `logit_soft_cap` argument: None (no cap) or a positive finite Python number,
    returned as a float.

    Raises:
        ValueError: anything else (a cap must be static: it selects code at trace time).
    """
    if cap is None:
        return None
    if not isinstance(cap, numbers.Real) or not math.isfinite(cap) or cap <= 0:
        raise ValueError(f"logit_soft_cap must be None or a positive Python number, not {cap!r}")
    return float(cap)


def soft_cap(scores: jax.Array, cap: float | None) -> jax.Array:
    """Attention-logit soft-capping (Gemma 2): `cap * tanh(scores / cap)` of the scaled
    scores, before masking and softmax; the scores unchanged when `cap` is None."""
    return scores if cap is None else cap * jnp.tanh(scores / cap)
