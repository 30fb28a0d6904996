"""Ragged paged attention: the XLA path and the "cpu" path (native C++ decode rows) against
the jnp reference over a grid of shapes, and the reference against a dense NumPy softmax
computed independently."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.executor.input_batch import BatchBuilder, SeqInput
from pagedjax.ops import cpu_attention, cpu_kernels
from pagedjax.ops.attention import AttentionMetadata, ragged_paged_attention

HEAD_DIM = 16
# The fast backends checked against the reference; "cpu" needs a C++ compiler (present in CI).
FAST_BACKENDS = ["xla", "cpu"]


def _case(
    seqs_spec, block_size, num_kv_heads, group, *, tile=8, chunk_pages=2, seed=0, max_tokens=256
):
    """Random cache + queries for sequences given as (cached_len, query_len)."""
    rng = np.random.default_rng(seed)
    num_blocks = 2 + sum(-(-(c + q) // block_size) for c, q in seqs_spec)
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


@functools.partial(jax.jit, static_argnames=("backend",))
def _attn(q, k, v, md, backend):
    return ragged_paged_attention(q, k, v, 1, md, sm_scale=HEAD_DIM**-0.5, backend=backend)


def _numpy_dense(q, k_cache, v_cache, seqs, block_size, scale):
    """Independent dense attention per sequence, from the block ids and lengths alone."""
    out = np.zeros(q.shape, np.float32)
    t0 = 0
    K = k_cache.shape[3]
    G = q.shape[1] // K
    for s in seqs:
        n, ctx = len(s.token_ids), s.start + len(s.token_ids)
        k = np.concatenate([k_cache[1, b] for b in s.block_ids])[:ctx]  # [ctx, K, H]
        v = np.concatenate([v_cache[1, b] for b in s.block_ids])[:ctx]
        for i in range(n):
            pos = s.start + i
            for h in range(q.shape[1]):
                sc = k[: pos + 1, h // G] @ q[t0 + i, h] * scale
                p = np.exp(sc - sc.max())
                out[t0 + i, h] = (p / p.sum()) @ v[: pos + 1, h // G]
        t0 += n
    return out


def test_reference_equals_numpy_dense():
    spec = [(0, 5), (9, 1), (3, 7), (16, 1)]
    q, k, v, md, seqs, _ = _case(spec, 8, 2, 2)
    ref = np.asarray(_attn(q, k, v, md, "reference"))
    dense = _numpy_dense(np.asarray(q), np.asarray(k), np.asarray(v), seqs, 8, HEAD_DIM**-0.5)
    np.testing.assert_allclose(ref, dense, atol=2e-5)
    total = sum(n for _, n in spec)
    assert not ref[total:].any(), "padding rows must be zero"


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


def _check_xla(spec, block_size, kv_heads, group, backend="xla", **kw):
    q, k, v, md, _, a = _case(spec, block_size, kv_heads, group, seed=block_size + group, **kw)
    ref = np.asarray(_attn(q, k, v, md, "reference"))
    got = np.asarray(_attn(q, k, v, md, backend))
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
    _check_xla(_grid(block_size)[case], block_size, kv_heads, group)


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


@pytest.mark.parametrize(
    "head_dim,dtype",
    [
        (64, "float32"),
        (24, "float32"),
        (64, "bfloat16"),
        (64, "float8_e4m3fn"),
        (32, "float8_e5m2"),
    ],
)
def test_native_kernel_matches_numpy(head_dim, dtype):
    """`cpu_attention.paged_attention` against a dense NumPy softmax: register-tiled head dims
    (64, 32) and the generic loop (24); float32, bfloat16 and float8 caches (with scales);
    scattered blocks; decode rows (one ending mid-block, a one-token context), a prefill chunk
    after a cached prefix that spans two query tiles, a padding sequence and padding tokens."""
    rng = np.random.default_rng(head_dim)
    L, NB, BS, K, G, B = 3, 48, 16, 2, 3, 8
    lens = np.array([37, 1, 64, 0, 100], np.int32)
    qlens = np.array([1, 1, 1, 0, 21], np.int32)  # the last: prefill of positions 79..99
    qsl = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    T = int(qsl[-1]) + 3  # three padding tokens
    tables = rng.permutation(np.arange(1, NB))[: len(lens) * B].reshape(len(lens), B)
    tables = tables.astype(np.int32)
    shape = (L, NB, BS, K, head_dim)
    k = rng.standard_normal(shape, np.float32)
    v = rng.standard_normal(shape, np.float32)
    k_scale, v_scale = (0.5, 1.5) if "float8" in dtype else (None, None)
    kc, vc = jnp.asarray(k).astype(dtype), jnp.asarray(v).astype(dtype)
    k_read = np.asarray(kc.astype(jnp.float32)) * (k_scale or 1.0)  # what the cache holds
    v_read = np.asarray(vc.astype(jnp.float32)) * (v_scale or 1.0)
    q = rng.standard_normal((T, K * G, head_dim), np.float32)
    scale = head_dim**-0.5
    got = np.asarray(
        jax.jit(
            lambda q, kc, vc, lens, qsl, tables: cpu_attention.paged_attention(
                q, kc, vc, 2, lens, qsl, tables, sm_scale=scale, k_scale=k_scale, v_scale=v_scale
            )
        )(jnp.asarray(q), kc, vc, jnp.asarray(lens), jnp.asarray(qsl), jnp.asarray(tables))
    )
    assert not got[qsl[-1] :].any(), "padding tokens must be zero"
    for s, (n, ql) in enumerate(zip(lens, qlens, strict=True)):
        for i in range(ql):
            ctx = n - ql + i + 1  # positions the query sees
            pos = np.arange(ctx)
            ks = k_read[2, tables[s, pos // BS], pos % BS]  # [ctx, K, H]
            vs = v_read[2, tables[s, pos // BS], pos % BS]
            for h in range(K * G):
                sc = ks[:, h // G] @ q[qsl[s] + i, h] * scale
                p = np.exp(sc - sc.max())
                want = (p / p.sum()) @ vs[:, h // G]
                np.testing.assert_allclose(got[qsl[s] + i, h], want, atol=2e-5, rtol=1e-5)


def test_native_kernel_reports_a_failed_build(monkeypatch, tmp_path):
    """No compiler: `build` names it; the engine's "auto" backend then keeps "xla"."""
    monkeypatch.setenv("PAGEDJAX_CACHE_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler 'no-such-cxx'"):
        cpu_kernels.build("no-such-cxx")
