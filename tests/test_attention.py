"""Ragged paged attention: the XLA path and the "cpu" path (native C++ kernel) against the jnp
reference over a grid of shapes, sliding windows, logit soft-caps and cache dtypes, and the
reference against a dense float64 NumPy softmax computed independently. The native
kernel's own checks (every ISA path against NumPy, float8 bytes, ...) are in
test_attention_native.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.executor.input_batch import BatchBuilder, SeqInput
from pagedjax.ops.attention import AttentionMetadata, ragged_paged_attention

HEAD_DIM = 16
# The fast backends checked against the reference; "cpu" needs a C++ compiler (present in CI).
FAST_BACKENDS = ["xla", "cpu"]


def _case(
    seqs_spec,
    block_size,
    num_kv_heads,
    group,
    *,
    tile=8,
    chunk_pages=2,
    seed=0,
    max_tokens=256,
    sizes=(16,),
    num_blocks=None,
):
    """Random cache + queries for sequences given as (cached_len, query_len). The step is
    padded to the smallest of `sizes` (then `max_tokens`) that holds it; the cache holds
    `num_blocks` blocks (None: two more than the sequences use). Cases of one step size, cache
    size and head layout share their compilations."""
    rng = np.random.default_rng(seed)
    used_blocks = sum(-(-(c + q) // block_size) for c, q in seqs_spec)
    num_blocks = num_blocks or 2 + used_blocks
    assert num_blocks > used_blocks
    perm = rng.permutation(np.arange(1, num_blocks))  # scattered block ids; 0 stays null
    seqs, used = [], 0
    for cached, q in seqs_spec:
        nb = -(-(cached + q) // block_size)
        seqs.append(
            SeqInput(np.zeros(q, np.int32), cached, perm[used : used + nb].astype(np.int32))
        )
        used += nb
    builder = BatchBuilder(
        max_num_batched_tokens=max_tokens,
        max_num_seqs=32,
        max_model_len=512,
        block_size=block_size,
        query_tile_size=tile,
        kv_chunk_pages=chunk_pages,
        sizes=sizes,  # (16,): the 16-token minimum, small cases keep padding rows
    )
    layout, buf = builder.build(seqs)
    a = layout.unpack(buf.copy())
    md = AttentionMetadata.from_arrays(
        {f: jnp.asarray(x) for f, x in a.items()}, query_tile_size=tile, kv_chunk_pages=chunk_pages
    )
    T = layout.num_tokens
    shape = (2, num_blocks, block_size, num_kv_heads, HEAD_DIM)
    k_cache = jnp.asarray(rng.standard_normal(shape, np.float32))
    v_cache = jnp.asarray(rng.standard_normal(shape, np.float32))
    q = jnp.asarray(rng.standard_normal((T, num_kv_heads * group, HEAD_DIM), np.float32))
    return q, k_cache, v_cache, md, seqs, a


def _attention(q, k, v, md, backend, window=None, cap=None, k_scale=None, v_scale=None):
    return ragged_paged_attention(
        q,
        k,
        v,
        1,
        md,
        sm_scale=HEAD_DIM**-0.5,
        backend=backend,
        k_scale=k_scale,
        v_scale=v_scale,
        sliding_window=window,
        logit_soft_cap=cap,
    )


_attn = jax.jit(_attention, static_argnames=("backend", "window", "cap"))
# The window an int32 array (0: none), as Gemma 3's per-layer windows: one compilation for all.
_attn_traced_window = jax.jit(_attention, static_argnames=("backend", "cap"))


def _numpy_dense(q, k_cache, v_cache, seqs, block_size, scale, window=None, cap=None):
    """Independent dense attention per sequence in float64, from the block ids and lengths
    alone: query position p sees keys max(0, p - window + 1) .. p (Hugging Face's
    `kv_idx > q_idx - sliding_window`); scores capped as cap * tanh(scores / cap)."""
    q, k_cache, v_cache = (np.asarray(x, np.float64) for x in (q, k_cache, v_cache))
    out = np.zeros(q.shape, np.float64)
    t0 = 0
    K = k_cache.shape[3]
    G = q.shape[1] // K
    for s in seqs:
        n, ctx = len(s.token_ids), s.start + len(s.token_ids)
        k = np.concatenate([k_cache[1, b] for b in s.block_ids])[:ctx]  # [ctx, K, H]
        v = np.concatenate([v_cache[1, b] for b in s.block_ids])[:ctx]
        for i in range(n):
            pos = s.start + i
            lo = max(0, pos - window + 1) if window else 0
            for h in range(q.shape[1]):
                sc = k[lo : pos + 1, h // G] @ q[t0 + i, h] * scale
                if cap is not None:
                    sc = cap * np.tanh(sc / cap)
                p = np.exp(sc - sc.max())
                out[t0 + i, h] = (p / p.sum()) @ v[lo : pos + 1, h // G]
        t0 += n
    return out


# Query scale of the soft-cap cases: scores of about +-20, so that caps of 30 and 50 bend them.
CAP_Q_SCALE = 20.0


@pytest.mark.parametrize(
    "window,cap", [(None, None), (1, None), (5, None), (4, 30.0), (16, 50.0), (None, 30.0)]
)
def test_reference_equals_numpy_dense(window, cap):
    """Hand-sized: prefill chunks from 0 and after a prefix, decode rows at block edges, a
    window of one token (each query sees itself only) and one longer than some contexts."""
    spec = [(0, 5), (9, 1), (3, 7), (16, 1)]
    q, k, v, md, seqs, _ = _case(spec, 8, 2, 2)
    if cap is not None:
        q = q * CAP_Q_SCALE
    ref = np.asarray(_attn(q, k, v, md, "reference", window, cap))
    dense = _numpy_dense(q, k, v, seqs, 8, HEAD_DIM**-0.5, window, cap)
    np.testing.assert_allclose(ref, dense, atol=2e-5, rtol=1e-5)
    total = sum(n for _, n in spec)
    assert not ref[total:].any(), "padding rows must be zero"
    if window == 1:  # a query sees only itself: its own value row
        slots = np.asarray(md.slot_mapping[:total])
        v_self = np.asarray(v)[1, slots // 8, slots % 8]  # [total, K, H]
        np.testing.assert_allclose(ref[:total], np.repeat(v_self, 2, axis=1), atol=1e-6)
    # The window and the cap matter in these cases: without them the result differs.
    if window is not None or cap is not None:
        plain = _numpy_dense(q, k, v, seqs, 8, HEAD_DIM**-0.5)
        assert np.abs(plain - dense).max() > 1e-2


# (cached_len, query_len) per sequence; block-size-relative lengths are filled in below.
def _grid(bs):
    return {
        "decode-ctx-1": [(0, 1)],
        "decode-edges": [(bs - 2, 1), (bs - 1, 1), (bs, 1), (3 * bs + 5, 1)],
        "prefill-no-prefix": [(0, bs - 1), (0, bs), (0, bs + 1)],
        "prefill-with-prefix": [(bs, 3), (bs + 1, 2 * bs + 3), (5, 40)],
        "mixed": [(7, 1), (0, 37), (2 * bs, 1), (bs - 1, 9), (100, 1)],
        "long": [(200, 1), (150, 60)],
    }


def _check_xla(
    spec,
    block_size,
    kv_heads,
    group,
    backend="xla",
    window=None,
    cap=None,
    kv_dtype=None,
    traced_window=False,
    **kw,
):
    q, k, v, md, _, a = _case(spec, block_size, kv_heads, group, seed=block_size + group, **kw)
    scales = {}
    if kv_dtype is not None:  # a quantized cache: a cached value means value * scale
        scales = dict(k_scale=jnp.float32(0.02), v_scale=jnp.float32(0.5))
        k = (k / scales["k_scale"]).astype(kv_dtype)
        v = (v / scales["v_scale"]).astype(kv_dtype)
    if cap is not None:
        q = q * CAP_Q_SCALE
    attn = _attn
    if traced_window:
        attn, window = _attn_traced_window, jnp.int32(window or 0)
    ref = np.asarray(attn(q, k, v, md, "reference", window, cap, **scales))
    got = np.asarray(attn(q, k, v, md, backend, window, cap, **scales))
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)
    total = int(a["query_start_loc"][-1])
    assert total < q.shape[0], "the case must include padding tokens"
    assert not got[total:].any(), "padding rows must be zero"


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 3), (2, 4), (1, 8)])
def test_xla_matches_reference(block_size, kv_heads, group, backend):
    """Every case of the grid in one ragged batch (one compilation per shape)."""
    spec = [s for case in _grid(block_size).values() for s in case]
    _check_xla(spec, block_size, kv_heads, group, backend, max_tokens=512)


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("kv_heads,group", [(2, 1), (1, 3), (2, 4), (1, 8)])
@pytest.mark.parametrize("case", list(_grid(16)))
def test_xla_matches_reference_case_by_case(block_size, kv_heads, group, case):
    """Each case of the grid alone in its step (every step padded to 128 tokens over a cache
    of 64 blocks: the cases of one head layout share one compilation of each path)."""
    spec = _grid(block_size)[case]
    _check_xla(spec, block_size, kv_heads, group, max_tokens=128, sizes=(), num_blocks=64)


GQA = [(2, 1), (1, 3), (2, 4), (1, 8)]
# (sliding window, soft cap, cache dtype); block size and GQA ratio take turns below. Windows
# of 1 (each query sees itself), shorter than a block, one block, across chunk edges (40) and
# longer than every context (1000).
WINDOW_CAP = [
    (1, None, None),
    (5, 30.0, None),
    (16, None, "float8_e4m3fn"),
    (16, 50.0, None),
    (40, None, None),
    (1000, 30.0, None),
    (None, 50.0, "float8_e5m2"),
    (5, 50.0, "float8_e4m3fn"),
]


@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize(
    "window,cap,kv_dtype,block_size,kv_heads,group",
    [(*wc, (16, 32, 8)[i % 3], *GQA[i % 4]) for i, wc in enumerate(WINDOW_CAP)],
)
def test_window_and_cap_match_reference(
    backend, window, cap, kv_dtype, block_size, kv_heads, group
):
    """The whole grid (prefill chunks with and without a prefix next to decode rows) in one
    ragged batch, under a sliding window and/or a logit soft-cap, float32 or float8 pages."""
    spec = [s for case in _grid(block_size).values() for s in case]
    _check_xla(spec, block_size, kv_heads, group, backend, window, cap, kv_dtype, max_tokens=512)


@pytest.mark.slow
@pytest.mark.parametrize("backend", FAST_BACKENDS)
@pytest.mark.parametrize("cap", [None, 30.0, 50.0])
def test_window_and_cap_match_reference_wide(backend, cap):
    """Every window x cap, the window traced (one compilation of each path per cap); block
    size, GQA ratio and cache dtype take turns with the cap."""
    i = [None, 30.0, 50.0].index(cap)
    block_size, (kv_heads, group) = (16, 32, 8)[i], GQA[i + 1]
    kv_dtype = (None, "float8_e4m3fn", "float8_e5m2")[i]
    spec = [s for case in _grid(block_size).values() for s in case]
    for window in [None, 1, 5, 16, 1000]:
        _check_xla(
            spec, block_size, kv_heads, group, backend, window, cap, kv_dtype, True, max_tokens=512
        )


@pytest.mark.parametrize("backend", ["reference", *FAST_BACKENDS])
def test_traced_window_in_a_scan_over_layers(backend):
    """A per-layer window array, scanned over as Gemma 3 does: layer 0 with a window of 4,
    layer 1 with 0 (full attention); each layer equals the reference with a static window."""
    spec = [(0, 9), (20, 1), (13, 6), (40, 1)]
    q, k, v, md, _, _ = _case(spec, 8, 2, 2, seed=11)

    @jax.jit
    def layers(q, k, v, md, windows):
        def step(carry, xs):
            layer, window = xs
            out = ragged_paged_attention(
                q, k, v, layer, md, sm_scale=0.25, backend=backend, sliding_window=window
            )
            return carry, out

        return jax.lax.scan(step, None, (jnp.arange(2), windows))[1]

    got = np.asarray(layers(q, k, v, md, jnp.array([4, 0], jnp.int32)))
    for layer, window in enumerate([4, None]):
        want = ragged_paged_attention(
            q, k, v, layer, md, sm_scale=0.25, backend="reference", sliding_window=window
        )
        np.testing.assert_allclose(got[layer], np.asarray(want), atol=2e-5, rtol=1e-5)
    full = ragged_paged_attention(q, k, v, 0, md, sm_scale=0.25, backend="reference")
    assert np.abs(got[0] - np.asarray(full)).max() > 1e-2, "the window must matter"


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_window_skips_blocks_before_it(backend):
    """Under a window the fast paths do not read KV wholly before it: NaN pages there (a
    poisoned cache) leave the output equal to the reference on a clean cache. A decode row and
    a prefill chunk at position 300 with a window of 16 see positions 285 on; the pages of
    positions below 256 (a whole number of every path's KV steps) are NaN."""
    spec = [(300, 1), (300, 20)]
    q, k, v, md, seqs, a = _case(spec, 16, 2, 2, chunk_pages=2, seed=5, max_tokens=64)
    ref = np.asarray(_attn(q, k, v, md, "reference", 16))
    poisoned = np.concatenate([s.block_ids[: 256 // 16] for s in seqs])
    k = k.at[1, poisoned].set(jnp.nan)
    v = v.at[1, poisoned].set(jnp.nan)
    got = np.asarray(_attn(q, k, v, md, backend, 16))
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)
    # A window of 64 reaches back to position 237: the poison is read.
    assert np.isnan(np.asarray(_attn(q, k, v, md, backend, 64))).any()


def test_bad_window_and_cap_are_value_errors():
    q, k, v, md, _, _ = _case([(0, 2)], 8, 1, 1)
    for bad in (dict(sliding_window=2.5), dict(sliding_window=jnp.ones(2, jnp.int32))):
        with pytest.raises(ValueError, match="sliding_window"):
            ragged_paged_attention(q, k, v, 1, md, sm_scale=1.0, **bad)
    for bad in (0.0, -1.0, float("inf"), jnp.float32(30.0)):
        with pytest.raises(ValueError, match="logit_soft_cap"):
            ragged_paged_attention(q, k, v, 1, md, sm_scale=1.0, logit_soft_cap=bad)
    # A window of 0 (or less) is full attention, as None.
    full = ragged_paged_attention(q, k, v, 1, md, sm_scale=1.0, backend="reference")
    zero = ragged_paged_attention(
        q, k, v, 1, md, sm_scale=1.0, backend="reference", sliding_window=0
    )
    np.testing.assert_array_equal(np.asarray(zero), np.asarray(full))


@pytest.mark.parametrize("tile,chunk_pages", [(1, 1), (4, 3), (32, 8)])
def test_xla_tiling_parameters_do_not_change_results(tile, chunk_pages):
    spec = [(0, 33), (12, 1), (40, 17), (0, 1)]
    q, k, v, md, _, _ = _case(spec, 8, 2, 2, tile=tile, chunk_pages=chunk_pages, seed=7)
    ref = np.asarray(_attn(q, k, v, md, "reference"))
    np.testing.assert_allclose(np.asarray(_attn(q, k, v, md, "xla")), ref, atol=2e-5, rtol=1e-5)


def test_unknown_backend_is_named():
    q, k, v, md, _, _ = _case([(0, 2)], 8, 1, 1)
    with pytest.raises(ValueError, match="flash9"):
        ragged_paged_attention(q, k, v, 1, md, sm_scale=1.0, backend="flash9")


@pytest.mark.parametrize(
    "contexts",
    [
        [5 * i * i % 500 + 1 for i in range(24)],  # ragged: blocks of 8 rows, each to its own end
        [300] * 22 + [299, 301],  # alike: one block of all rows has the fewest loop turns
    ],
    ids=["ragged", "alike"],
)
def test_decode_rows_in_blocks_or_whole_match_reference(contexts):
    """Both ways `_decode_rows` may take (the step picks the cheaper from the lengths), with
    rows out of length order and padding rows (24 sequences in a bucket of 32)."""
    q, k, v, md, _, _ = _case([(c, 1) for c in contexts], 16, 2, 3, chunk_pages=2, seed=3)
    assert md.seq_lens.shape[0] == 32
    ref = np.asarray(_attn(q, k, v, md, "reference"))
    np.testing.assert_allclose(np.asarray(_attn(q, k, v, md, "xla")), ref, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(_attn(q, k, v, md, "cpu")), ref, atol=2e-5, rtol=1e-5)
