"""Token bitmasks of structured outputs, on the device: disallowed tokens' logits to -inf.

The host (`structured_output.manager`) fills one int32 row per sampler row in llguidance's
layout: bit j (least significant first) of word w allows token 32 w + j. The sampler
(`ops.sampling.sample`) applies it to the raw logits before every other sampling transform (and
before the logprobs), and only in a step where some row is constrained (`lax.cond` on a
scalar flag), so unconstrained batches skip it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Sets the logits of tokens the bitmask disallows to -inf.

    Args:
        logits: [S, V] float32.
        bitmask: [S, W] int32, W = ceil(V / 32); all ones (-1) leaves a row unchanged.

    Returns:
        [S, V] float32.
    """
    S, V = logits.shape
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # [S, W, 32]
    allowed = bits.reshape(S, -1)[:, :V] != 0  # [S, V]
    return jnp.where(allowed, logits, -jnp.inf)


def maybe_apply_token_bitmask(
    logits: jax.Array, bitmask: jax.Array, use_bitmask: jax.Array
) -> jax.Array:
    """`apply_token_bitmask` when the scalar `use_bitmask` is set, else `logits` unchanged."""
    return jax.lax.cond(use_bitmask, apply_token_bitmask, lambda x, _: x, logits, bitmask)
