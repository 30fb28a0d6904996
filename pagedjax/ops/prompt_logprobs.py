"""Prompt logprobs: the logprob and rank of each next prompt token and the top-k alternatives
at every position of a step (`SamplingParams.prompt_logprobs`), chunk by chunk so that a
long prefill never holds its [tokens, V] logits at once; each chunk's logits are summarised
in row blocks (`ops.sampling.by_row_blocks`), as the sampler's are."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.ops.sampling import SAMPLE_BLOCK_ROWS, by_row_blocks, logprob_summary


def prompt_logprobs(
    logits_fn,
    hidden: jax.Array,
    targets: jax.Array,
    *,
    max_logprobs: int,
    chunk: int,
    block_rows: int = SAMPLE_BLOCK_ROWS,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Logprobs of each next prompt token, chunk by chunk (bounded memory).

    Args:
        logits_fn: hidden [C, D] -> logits [C, V] float32.
        hidden: [T, D] the step's final hidden states.
        targets: [T] int32, the prompt token each position predicts, -1 where none.
        max_logprobs, chunk: static; chunk divides T.
        block_rows: static; a chunk's logits are summarised in blocks of this many rows
            (`by_row_blocks`; 0: the whole chunk at once).

    Returns:
        target logprobs [T], target ranks [T], top ids [T, k], top logprobs [T, k].
    """
    T = hidden.shape[0]
    max_logprobs = min(max_logprobs, logits_fn(hidden[:1]).shape[-1])

    def body(c, acc):
        lp_t, rk_t, ids_t, lp_k = acc
        h = jax.lax.dynamic_slice_in_dim(hidden, c * chunk, chunk)
        tgt = jax.lax.dynamic_slice_in_dim(targets, c * chunk, chunk)

        def summary(logits, tgt):
            lp = jax.nn.log_softmax(logits, axis=-1)
            return logprob_summary(lp, jnp.maximum(tgt, 0), max_logprobs)

        t_lp, t_rk, top_ids, top_lp = by_row_blocks(
            summary, logits_fn(h), tgt, block_rows=block_rows
        )
        start = c * chunk
        return (
            jax.lax.dynamic_update_slice_in_dim(lp_t, t_lp, start, 0),
            jax.lax.dynamic_update_slice_in_dim(rk_t, t_rk, start, 0),
            jax.lax.dynamic_update_slice_in_dim(ids_t, top_ids, start, 0),
            jax.lax.dynamic_update_slice_in_dim(lp_k, top_lp, start, 0),
        )

    init = (
        jnp.zeros((T,), jnp.float32),
        jnp.zeros((T,), jnp.int32),
        jnp.zeros((T, max_logprobs), jnp.int32),
        jnp.zeros((T, max_logprobs), jnp.float32),
    )
    return jax.lax.fori_loop(0, T // chunk, body, init)
