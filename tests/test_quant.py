"""Quantized matmuls (`ops.linear.linear` on `ops.quant` weights) against float references
with error bounds derived from each format's rounding, against independent NumPy computations
of the same integer / float8 arithmetic; and the float8 KV cache through `write_kv` and paged
attention."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_attention import HEAD_DIM, _case, _numpy_dense

from pagedjax.ops import linear, quant
from pagedjax.ops.attention import ragged_paged_attention
from pagedjax.ops.kv_cache import kv_cache_jnp_dtype, write_kv

T, IN, OUT = 12, 96, 40
E4M3 = ml_dtypes.float8_e4m3fn
# e4m3 keeps 3 mantissa bits: rounding moves a normal value by at most 2**-4 of itself and a
# subnormal one (below 2**-6) by at most half the smallest subnormal, 2**-10.
FP8_REL, FP8_ABS = 2.0**-4, 2.0**-10


@pytest.fixture(scope="module")
def xw():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, IN)).astype(np.float32)
    x[3] = 0.0  # an all-zero token (a padding row) must give zeros, not NaN
    w = (rng.standard_normal((IN, OUT)) * rng.uniform(0.01, 1.0, OUT)).astype(np.float32)
    w[:, 5] = 0.0  # an all-zero output channel
    return x, w


_linear = jax.jit(linear.linear)


def test_int8_weight_only_within_half_a_step(xw):
    x, w = xw
    qw = quant.quantize_int8(jnp.asarray(w))
    q, s = np.asarray(qw.qweight), np.asarray(qw.scales)
    assert qw.qweight.dtype == jnp.int8 and np.abs(q).max() <= 127
    np.testing.assert_allclose(s, np.maximum(np.abs(w).max(0), 1e-12) / 127, rtol=1e-6)
    # Each weight is within half a quantization step of its float value...
    assert np.all(np.abs(q * s - w) <= s / 2 * (1 + 1e-6))
    # ...so each output is within sum_i |x_i| * s_o / 2 of x @ w.
    got = np.asarray(_linear(jnp.asarray(x), qw))
    bound = np.abs(x) @ np.broadcast_to(s / 2, w.shape) + 1e-5
    assert np.all(np.abs(got - x @ w) <= bound)
    np.testing.assert_allclose(got, x @ (q * s), rtol=1e-5, atol=1e-5)
    assert not got[3].any() and not got[:, 5].any()


def test_w8a8_is_an_int32_matmul_of_int8_operands(xw):
    x, w = xw
    qw = quant.quantize_int8(jnp.asarray(w), "w8a8")
    got = np.asarray(_linear(jnp.asarray(x), qw))
    # Independent NumPy: per-token symmetric int8 activations, exact integer product.
    x_scale = np.maximum(np.abs(x).max(1, keepdims=True), 1e-12) / 127  # [T, 1]
    xq = np.clip(np.round(x / x_scale), -127, 127).astype(np.int64)
    wq, ws = np.asarray(qw.qweight).astype(np.int64), np.asarray(qw.scales)
    want = (xq @ wq) * x_scale * ws
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # Error against the float product: both operands are within half a step.
    bound = (
        np.abs(x) @ np.broadcast_to(ws / 2, w.shape)
        + (x_scale / 2) @ np.abs(w).sum(0, keepdims=True)
        + IN * x_scale * ws / 4
        + 1e-5
    )
    assert np.all(np.abs(got - x @ w) <= bound)
    # The compiled matmul takes int8 operands and accumulates in int32.
    hlo = _linear.lower(jnp.asarray(x), qw).as_text()
    dots = [line for line in hlo.splitlines() if "dot_general" in line]
    assert any("xi8>" in line and "xi32>" in line for line in dots), dots


def _fp8_error(v: np.ndarray) -> np.ndarray:
    """The largest rounding error of v (already scaled into e4m3's range)."""
    return np.maximum(FP8_REL * np.abs(v), FP8_ABS)


def test_fp8_dynamic_matches_numpy_and_bound(xw):
    x, w = xw
    qw = quant.quantize_fp8(jnp.asarray(w))
    assert qw.qweight.dtype == jnp.float8_e4m3fn
    ws = np.asarray(qw.scales)
    wq = np.asarray(qw.qweight).astype(np.float64)
    assert np.all(np.abs(wq * ws - w) <= _fp8_error(w / ws) * ws * (1 + 1e-6))
    got = np.asarray(_linear(jnp.asarray(x), qw))
    x_scale = np.maximum(np.abs(x).max(1, keepdims=True), 1e-12) / 448
    xq = np.clip(x / x_scale, -448, 448).astype(E4M3).astype(np.float64)
    np.testing.assert_allclose(got, (xq @ wq) * x_scale * ws, rtol=1e-5, atol=1e-5)
    # |x w - x' w'| <= |x| |w - w'| + |w'| |x - x'| for every product.
    dw = _fp8_error(w / ws) * ws
    dx = _fp8_error(x / x_scale) * x_scale
    bound = np.abs(x) @ dw + dx @ np.abs(wq * ws) + 1e-5
    assert np.all(np.abs(got - x @ w) <= bound)


def test_fp8_static_input_scale_saturates(xw):
    x, w = xw
    qw = quant.quantize_fp8(jnp.asarray(w)).replace(input_scale=jnp.float32(0.004))
    got = np.asarray(_linear(jnp.asarray(x), qw))
    # |x| / 0.004 reaches ~1000: those activations saturate at 448 (not NaN).
    xq = np.clip(x / 0.004, -448, 448).astype(E4M3).astype(np.float64)
    want = (xq @ np.asarray(qw.qweight).astype(np.float64)) * 0.004 * np.asarray(qw.scales)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _numpy_int4(q, zeros, scales, g_idx):
    """Straightforward dequantization, one weight at a time over groups g_idx."""
    w = np.empty(q.shape, np.float32)
    for r in range(q.shape[0]):
        w[r] = (q[r] - zeros[g_idx[r]]).astype(np.float32) * scales[g_idx[r]]
    return w


@pytest.mark.parametrize("act_order", [False, True])
def test_int4_matmul_and_dequantize(xw, act_order):
    x, _ = xw
    rng = np.random.default_rng(1)
    gs, G = 32, IN // 32
    q = rng.integers(0, 16, (IN, OUT))  # the original row order
    zeros = rng.integers(0, 17, (G, OUT))  # 16: a GPTQ v1 zero of 0 read back
    scales = rng.uniform(0.001, 0.1, (G, OUT)).astype(np.float32)
    g_idx = np.arange(IN) // gs
    perm = None
    if act_order:
        g_idx = rng.permutation(g_idx)
        perm = np.argsort(g_idx, kind="stable").astype(np.int32)
    stored = q if perm is None else q[perm]  # rows sorted by group
    packed = np.zeros((IN // 8, OUT), np.int64)
    for r in range(IN):  # row r -> bits 4 (r % 8) of packed row r // 8
        packed[r // 8] |= stored[r].astype(np.int64) << (4 * (r % 8))
    packed = packed.astype(np.uint32).view(np.int32)
    qw = quant.QuantizedWeight(
        jnp.asarray(packed),
        jnp.asarray(scales),
        zeros=jnp.asarray(zeros, jnp.int8),
        perm=None if perm is None else jnp.asarray(perm),
        method="gptq",
        in_features=IN,
    )
    want_w = _numpy_int4(q, zeros, scales, g_idx)
    assert qw.shape == (IN, OUT) and qw.group_size == gs
    np.testing.assert_array_equal(np.asarray(quant.dequantize(qw)), want_w)
    got = np.asarray(_linear(jnp.asarray(x), qw))
    np.testing.assert_allclose(got, x @ want_w, rtol=1e-5, atol=1e-5)


def test_quantize_weight_refuses_int4_on_load():
    with pytest.raises(ValueError, match="awq"):
        quant.quantize_weight(jnp.zeros((8, 8)), "awq")


# ----------------------------------------------------------------------------- fp8 KV cache


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("write", ["xla", "native", "native_donated"])
def test_write_kv_quantizes_and_saturates(kv_cache_dtype, write):
    """XLA's scatter and the native CPU write (a fresh result buffer when the cache is not
    donated, in place when it is): the slots written hold the saturated quotient, every
    other slot of every layer stays zero."""
    dtype = kv_cache_jnp_dtype(kv_cache_dtype, "float32")
    shape = (2, 3, 4, 2, 8)  # [L, blocks, block_size, K, H]
    k_cache, v_cache = jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)
    rng = np.random.default_rng(2)
    k = rng.standard_normal((5, 2, 8)).astype(np.float32)
    v = rng.standard_normal((5, 2, 8)).astype(np.float32)
    k[0, 0, 0], v[1, 1, 1] = 1e6, -1e6  # beyond the format's range after scaling
    slots = np.array([4, 5, 11, 0, 6], np.int32)
    fn = functools.partial(write_kv, native=write != "xla")
    if write == "native_donated":
        fn = jax.jit(fn, donate_argnums=(0, 1))
    k_cache, v_cache = fn(k_cache, v_cache, 1, k, v, slots, 0.5, 2.0)
    fmax = float(ml_dtypes.finfo(dtype).max)
    for cache, new, scale in ((k_cache, k, 0.5), (v_cache, v, 2.0)):
        got = np.asarray(cache[1]).reshape(12, 2, 8)  # [slots, K, H]
        want = np.clip(new / scale, -fmax, fmax).astype(dtype)
        np.testing.assert_array_equal(got[slots].astype(np.float32), want.astype(np.float32))
        assert np.isfinite(got.astype(np.float32)).all()
        assert not np.asarray(cache[0]).astype(np.float32).any(), "another layer was written"
        others = np.setdiff1d(np.arange(12), slots)
        assert not got[others].astype(np.float32).any(), "another slot was written"
    assert float(np.asarray(k_cache[1]).reshape(12, 2, 8)[4, 0, 0]) == fmax


@functools.partial(jax.jit, static_argnames=("backend",))
def _attn_scaled(q, k, v, md, k_scale, v_scale, backend):
    return ragged_paged_attention(
        q, k, v, 1, md, sm_scale=HEAD_DIM**-0.5, backend=backend, k_scale=k_scale, v_scale=v_scale
    )


@pytest.mark.parametrize("backend", ["reference", "xla", "pallas"])  # pallas: interpreted on CPU
def test_fp8_kv_cache_through_paged_attention(backend):
    """K/V written through `write_kv` into a float8_e4m3fn cache with per-layer scales, read
    back by paged attention: equal to dense NumPy attention over the dequantized values, and
    within fp8's precision of attention over the float cache."""
    spec = [(0, 9), (20, 1), (5, 12), (33, 1)]
    q, k32, v32, md, seqs, _ = _case(spec, 8, 2, 2, tile=8, chunk_pages=2, seed=3)
    L, NB, BS, K, H = k32.shape
    k_scale, v_scale = jnp.float32(0.01), jnp.float32(0.02)  # |k| / 0.01 reaches ~400
    slots = jnp.arange(NB * BS, dtype=jnp.int32)
    empty = jnp.zeros(k32.shape, jnp.float8_e4m3fn)
    k8, v8 = write_kv(
        empty,
        empty,
        1,
        k32[1].reshape(-1, K, H),
        v32[1].reshape(-1, K, H),
        slots,
        k_scale,
        v_scale,
    )
    got = np.asarray(_attn_scaled(q, k8, v8, md, k_scale, v_scale, backend))
    k_deq = np.asarray(k8).astype(np.float32) * 0.01
    v_deq = np.asarray(v8).astype(np.float32) * 0.02
    dense = _numpy_dense(np.asarray(q), k_deq, v_deq, seqs, 8, HEAD_DIM**-0.5)
    np.testing.assert_allclose(got, dense, atol=2e-5, rtol=1e-5)
    ref32 = np.asarray(_attn_scaled(q, k32, v32, md, None, None, "reference"))
    total = sum(n for _, n in spec)
    err = got[:total] - ref32[:total]
    # Relative to the output, no larger than e4m3's per-element rounding (2**-4); measured
    # 0.036 here (largest single error 0.14 on outputs of size ~1).
    rel = np.linalg.norm(err) / np.linalg.norm(ref32[:total])
    assert rel < FP8_REL, rel
    assert not got[total:].any()
