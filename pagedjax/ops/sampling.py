"""On-device sampler: every row of the batch with its own request's parameters, in one function.

Order of operations (that of vLLM's v1 sampler):
    0. the structured-output token bitmask (`ops.bitmask`), in a step where a row has one;
    1. allowed_token_ids / bad words / logit_bias (the per-request `bias` row) and the tokens
       banned this step (EOS and stop ids before min_tokens, the last token of a multi-token
       bad word whose prefix was just generated);
    2. penalties: repetition (tokens of the prompt or the output; Keskar et al., CTRL, 2019:
       positive logits divided by the penalty, negative ones multiplied), frequency (minus
       penalty x count in the output) and presence (minus penalty if in the output), as
       defined by OpenAI's API;
    3. greedy rows (temperature < 1e-5) take the argmax here;
    4. temperature, then min_p (drop tokens less likely than min_p x the most likely one),
       then top-k, then top-p (Holtzman et al., 2020) on the scaled distribution;
    5. a Gumbel-max draw with a key derived from the request's 64-bit seed (its low and high
       32-bit words) and the index of the token being drawn
       (`fold_in(fold_in(PRNGKey(seed_lo), seed_hi), index)`), so a seeded request draws the
       same tokens whatever else is in the batch and in whichever step.
Logprobs (the sampled token's, its rank, and the top `max_logprobs` alternatives) are those of
the raw model distribution, `log_softmax(logits)` (after the bitmask of step 0, which
sets disallowed tokens to -inf), as vLLM returns by default; they are
computed only in steps where a request asked for them (`SamplingParams.logprobs` not None).

Per-request state that outlives a step lives on the device in `SamplingState`, one row per
runner slot: output token counts, a prompt-token mask and the bias row. The runner fills a
row when a request enters the batch (`init_state_rows`, `set_bias_rows`); the step counts
each newly sampled token (`count_sampled`). Every stage runs under `lax.cond`, so a batch that
uses none of a feature pays nothing for it; a step whose rows are all greedy with nothing to
apply (the common serving case) takes the argmax of the raw logits under one `lax.cond` whose
result is the [S] token ids. (A `lax.cond` that returns the [S, V] logits unchanged costs a
copy of them: XLA gives a conditional's result a buffer of its own, 12.6 MB for 64 rows of a
49,152-token vocabulary, in memory the CPU client maps afresh for every step.)

Everything past that argmax (steps 1-5 and the logprobs) runs on blocks of at most
SAMPLE_BLOCK_ROWS rows (`by_row_blocks`; the step asks for that on one CPU device, and for
all rows at once where the logits are sharded over devices or live on an accelerator), so
its [rows, V] intermediates take [8, V] each, not [S, V]. XLA's CPU client allocates a
step's temporaries in one block, afresh for every call, and glibc serves a block over 32 MiB
(its largest mmap threshold) with a new mapping that faults in page by page; below that, it
reuses the memory freed by the step before. With the sampler's [S, V] buffers, a 64-row
decode step of a 49,152-token vocabulary needed 85 MiB of temporaries and took about 3,950
page faults per step; in row blocks it needs 27 MiB and takes none. A row's results do not
depend on its block's other rows (a block's `lax.cond`s choose between computations that
agree on the rows that do not need them).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from pagedjax.ops.bitmask import maybe_apply_token_bitmask

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)
SAMPLE_BLOCK_ROWS = 8  # rows per block of the sampler's [rows, V] work (`by_row_blocks`)


@struct.dataclass
class SamplingState:
    """Per-slot device state. R slots (the runner's max_num_seqs + 1), V vocabulary.

    Attributes:
        output_counts: [R, V] int32 occurrences of each token in the slot's output so far.
        prompt_mask: [R, V] bool, the token occurs in the slot's prompt.
        bias: [R, V] float32 added to the logits (logit_bias; -inf outside allowed_token_ids
            and for single-token bad words).
    """

    output_counts: jax.Array
    prompt_mask: jax.Array
    bias: jax.Array


def init_sampling_state(num_slots: int, vocab_size: int) -> SamplingState:
    return SamplingState(
        output_counts=jnp.zeros((num_slots, vocab_size), jnp.int32),
        prompt_mask=jnp.zeros((num_slots, vocab_size), jnp.bool_),
        bias=jnp.zeros((num_slots, vocab_size), jnp.float32),
    )


@struct.dataclass
class SamplingMetadata:
    """Per-row sampling parameters of a step (S rows).

    Attributes:
        temperature: [S] float32; < 1e-5 means greedy.
        top_p: [S] float32 in (0, 1]; 1 disables.
        top_k: [S] int32; <= 0 disables.
        min_p: [S] float32; 0 disables.
        seed_lo, seed_hi: [S] int32, the bits of the low and high 32-bit words of the
            request's seed modulo 2**64 (`executor.input_batch.split_seed`).
        token_index: [S] int32, index among the request's output tokens of the token drawn.
        repetition_penalty, presence_penalty, frequency_penalty: [S] float32 (1, 0, 0: off).
        use_bias: [S] bool, add the slot's bias row.
        slot: [S] int32, the row of `SamplingState` that belongs to this request.
        banned: [S, B] int32 token ids masked this step, -1 for none (B: the packed layout's
            `executor.input_batch.MAX_BANNED`).
        counts: [S] bool, the row's sample is real (not a padding or mid-prefill row), so
            it is added to the output counts.
    """

    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array
    min_p: jax.Array
    seed_lo: jax.Array
    seed_hi: jax.Array
    token_index: jax.Array
    repetition_penalty: jax.Array
    presence_penalty: jax.Array
    frequency_penalty: jax.Array
    use_bias: jax.Array
    slot: jax.Array
    banned: jax.Array
    counts: jax.Array


@struct.dataclass
class SamplerOutput:
    """What leaves the device: token_ids [S] int32, logprobs [S] float32 and ranks [S] int32
    (1 = most likely) of the sampled tokens, and the top-k alternatives top_ids /
    top_logprobs [S, k] (k = min(max_logprobs, V)). All but token_ids are zeros unless
    `want_logprobs` was set."""

    token_ids: jax.Array
    logprobs: jax.Array
    ranks: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def apply_penalties(
    logits: jax.Array,
    output_counts: jax.Array,
    prompt_mask: jax.Array,
    repetition: jax.Array,
    presence: jax.Array,
    frequency: jax.Array,
) -> jax.Array:
    """Repetition, presence and frequency penalties (module docstring, step 2).

    logits: [S, V] float32; output_counts: [S, V] int32; prompt_mask: [S, V] bool;
    repetition, presence, frequency: [S] float32.
    """
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None]
    penalized = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(seen, penalized, logits)
    counts = output_counts.astype(jnp.float32)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0)


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Masks tokens whose probability is below min_p x the top probability.

    logits: [S, V] float32 (temperature applied); min_p: [S] float32 (0: off).
    """
    probs = jax.nn.softmax(logits, axis=-1)
    threshold = min_p[:, None] * probs.max(axis=-1, keepdims=True)
    return jnp.where(probs < threshold, -jnp.inf, logits)


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Masks (to -inf) what top-k and then top-p exclude, row by row.

    logits: [S, V] float32 (temperature applied); top_k: [S] int32 (<= 0: off);
    top_p: [S] float32 (1: off). Top-p keeps the smallest set of most likely tokens whose
    probability reaches top_p, always at least one token. Tokens tied with the last kept
    value are kept too.
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


def _row_keys(seed_lo: jax.Array, seed_hi: jax.Array, token_index: jax.Array) -> jax.Array:
    """One key per row, a function of the row's 64-bit seed and token index only."""

    def key(lo, hi, i):
        return jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(lo), hi), i)

    return jax.vmap(key)(seed_lo, seed_hi, token_index)


def _process(
    logits: jax.Array, sm: SamplingMetadata, state: SamplingState, prior_tokens=None
) -> jax.Array:
    """Steps 1 and 2 of the module docstring. [S, V] -> [S, V]. `prior_tokens` [S, K] int32
    (-1: none): output tokens not yet in the slot's counts (the proposals a speculative row
    follows), counted by the penalties as if they were."""
    S, V = logits.shape

    def bias(x):
        return x + jnp.where(sm.use_bias[:, None], state.bias[sm.slot], 0.0)

    x = jax.lax.cond(jnp.any(sm.use_bias), bias, lambda x: x, logits)

    def ban(x):
        rows = jnp.broadcast_to(jnp.arange(S)[:, None], sm.banned.shape)
        ids = jnp.where(sm.banned >= 0, sm.banned, V)  # V: out of range, dropped
        return x.at[rows, ids].set(-jnp.inf, mode="drop")

    x = jax.lax.cond(jnp.any(sm.banned >= 0), ban, lambda x: x, x)

    def penalize(x):
        counts = state.output_counts[sm.slot]
        if prior_tokens is not None:
            rows = jnp.broadcast_to(jnp.arange(S)[:, None], prior_tokens.shape)
            ids = jnp.where(prior_tokens >= 0, prior_tokens, V)  # V: dropped
            counts = counts.at[rows, ids].add(1, mode="drop")
        return apply_penalties(
            x,
            counts,
            state.prompt_mask[sm.slot],
            sm.repetition_penalty,
            sm.presence_penalty,
            sm.frequency_penalty,
        )

    return jax.lax.cond(_any_penalty(sm), penalize, lambda x: x, x)


def _any_penalty(sm: SamplingMetadata) -> jax.Array:
    return jnp.any(
        (sm.repetition_penalty != 1.0)
        | (sm.presence_penalty != 0.0)
        | (sm.frequency_penalty != 0.0)
    )


def _needs_processing(sm: SamplingMetadata) -> jax.Array:
    """Scalar bool: some row has a bias row, a banned token or a penalty (`_process`)."""
    return jnp.any(sm.use_bias) | jnp.any(sm.banned >= 0) | _any_penalty(sm)


def argmax(x: jax.Array) -> jax.Array:
    """`jnp.argmax(x, axis=-1)` as int32, the same index (the first maximum; the first NaN
    where a row has one). XLA's CPU backend lowers `jnp.argmax` to a variadic (value, index)
    reduce that it does not vectorize (7.5 ms on [64, 49152] float32 logits, 2 CPU cores);
    here plain reductions instead. With 8 rows or more, over chunks of 128 values
    (`_chunked_argmax`): 2.7 ms there against 5.4 ms for the one-level form, 0.56 against
    0.73 ms on [8, 49152]. Under 8 rows the one-level form, the row's max and then the least
    index that holds it: 0.12 ms on [1, 49152] against 0.22 ms for the chunks (the one-level
    form timed before its NaN check was added).

    Args:
        x: [..., V] float.

    Returns:
        [...] int32 in [0, V).
    """
    V = x.shape[-1]
    if math.prod(x.shape[:-1]) >= 8 and V >= 2 * _ARGMAX_CHUNK:
        return _chunked_argmax(x.reshape(-1, V)).reshape(x.shape[:-1])
    top = jnp.max(x, axis=-1, keepdims=True)
    nan = jnp.isnan(x)
    hit = jnp.where(jnp.any(nan, axis=-1, keepdims=True), nan, x == top)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.min(jnp.where(hit, iota, V), axis=-1)


_ARGMAX_CHUNK = 128


def _chunked_argmax(x: jax.Array) -> jax.Array:
    """`argmax` of [S, V] rows in two levels: each chunk of 128 values' max and whether it
    holds a NaN ([S, V / 128], -inf padding), the first chunk holding the row's max (or, in
    a row with a NaN, its first NaN), then the first index in that chunk that holds it.
    XLA:CPU's max reductions do not reliably propagate NaN, hence the separate NaN flags."""
    C = _ARGMAX_CHUNK
    S, V = x.shape
    pad = -V % C
    if pad:
        x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=-jnp.inf)
    n = (V + pad) // C
    xr = x.reshape(S, n, C)
    chunk_max = jnp.max(xr, axis=-1)  # [S, n]
    chunk_nan = jnp.any(jnp.isnan(xr), axis=-1)  # [S, n]
    top = jnp.max(chunk_max, axis=-1, keepdims=True)  # [S, 1]
    has_nan = jnp.any(chunk_nan, axis=-1, keepdims=True)  # [S, 1]
    hit = jnp.where(has_nan, chunk_nan, chunk_max == top)
    first = jnp.min(jnp.where(hit, jax.lax.broadcasted_iota(jnp.int32, (S, n), 1), n), axis=-1)
    first = jnp.minimum(first, n - 1)
    chunk = jnp.take_along_axis(xr, first[:, None, None], axis=1)[:, 0]  # [S, C]
    hit = jnp.where(has_nan, jnp.isnan(chunk), chunk == top)
    j = jnp.min(jnp.where(hit, jax.lax.broadcasted_iota(jnp.int32, (S, C), 1), C), axis=-1)
    return (first * C + j).astype(jnp.int32)


def sample(
    logits: jax.Array,
    sm: SamplingMetadata,
    state: SamplingState,
    *,
    max_logprobs: int,
    want_logprobs: jax.Array,
    prior_tokens: jax.Array | None = None,
    bitmask: jax.Array | None = None,
    use_bitmask: jax.Array | bool = False,
    block_rows: int = SAMPLE_BLOCK_ROWS,
) -> SamplerOutput:
    """Draws one token per row.

    Args:
        logits: [S, V] float32 raw model logits.
        sm: the rows' `SamplingMetadata`.
        state: the per-slot `SamplingState`.
        max_logprobs: k of the top-k alternatives returned (static).
        want_logprobs: scalar bool: compute log_softmax(logits) and from it the sampled
            tokens' logprobs and ranks and the top-k alternatives (else all zeros: a step in
            which no request asked for logprobs skips the [S, V] softmax).
        prior_tokens: [S, K] int32 or None: per row, output tokens the penalties count on
            top of the slot's (speculative rows: the proposals before the row's), -1 pad.
        bitmask: [S, ceil(V / 32)] int32 or None: the structured-output token bitmask
            (`ops.bitmask`), applied to the logits before everything else (the logprobs
            included) when the scalar bool `use_bitmask` is set.
        block_rows: static; rows per block of the work past the plain-greedy argmax
            (`by_row_blocks`; 0: all rows at once).

    Returns:
        A `SamplerOutput`.
    """
    greedy = sm.temperature < SAMPLING_EPS

    def masked(x, mask):
        return x if mask is None else maybe_apply_token_bitmask(x, mask, use_bitmask)

    def drawn_ids(logits, sm, prior_tokens, mask):
        x = _process(masked(logits, mask), sm, state, prior_tokens)
        greedy = sm.temperature < SAMPLING_EPS
        greedy_ids = argmax(x)

        def random_ids():
            temp = jnp.where(greedy, 1.0, sm.temperature)
            scaled = x / temp[:, None]
            scaled = jax.lax.cond(
                jnp.any(sm.min_p > 0), lambda y: apply_min_p(y, sm.min_p), lambda y: y, scaled
            )
            needs_mask = jnp.any((sm.top_k > 0) | (sm.top_p < 1.0))
            scaled = jax.lax.cond(
                needs_mask,
                lambda y: apply_top_k_top_p(y, sm.top_k, sm.top_p),
                lambda y: y,
                scaled,
            )
            keys = _row_keys(sm.seed_lo, sm.seed_hi, sm.token_index)
            gumbel = jax.vmap(lambda key: jax.random.gumbel(key, (logits.shape[-1],)))(keys)
            drawn = argmax(scaled + gumbel)
            return jnp.where(greedy, greedy_ids, drawn)

        return jax.lax.cond(jnp.all(greedy), lambda: greedy_ids, random_ids)

    # All rows greedy and nothing to apply: the argmax of the raw logits, with no [S, V]
    # result of a `lax.cond` on the way (module docstring).
    plain = jnp.all(greedy) & ~jnp.asarray(use_bitmask) & ~_needs_processing(sm)
    ids = jax.lax.cond(
        plain,
        lambda: argmax(logits),
        lambda: by_row_blocks(drawn_ids, logits, sm, prior_tokens, bitmask, block_rows=block_rows),
    )
    S, V = logits.shape
    max_logprobs = min(max_logprobs, V)

    def logprobs_of(logits, ids, mask):
        logprobs = jax.nn.log_softmax(masked(logits, mask), axis=-1)  # raw distribution
        return logprob_summary(logprobs, ids, max_logprobs)

    def without():
        return (
            jnp.zeros((S,), jnp.float32),
            jnp.zeros((S,), jnp.int32),
            jnp.zeros((S, max_logprobs), jnp.int32),
            jnp.zeros((S, max_logprobs), jnp.float32),
        )

    chosen, ranks, top_ids, top_lp = jax.lax.cond(
        want_logprobs,
        lambda: by_row_blocks(logprobs_of, logits, ids, bitmask, block_rows=block_rows),
        without,
    )
    return SamplerOutput(ids, chosen, ranks, top_ids, top_lp)


def logprob_summary(logprobs: jax.Array, ids: jax.Array, k: int):
    """Of [S, V] logprobs and [S] chosen ids: the chosen tokens' logprobs [S] and ranks [S]
    int32 (1 + the number of tokens strictly more likely), and the top-k ids [S, k] int32 and
    logprobs [S, k]."""
    chosen = jnp.take_along_axis(logprobs, ids[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, k)
    ranks = 1 + jnp.sum(logprobs > chosen[:, None], axis=-1)
    return chosen, ranks.astype(jnp.int32), top_ids.astype(jnp.int32), top_lp


def by_row_blocks(fn, *args, block_rows: int = SAMPLE_BLOCK_ROWS):
    """`fn(*args)` computed `block_rows` rows at a time (`lax.map`), for a function whose rows
    do not depend on each other.

    Every array in `args` (pytrees; None allowed) has the rows as its leading axis, S of
    them; `fn` returns a pytree of arrays that do too. The blocks hold the largest divisor of
    S up to `block_rows` rows (all S in one call when S is at most that, or block_rows is 0).
    Each [S, V] intermediate of `fn` then lives as a [block, V] one: XLA's CPU client
    allocates a step's temporaries afresh for every call; kept under 32 MiB, that memory is
    reused rather than mapped anew (module docstring).
    """
    S = jax.tree.leaves(args)[0].shape[0]
    b = largest_divisor(S, block_rows) if block_rows > 0 else S
    if b == S:
        return fn(*args)
    n = S // b
    blocks = jax.tree.map(lambda a: a.reshape(n, b, *a.shape[1:]), args)
    out = jax.lax.map(lambda xs: fn(*xs), blocks)
    return jax.tree.map(lambda a: a.reshape(S, *a.shape[2:]), out)


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of n that is at most `at_most` (>= 1)."""
    return max(c for c in range(1, min(n, at_most) + 1) if n % c == 0)


def count_sampled(state: SamplingState, sm: SamplingMetadata, ids: jax.Array) -> SamplingState:
    """Adds each real row's sampled token to its slot's output counts."""
    counts = state.output_counts.at[sm.slot, ids].add(sm.counts.astype(jnp.int32))
    return state.replace(output_counts=counts)


def init_state_rows(
    state: SamplingState, slots: jax.Array, reset: jax.Array, tokens: jax.Array, kinds: jax.Array
) -> SamplingState:
    """Fills rows of a request entering the batch, one chunk of its known tokens at a time.

    slots: [B] int32 rows (padding rows point at the scratch slot R - 1); reset: [B] bool,
    clear the row first (the first chunk); tokens: [B, C] int32; kinds: [B, C] int32, 1 for a
    prompt token, 2 for an output token, 0 for padding.
    """
    V = state.output_counts.shape[1]
    counts = state.output_counts.at[slots].multiply((~reset[:, None]).astype(jnp.int32))
    mask = state.prompt_mask.at[slots].set(state.prompt_mask[slots] & ~reset[:, None])
    rows = jnp.broadcast_to(slots[:, None], tokens.shape)
    ids = jnp.where(kinds > 0, tokens, V)  # V: dropped
    mask = mask.at[rows, jnp.where(kinds == 1, ids, V)].set(True, mode="drop")
    counts = counts.at[rows, jnp.where(kinds == 2, ids, V)].add(1, mode="drop")
    return state.replace(output_counts=counts, prompt_mask=mask)


def set_bias_rows(state: SamplingState, slots: jax.Array, bias: jax.Array) -> SamplingState:
    """state.bias[slots] = bias. slots: [B] int32; bias: [B, V] float32."""
    return state.replace(bias=state.bias.at[slots].set(bias))
