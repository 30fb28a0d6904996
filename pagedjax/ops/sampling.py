"""On-device sampler: every row of the batch with its own request's parameters, in one function.

Order of operations (that of vLLM's v1 sampler): temperature, then top-k, then top-p on
the scaled distribution, then a draw. A row whose temperature is below 1e-5 is greedy
(argmax of the raw logits). Draws use the Gumbel-max trick with a key derived from the
request's seed and the index of the token being drawn (`fold_in(PRNGKey(seed), index)`), so a
seeded request draws the same tokens whatever else is in the batch and in whichever step.
The logprob returned is that of the sampled token under the raw model distribution
(`log_softmax(logits)`), as vLLM returns by default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)


@struct.dataclass
class SamplingMetadata:
    """Per-row sampling parameters of a step.

    Attributes:
        temperature: [S] float32; < 1e-5 means greedy.
        top_p: [S] float32 in (0, 1]; 1 disables.
        top_k: [S] int32; <= 0 disables.
        seed: [S] int32, the low 32 bits of the request's seed.
        token_index: [S] int32, the index among the request's output tokens of the token
            being drawn (with `seed`, it makes the row's key).
    """

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    seed: jax.Array
    token_index: jax.Array


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks (to -inf) what top-k and then top-p exclude, row by row.

    logits: [S, V] float32 (temperature applied); top_k: [S] int32 (<= 0: off);
    top_p: [S] float32 (1: off). Top-p keeps the smallest set of most likely tokens whose
    probability reaches top_p (Holtzman et al., 2020), always at least one token. Tokens
    tied with the last kept value are kept too.
    """
    S, V = logits.shape
    rows = jnp.arange(S)
    desc = -jnp.sort(-logits, axis=-1)  # [S, V] values, largest first
    k = jnp.where(top_k <= 0, V, jnp.minimum(top_k, V))
    kth = desc[rows, k - 1]  # [S]
    desc = jnp.where(desc < kth[:, None], -jnp.inf, desc)
    probs = jax.nn.softmax(desc, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability mass strictly above each token
    num_keep = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)  # [S]
    cutoff = jnp.maximum(desc[rows, num_keep - 1], kth)  # [S]
    return jnp.where(logits < cutoff[:, None], -jnp.inf, logits)


def _row_keys(seed: jax.Array, token_index: jax.Array) -> jax.Array:
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seed, token_index)


def sample(logits: jax.Array, sm: SamplingMetadata) -> tuple[jax.Array, jax.Array]:
    """Draws one token per row.

    Args:
        logits: [S, V] float32 raw model logits.
        sm: the rows' `SamplingMetadata`.

    Returns:
        token_ids [S] int32 and their logprobs [S] float32 under the raw distribution.
    """
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    greedy = sm.temperature < SAMPLING_EPS

    def random_ids():
        temp = jnp.where(greedy, 1.0, sm.temperature)
        scaled = logits / temp[:, None]
        needs_mask = jnp.any((sm.top_k > 0) | (sm.top_p < 1.0))
        scaled = jax.lax.cond(
            needs_mask, lambda x: apply_top_k_top_p(x, sm.top_k, sm.top_p), lambda x: x, scaled
        )
        keys = _row_keys(sm.seed, sm.token_index)
        gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (logits.shape[-1],)))(keys)
        drawn = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
        return jnp.where(greedy, greedy_ids, drawn)

    ids = jax.lax.cond(jnp.all(greedy), lambda: greedy_ids, random_ids)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    return ids, jnp.take_along_axis(logprobs, ids[:, None], axis=-1)[:, 0]
