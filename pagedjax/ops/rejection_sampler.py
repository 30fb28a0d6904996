"""Verification of speculative (proposed) tokens inside the step: which sampler rows are kept.

A sequence with k proposals d_1..d_k has k + 1 sampler rows; row j holds the target's
distribution p_j after the known tokens and d_1..d_j, processed with every sampling parameter
of the request (bias, banned ids, penalties counting d_1..d_j, temperature, min-p, top-k,
top-p), and draws x_j ~ p_j with the request's key for output index `token_index + j`.

Rejection sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", Alg. 1; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling")
accepts d_j with probability min(1, p_j(d_j) / q_j(d_j)) and otherwise draws from the
normalised residual max(0, p_j - q_j). Our proposers are deterministic (n-gram lookup, and a
draft model decoding greedily), so q_j is a point mass on d_j: then the acceptance
probability is p_j(d_j) and the residual is p_j with d_j removed, renormalised. Drawing
x_j ~ p_j and accepting iff x_j == d_j does exactly that: P(accept) = p_j(d_j), and on a
rejection x_j is distributed as p_j conditioned on x_j != d_j, the residual. So row j's draw
is both the accept test and the replacement token; the first row whose draw differs from its
proposal (or the last row, which has none: the "bonus" token) ends the run, and the kept
tokens are x_0 .. x_a. Under greedy sampling x_j is the argmax, so this is the greedy rule
(accept while argmax == proposal). Each output index keeps its own key, so a seeded request
draws the same tokens with and without speculation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accepted_rows(token_ids: jax.Array, draft_token: jax.Array, row_start: jax.Array) -> jax.Array:
    """Which rows' draws are output tokens.

    Args:
        token_ids: [R] int32 the draws x_j of every row.
        draft_token: [R] int32 the proposal row j verifies, -1 on the last row of a sequence
            (and on rows of sequences without proposals).
        row_start: [R] int32 the index of the first row of the row's sequence (padding
            rows: their own index).

    Returns:
        [R] bool: the row is kept, i.e. every earlier row of its sequence drew its proposal.
    """
    ends = ((draft_token < 0) | (token_ids != draft_token)).astype(jnp.int32)  # [R]
    ends_before = jnp.cumsum(ends) - ends  # [R] run-ending rows strictly before each row
    return ends_before == ends_before[row_start]
