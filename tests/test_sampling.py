"""The on-device sampler against NumPy references: top-k / top-p masks (edge values
included), greedy rows, seeded draws that do not depend on the batch, and the logprob of
the sampled token under the raw distribution."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.executor.input_batch import MAX_BANNED, split_seed
from pagedjax.ops.sampling import (
    SAMPLE_BLOCK_ROWS,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    argmax,
    count_sampled,
    init_sampling_state,
    init_state_rows,
    sample,
    set_bias_rows,
)


def _np_top_k_top_p(logits, k, p):
    """Straightforward reference: sort each row, keep the top k, then the smallest prefix
    whose probability reaches p (at least one token); ties with the last kept value stay."""
    out = np.full_like(logits, -np.inf)
    for r, row in enumerate(logits):
        order = np.argsort(-row, kind="stable")
        kk = len(row) if k[r] <= 0 else min(k[r], len(row))
        kept = order[:kk]
        probs = np.exp(row[kept] - row[kept].max())
        probs /= probs.sum()
        cum_before = np.cumsum(probs) - probs
        n = max(1, int(np.sum(cum_before < p[r])))
        cutoff = row[kept[n - 1]]
        keep = row >= cutoff
        out[r, keep] = row[keep]
    return out


@pytest.mark.parametrize(
    "k,p",
    [
        ([0, 0, 0, 0], [1.0, 1.0, 1.0, 1.0]),
        ([1, 5, 50, 1000], [1.0, 1.0, 1.0, 1.0]),  # top_k larger than the vocabulary
        ([0, 0, 0, 0], [0.5, 0.9, 1e-6, 0.999]),  # top_p tiny
        ([3, -1, 10, 0], [0.3, 0.8, 0.95, 0.05]),
    ],
)
def test_top_k_top_p_matches_numpy(k, p):
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((4, 50)) * 3).astype(np.float32)
    got = np.asarray(
        apply_top_k_top_p(
            jnp.asarray(logits), jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32)
        )
    )
    want = _np_top_k_top_p(logits, k, p)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[~np.isinf(got)], want[~np.isinf(want)])


def _meta(
    S,
    temperature=1.0,
    top_p=1.0,
    top_k=0,
    seed=None,
    token_index=None,
    min_p=0.0,
    repetition_penalty=1.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    use_bias=False,
    slot=None,
    banned=None,
    counts=True,
):
    def col(x, dtype):
        return jnp.broadcast_to(jnp.asarray(x, dtype), (S,))

    seeds = np.broadcast_to(np.asarray(np.arange(S) if seed is None else seed, object), (S,))
    words = np.asarray([split_seed(int(x)) for x in seeds], np.int32)
    return SamplingMetadata(
        temperature=col(temperature, jnp.float32),
        top_p=col(top_p, jnp.float32),
        top_k=col(top_k, jnp.int32),
        min_p=col(min_p, jnp.float32),
        seed_lo=col(words[:, 0], jnp.int32),
        seed_hi=col(words[:, 1], jnp.int32),
        token_index=col(0 if token_index is None else token_index, jnp.int32),
        repetition_penalty=col(repetition_penalty, jnp.float32),
        presence_penalty=col(presence_penalty, jnp.float32),
        frequency_penalty=col(frequency_penalty, jnp.float32),
        use_bias=col(use_bias, jnp.bool_),
        slot=col(np.arange(S) if slot is None else slot, jnp.int32),
        banned=jnp.full((S, MAX_BANNED), -1, jnp.int32) if banned is None else jnp.asarray(banned),
        counts=col(counts, jnp.bool_),
    )


def _state(S, V):
    return init_sampling_state(S + 1, V)


@functools.partial(jax.jit, static_argnames=("k",))
def _sample_full(logits, sm, state, k=5):
    return sample(logits, sm, state, max_logprobs=k, want_logprobs=jnp.bool_(True))


def _sample(logits, sm, state=None):
    out = _sample_full(logits, sm, state if state is not None else _state(*logits.shape))
    return out.token_ids, out.logprobs


def test_argmax_is_numpys_first_maximum():
    """Ties go to the first index, an all -inf row to 0, a row with NaN to its first NaN
    (as `jnp.argmax`); random rows of the vocabulary's width agree with NumPy."""
    inf, nan = np.inf, np.nan
    x = np.array(
        [[1, 3, 3, 2], [-inf] * 4, [1, nan, 5, nan], [0, 0, 0, 0], [-1, -inf, -0.5, -0.5]],
        np.float32,
    )
    np.testing.assert_array_equal(np.asarray(argmax(jnp.asarray(x))), [1, 0, 1, 0, 2])
    np.testing.assert_array_equal(
        np.asarray(argmax(jnp.asarray(x))), np.asarray(jnp.argmax(jnp.asarray(x), -1))
    )
    r = np.random.default_rng(0).standard_normal((3, 5, 49152)).astype(np.float32)
    got = jax.jit(argmax)(jnp.asarray(r))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.argmax(r, -1))


@pytest.mark.parametrize("rows", [1, 3, 8, 64])
@pytest.mark.parametrize("vocab", [300, 1000, 49152])
def test_argmax_agrees_with_numpy_whatever_the_rows(rows, vocab):
    """Both forms (under 8 rows, and chunks of 128 from 8 rows on; a vocabulary not a multiple
    of 128 padded): ties among few values, a NaN after the row's maximum (NumPy: the NaN), a
    NaN in the last chunk, +inf with NaN, an all -inf row, -0.0 tied with 0.0."""
    rng = np.random.default_rng(rows * vocab)
    x = rng.integers(-3, 3, (rows, vocab)).astype(np.float32)
    x[0, 5], x[0, vocab - 2] = 9.0, np.nan
    if rows > 1:
        x[1] = -np.inf
    if rows > 2:
        x[2, :] = -1.0
        x[2, 7], x[2, 3], x[2, vocab - 1] = 0.0, -0.0, np.nan
        x[2, 1] = np.inf
    if rows > 3:
        x[3, :] = -1.0
        x[3, 3], x[3, 7] = -0.0, 0.0
    want = np.argmax(x, -1)
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(jnp.asarray(x))), want)


def test_greedy_rows_and_logprobs():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.standard_normal((3, 40)).astype(np.float32))
    ids, lp = _sample(logits, _meta(3, temperature=[0.0, 1e-6, 0.0]))
    np.testing.assert_array_equal(ids, np.argmax(logits, -1))
    ref = np.asarray(jax.nn.log_softmax(logits, -1))[np.arange(3), np.asarray(ids)]
    np.testing.assert_allclose(lp, ref, rtol=1e-6)


def test_very_small_temperature_is_not_nan():
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((2, 30)).astype(np.float32))
    ids, lp = _sample(logits, _meta(2, temperature=[1e-5, 2e-5], seed=[1, 2]))
    assert np.all(np.isfinite(np.asarray(lp)))
    np.testing.assert_array_equal(ids, np.argmax(logits, -1))  # t = 2e-5 is all but greedy


def test_seeded_draw_depends_on_seed_and_index_only():
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.standard_normal((4, 64)).astype(np.float32))
    base = _meta(4, seed=[11, 12, 13, 14], token_index=[0, 5, 9, 2])
    ids, _ = _sample(logits, base)
    # Row 2 alone, in another position of another batch, with different neighbours:
    other = jnp.asarray(rng.standard_normal((3, 64)).astype(np.float32)).at[1].set(logits[2])
    ids2, _ = _sample(other, _meta(3, seed=[99, 13, 7], token_index=[1, 9, 4]))
    assert int(ids2[1]) == int(ids[2])


def test_seeds_that_differ_above_bit_31_draw_differently():
    """All 64 bits of the seed reach the key: 5 and 5 + 2**32 (same low word) differ."""
    S = 16
    logits = jnp.zeros((S, 1000), jnp.float32)  # uniform: the draw is the key's alone
    ids_a, _ = _sample(logits, _meta(S, seed=5, token_index=np.arange(S)))
    ids_b, _ = _sample(logits, _meta(S, seed=5 + 2**32, token_index=np.arange(S)))
    ids_a2, _ = _sample(logits, _meta(S, seed=5, token_index=np.arange(S)))
    np.testing.assert_array_equal(ids_a, ids_a2)
    assert np.sum(np.asarray(ids_a) != np.asarray(ids_b)) > S // 2


def test_draws_follow_the_distribution():
    """Empirical frequencies of many seeded draws match softmax(logits / T)."""
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
    S = 4000
    ids, _ = _sample(
        jnp.tile(jnp.asarray(logits), (S, 1)),
        _meta(S, temperature=1.0, seed=np.arange(S), token_index=0),
    )
    freq = np.bincount(np.asarray(ids), minlength=4) / S
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    ids_t, _ = _sample(
        jnp.tile(jnp.asarray(logits), (S, 1)),
        _meta(S, temperature=0.5, seed=np.arange(S) + S, token_index=0),
    )
    p = np.array([0.5, 0.3, 0.15, 0.05]) ** 2
    np.testing.assert_allclose(
        np.bincount(np.asarray(ids_t), minlength=4) / S, p / p.sum(), atol=0.03
    )


def test_top_k_and_top_p_never_draw_outside_the_kept_set():
    logits = jnp.asarray(np.linspace(2, -2, 20, dtype=np.float32))
    S = 500
    ids, _ = _sample(jnp.tile(logits, (S, 1)), _meta(S, top_k=3, seed=np.arange(S)))
    assert set(np.asarray(ids).tolist()) <= {0, 1, 2}
    ids, _ = _sample(jnp.tile(logits, (S, 1)), _meta(S, top_p=0.3, seed=np.arange(S)))
    probs = np.asarray(jax.nn.softmax(logits))
    n_keep = int(np.sum(np.cumsum(probs) - probs < 0.3))
    assert set(np.asarray(ids).tolist()) <= set(range(n_keep))


def _np_penalties(logits, counts, prompt_mask, rep, pres, freq):
    """Penalties as vLLM documents them, one row and token at a time."""
    out = logits.copy()
    for r in range(out.shape[0]):
        for t in range(out.shape[1]):
            if prompt_mask[r, t] or counts[r, t] > 0:
                out[r, t] = out[r, t] / rep[r] if out[r, t] > 0 else out[r, t] * rep[r]
            out[r, t] -= freq[r] * counts[r, t] + pres[r] * (counts[r, t] > 0)
    return out


def test_penalties_match_numpy():
    rng = np.random.default_rng(4)
    S, V = 3, 12
    logits = rng.standard_normal((S, V)).astype(np.float32) * 2
    counts = rng.integers(0, 3, (S, V)).astype(np.int32) * (rng.random((S, V)) < 0.4)
    prompt = rng.random((S, V)) < 0.3
    rep = np.array([1.0, 1.3, 0.7], np.float32)
    pres = np.array([0.0, 0.5, -1.0], np.float32)
    freq = np.array([0.2, 0.0, 1.5], np.float32)
    got = apply_penalties(
        jnp.asarray(logits),
        jnp.asarray(counts),
        jnp.asarray(prompt),
        jnp.asarray(rep),
        jnp.asarray(pres),
        jnp.asarray(freq),
    )
    want = _np_penalties(logits, counts, prompt, rep, pres, freq)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_min_p_matches_numpy():
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, 30)).astype(np.float32) * 2
    min_p = np.array([0.0, 0.1, 0.5], np.float32)
    got = np.asarray(apply_min_p(jnp.asarray(logits), jnp.asarray(min_p)))
    for r in range(3):
        p = np.exp(logits[r] - logits[r].max())
        p /= p.sum()
        keep = p >= min_p[r] * p.max()
        np.testing.assert_array_equal(np.isfinite(got[r]), keep)
        np.testing.assert_allclose(got[r][keep], logits[r][keep])


def test_bias_banned_and_penalties_in_the_sampler_with_state_rows():
    """Greedy picks after bias, banned ids and penalties; rows do not leak into each other."""
    S, V = 3, 10
    logits = jnp.asarray(np.tile(np.linspace(1.0, 0.1, V, dtype=np.float32), (S, 1)))
    state = _state(S, V)
    bias = np.zeros((S, V), np.float32)
    bias[0, 7] = 5.0  # row 0: logit_bias pushes token 7 to the top
    state = set_bias_rows(state, jnp.arange(S), jnp.asarray(bias))
    # Row 2 has generated token 0 twice and has token 1 in its prompt.
    tokens = np.array([[0, 0, 0], [0, 0, 0], [1, 0, 0]], np.int32)
    kinds = np.array([[0, 0, 0], [0, 0, 0], [1, 2, 2]], np.int32)
    state = init_state_rows(
        state, jnp.arange(S), jnp.ones(S, bool), jnp.asarray(tokens), jnp.asarray(kinds)
    )
    assert np.asarray(state.output_counts)[2, 0] == 2 and np.asarray(state.prompt_mask)[2, 1]
    banned = np.full((S, MAX_BANNED), -1, np.int32)
    banned[1, :2] = [0, 1]  # row 1: tokens 0 and 1 banned this step
    sm = _meta(
        S,
        temperature=0.0,
        use_bias=[True, False, False],
        banned=banned,
        frequency_penalty=[0.0, 0.0, 1.0],
        repetition_penalty=[1.0, 1.0, 100.0],
    )
    ids, _ = _sample(logits, sm, state)
    # Row 2: token 0 pays 2 x 1.0 and the repetition penalty; token 1 is in the prompt.
    assert np.asarray(ids).tolist() == [7, 2, 2]
    state = count_sampled(state, sm, ids)
    assert np.asarray(state.output_counts)[:S, [7, 2]].tolist() == [[1, 0], [0, 1], [0, 1]]


def test_logprobs_are_raw_with_ranks_and_top_k():
    rng = np.random.default_rng(6)
    logits = jnp.asarray(rng.standard_normal((4, 25)).astype(np.float32))
    bias_state = set_bias_rows(_state(4, 25), jnp.arange(4), jnp.full((4, 25), 3.0))
    out = _sample_full(
        logits, _meta(4, temperature=1.0, use_bias=True, seed=[1, 2, 3, 4]), bias_state, k=5
    )
    ref = np.asarray(jax.nn.log_softmax(logits, -1))  # raw: the bias does not enter
    ids = np.asarray(out.token_ids)
    np.testing.assert_allclose(out.logprobs, ref[np.arange(4), ids], rtol=1e-6)
    order = np.argsort(-ref, axis=-1)
    np.testing.assert_array_equal(out.top_ids, order[:, :5])
    np.testing.assert_allclose(
        out.top_logprobs, np.take_along_axis(ref, order[:, :5], -1), rtol=1e-6
    )
    ranks = [1 + int(np.sum(ref[r] > ref[r, ids[r]])) for r in range(4)]
    assert np.asarray(out.ranks).tolist() == ranks


def _bitmask(allowed: np.ndarray) -> np.ndarray:
    """llguidance's layout: bit j of word w allows token 32 w + j. allowed: [S, V] bool."""
    S, V = allowed.shape
    bits = np.zeros((S, -(-V // 32) * 32), bool)
    bits[:, :V] = allowed
    return np.packbits(bits, axis=-1, bitorder="little").view("<i4")  # [S, ceil(V / 32)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("use_bitmask", [True, False])
def test_bitmask_is_applied_before_sampling_and_logprobs(temperature, use_bitmask):
    """A greedy batch with nothing else to apply still obeys the structured-output bitmask
    (the argmax of the masked logits), and the logprobs are those of the masked logits; with
    `use_bitmask` unset, the bitmask is ignored."""
    S, V = 3, 70
    rng = np.random.default_rng(9)
    logits = jnp.asarray(rng.standard_normal((S, V)).astype(np.float32))
    allowed = rng.random((S, V)) < 0.3
    allowed[:, 0] = True

    @jax.jit
    def run(logits, sm, bitmask, flag):
        return sample(
            logits,
            sm,
            _state(S, V),
            max_logprobs=3,
            want_logprobs=jnp.bool_(True),
            bitmask=bitmask,
            use_bitmask=flag,
        )

    sm = _meta(S, temperature=temperature, seed=[4, 5, 6])
    out = run(logits, sm, jnp.asarray(_bitmask(allowed)), jnp.bool_(use_bitmask))
    masked = np.where(allowed, np.asarray(logits), -np.inf) if use_bitmask else np.asarray(logits)
    ids = np.asarray(out.token_ids)
    if use_bitmask:
        assert allowed[np.arange(S), ids].all()
    if temperature == 0.0:
        np.testing.assert_array_equal(ids, np.argmax(masked, -1))
    ref = np.asarray(jax.nn.log_softmax(jnp.asarray(masked), -1))
    np.testing.assert_allclose(out.logprobs, ref[np.arange(S), ids], rtol=1e-6)


def test_a_greedy_step_has_no_vocabulary_sized_conditional_result():
    """A `lax.cond` whose result is the [S, V] logits copies them (12.6 MB for 64 rows of
    49,152 tokens, into freshly mapped memory on CPU) even when it passes them through: the
    compiled sampler of a greedy step has no such conditional outside the branches that
    apply something."""
    S, V = 8, 4096
    hlo = (
        jax.jit(
            lambda x, sm, s, b, f: sample(
                x,
                sm,
                s,
                max_logprobs=4,
                want_logprobs=jnp.bool_(False),
                bitmask=b,
                use_bitmask=f,
            )
        )
        .lower(
            jnp.zeros((S, V), jnp.float32),
            _meta(S, temperature=0.0),  # arguments, not constants the compiler could fold
            _state(S, V),
            jnp.zeros((S, V // 32), jnp.int32),
            jnp.bool_(False),
        )
        .compile()
        .as_text()
    )
    entry = hlo[hlo.index("\nENTRY ") :]
    entry = entry[: entry.index("\n}")]
    conds = [line for line in entry.splitlines() if " conditional(" in line]
    assert conds  # the sampler's stages are conditionals at the top level
    assert not [c for c in conds if f"f32[{S},{V}]" in c.split(" conditional(")[0]], conds


def test_rows_sampled_in_blocks_match_each_row_alone():
    """The sampler works on blocks of SAMPLE_BLOCK_ROWS rows (`by_row_blocks`): each of 24
    rows with mixed parameters (greedy, temperatures, top-k, top-p, min-p, penalties, bias,
    banned tokens, a bitmask) draws the same token with the same logprob, rank and top-5
    as when it is sampled alone, and the greedy rows take the argmax of their processed
    logits."""
    S, V = 24, 300
    assert S % SAMPLE_BLOCK_ROWS == 0 and S > SAMPLE_BLOCK_ROWS  # three blocks
    rng = np.random.default_rng(8)
    logits = jnp.asarray((rng.standard_normal((S, V)) * 2).astype(np.float32))
    r = np.arange(S)
    params = dict(
        temperature=np.where(r % 3 == 0, 0.0, 0.5 + (r % 4) * 0.3),
        top_k=np.where(r % 5 == 1, 7, 0),
        top_p=np.where(r % 7 == 2, 0.6, 1.0),
        min_p=np.where(r % 6 == 4, 0.05, 0.0),
        repetition_penalty=np.where(r % 4 == 3, 1.3, 1.0),
        frequency_penalty=np.where(r % 8 == 5, 0.5, 0.0),
        use_bias=r % 9 == 6,
        seed=r * 7919 + 3,
        token_index=r % 11,
    )
    banned = np.full((S, MAX_BANNED), -1, np.int32)
    banned[r % 10 == 7, :3] = [5, 17, 42]
    allowed = rng.random((S, V)) < 0.7
    allowed[r % 2 == 0] = True
    bias = (rng.standard_normal((S, V)) * 3).astype(np.float32)
    tokens = rng.integers(0, V, (S, 6)).astype(np.int32)
    kinds = np.tile(np.array([1, 1, 1, 2, 2, 2], np.int32), (S, 1))

    @jax.jit
    def run(logits, sm, bias, tokens, kinds, mask):
        n = logits.shape[0]
        state = set_bias_rows(init_sampling_state(n + 1, V), jnp.arange(n), bias)
        state = init_state_rows(state, jnp.arange(n), jnp.ones(n, bool), tokens, kinds)
        return sample(
            logits,
            sm,
            state,
            max_logprobs=5,
            want_logprobs=jnp.bool_(True),
            bitmask=mask,
            use_bitmask=jnp.bool_(True),
        )

    mask = jnp.asarray(_bitmask(allowed))
    together = run(logits, _meta(S, banned=banned, **params), bias, tokens, kinds, mask)
    for i in range(S):
        one = {k: np.asarray(v)[i : i + 1] for k, v in params.items()}
        alone = run(
            logits[i : i + 1],
            _meta(1, banned=banned[i : i + 1], **one),
            bias[i : i + 1],
            tokens[i : i + 1],
            kinds[i : i + 1],
            mask[i : i + 1],
        )
        for field in ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(
                np.asarray(getattr(together, field))[i], np.asarray(getattr(alone, field))[0]
            )
    ids = np.asarray(together.token_ids)
    assert np.all(allowed[r, ids])  # the bitmask holds in every block
    greedy = r % 3 == 0
    plain = greedy & ~params["use_bias"] & (params["repetition_penalty"] == 1.0)
    plain &= (params["frequency_penalty"] == 0.0) & np.all(banned < 0, axis=1)
    masked = np.where(allowed, np.asarray(logits), -np.inf)
    np.testing.assert_array_equal(ids[plain], np.argmax(masked, -1)[plain])
    assert plain.sum() >= 4 and len(set(ids[~greedy].tolist())) > 4


def test_sampler_temporaries_stay_under_glibcs_largest_mmap_threshold():
    """XLA's CPU client allocates a step's temporaries in one block per call; glibc maps a
    block over 32 MiB afresh every time (a page fault per 4 KiB touched). The sampler of
    64 rows of a 49,152-token vocabulary, with every stage, logprobs and a bitmask, keeps its
    own temporaries under 16 MiB, so that with the 12 MiB of logits a 64-row decode step
    stays under 32 MiB. (9 MiB here; 85 MiB when the sampler worked on all 64 rows at once.)"""
    S, V = 64, 49152
    compiled = (
        jax.jit(
            lambda x, sm, s, b, w: sample(
                x, sm, s, max_logprobs=20, want_logprobs=w, bitmask=b, use_bitmask=w
            )
        )
        .lower(
            jnp.zeros((S, V), jnp.float32),
            _meta(S),
            _state(S, V),
            jnp.zeros((S, V // 32), jnp.int32),
            jnp.bool_(True),
        )
        .compile()
    )
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < 16 * 2**20, temp / 2**20


def test_lm_head_and_sampler_in_row_blocks_of_a_large_step():
    """A step with more sampler rows than LOGITS_ROW_BLOCK runs the LM head and the sampler
    one block at a time, up to the block of the last real row: 150 rows (3 blocks of 64, the
    last padded), 100 of them real, give the real rows the tokens, logprobs and top-k of
    sampling all 150 rows' logits at once, and zeros in the block past them."""
    from pagedjax.executor.step import LOGITS_ROW_BLOCK, _sample_in_row_blocks

    S, V, real = 150, 300, 100
    R = LOGITS_ROW_BLOCK
    assert R < real < 2 * R < S < 3 * R
    rng = np.random.default_rng(9)
    rows = jnp.asarray(rng.standard_normal((S, 1)).astype(np.float32))
    w = jnp.asarray(rng.standard_normal((V,)).astype(np.float32) * 3)
    offset = jnp.asarray(rng.standard_normal((V,)).astype(np.float32))

    def head(x, num_rows):  # no reduction: the same bits whatever the block
        return x * w + offset

    r = np.arange(S)
    sm = _meta(S, temperature=np.where(r % 2 == 0, 0.0, 0.8), top_k=np.where(r % 3 == 0, 5, 0))

    def sample_rows(logits, sm, prior, mask):
        assert prior is None and mask is None
        return sample(logits, sm, _state(S, V), max_logprobs=4, want_logprobs=jnp.bool_(True))

    got = jax.jit(
        lambda rows, n, sm: _sample_in_row_blocks(head, sample_rows, rows, n, (sm, None, None))
    )(rows, jnp.int32(real), sm)
    want = jax.jit(lambda rows, sm: sample_rows(head(rows, S), sm, None, None))(rows, sm)
    for field in ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs"):
        g, x = np.asarray(getattr(got, field)), np.asarray(getattr(want, field))
        assert g.shape == x.shape
        np.testing.assert_array_equal(g[:real], x[:real])
        assert not np.any(g[2 * R :])
    assert len(set(np.asarray(got.token_ids)[:real].tolist())) > 10


def test_sampler_row_blocks_only_on_one_cpu_device():
    """The step samples in row blocks on one CPU device only: on several devices its logits
    are sharded over the vocabulary and every block would carry collectives (the MoE
    sharding test counts them), on an accelerator glibc's mmap threshold does not apply."""
    from types import SimpleNamespace

    from pagedjax.executor.step_executables import sample_block_rows

    cpu = jax.devices("cpu")[0]
    gpu = SimpleNamespace(platform="gpu")
    assert sample_block_rows(SimpleNamespace(devices=np.array([[cpu]]))) == SAMPLE_BLOCK_ROWS
    assert sample_block_rows(SimpleNamespace(devices=np.array([[cpu, cpu]]))) == 0
    assert sample_block_rows(SimpleNamespace(devices=np.array([[gpu]], dtype=object))) == 0
