"""int8 activations for GGUF blocks kept quantized (`cpu_gguf.matmul(..., activations="int8")`,
`csrc/gguf_int8_cpu.cc`, the engine's `gguf_activations="int8"`).

Reference: x quantized as the kernel documents (per 32-value block, scale max|x| / 127, round
half away from zero) and dequantized, times gguf's dequantization of the blocks, in float64.
The kernel's integer sums are exact, so the only differences are float32 roundings of the
per-block scaling: within 2e-7 of |x_q| @ |W| (measured about 1e-7). Against the float32
kernel the int8 path differs by the quantization of x itself (about 1e-3 of that scale)."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize
from test_gguf_kernels import PROMPTS, _quantized_gguf, blocks_for
from test_gguf_kernels import TOL as GGUF_TOL
from test_gguf_kernels import reference as gguf_reference
from test_gguf_kernels import rel_err as gguf_rel_err

from pagedjax import SamplingParams
from pagedjax.ops import cpu_gguf, cpu_kernels
from pagedjax.ops import gguf_quant as gq

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels")
TOL = 2e-7


def quantized_x(x: np.ndarray) -> np.ndarray:
    """x as the int8 kernel sees it: each 32-value block quantized to int8 and dequantized."""
    m, k = x.shape
    xb = x.reshape(m, k // 32, 32).astype(np.float32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    scaled = xb * inv[..., None]
    q = np.clip(np.sign(scaled) * np.floor(np.abs(scaled) + 0.5), -127, 127)
    return (q * d[..., None]).reshape(m, k)


def _check(x, blocks, fmt, got) -> float:
    w = dequantize(blocks, gguf.GGMLQuantizationType[fmt]).astype(np.float64)
    xq = quantized_x(x).astype(np.float64)
    ref, scale = xq @ w.T, np.abs(xq) @ np.abs(w).T
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref) / scale))


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
def test_int8_activations_match_the_quantized_product_on_every_path(isa):
    """Every int8 format, K = 544 (17 blocks: an odd block after the pairs the VNNI path
    takes), N = 21, rows 1, 7, 64, 129; a row alone gives the same bits as among the others."""
    rng = np.random.default_rng(21)
    for fmt in cpu_gguf.INT8_FORMATS:
        blocks = blocks_for(fmt, 21, 544, seed=22)
        w = gq.GGUFWeight(jnp.asarray(blocks), fmt, 544)
        x = rng.normal(size=(129, 544)).astype(np.float32)
        x[0, :32] = 0.0  # an all-zero block: scale 0
        alone = np.asarray(cpu_gguf.matmul(jnp.asarray(x[:1]), w, isa=isa, activations="int8"))
        for m in (1, 7, 64, 129):
            got = np.asarray(cpu_gguf.matmul(jnp.asarray(x[:m]), w, isa=isa, activations="int8"))
            err = _check(x[:m], blocks, fmt, got)
            print(f"int8 {isa} {fmt} M={m}: relative error {err:.2e}")
            assert err < TOL, (isa, fmt, m, err)
            np.testing.assert_array_equal(got[:1], alone, err_msg=f"{isa} {fmt} M={m}")
        f32 = np.asarray(cpu_gguf.matmul(jnp.asarray(x[:7]), w, isa=isa))
        assert np.max(np.abs(f32 - got[:7])) / np.max(np.abs(f32)) > 1e-5  # x was quantized


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_large_int8_steps_of_a_native_stack(fmt):
    """Steps of more than `cpu_gguf.MAX_TOKENS` rows on a native stack with int8 activations
    (layer 1 through a `LayerView`, K = 544: an odd number of blocks, N = 37: a short panel):
    where the VNNI path runs, the int8 kernel (its panel path) takes them, within TOL of the
    quantized product, each row the same bits as alone; elsewhere the float32 route."""
    from pagedjax.ops.linear import LayerView, linear

    rng = np.random.default_rng(31)
    stack = np.stack([blocks_for(fmt, 37, 544, seed=s) for s in (32, 33)])
    w = gq.GGUFWeight(jnp.asarray(stack), fmt, 544, native=True, activations="int8")
    step = jax.jit(lambda x, w: linear(x, LayerView(w, jnp.int32(1))))
    x = rng.normal(size=(300, 544)).astype(np.float32)
    alone = np.asarray(step(jnp.asarray(x[:1]), w))
    every_size = cpu_gguf.int8_every_size(w)
    for m in (cpu_gguf.MAX_TOKENS + 1, 300):
        got = np.asarray(step(jnp.asarray(x[:m]), w))
        if every_size:
            err = _check(x[:m], stack[1], fmt, got)
            assert err < TOL, (fmt, m, err)
            np.testing.assert_array_equal(got[:1], alone, err_msg=f"{fmt} M={m}")
        else:  # the float32 route: the float64 product with float32 activations
            ref, scale = gguf_reference(x[:m], stack[1], fmt)
            assert gguf_rel_err(got, ref, scale) < GGUF_TOL, (fmt, m)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_gguf_kernels_give_the_same_bits_capped_at_one_thread(fmt):
    """Both GGUF kernels (float32 and int8 activations) at decode and prefill sizes, capped at
    one thread (`cpu_kernels.set_thread_limit`) and not: their
    work items, planned for the thread count, split output rows only, so every bit is kept."""
    rng = np.random.default_rng(41)
    # 512 rows: 2 threads plan items of 32 rows (int8), 1 thread of 64
    w = gq.GGUFWeight(jnp.asarray(blocks_for(fmt, 512, 576, seed=42)), fmt, 576, native=True)
    xs = [jnp.asarray(rng.normal(size=(m, 576)).astype(np.float32)) for m in (1, 8, 64, 300)]
    calls = [
        jax.jit(lambda x, w, a=act: cpu_gguf.matmul(x, w, activations=a))
        for act in ("float32", "int8")
    ]
    try:
        whole = [[np.asarray(f(x, w)) for x in xs] for f in calls]
        cpu_kernels.set_thread_limit(1)
        for f, wants in zip(calls, whole, strict=True):
            for x, want in zip(xs, wants, strict=True):
                np.testing.assert_array_equal(np.asarray(f(x, w)), want)
    finally:
        cpu_kernels.set_thread_limit(0)


def test_k_quants_and_bad_settings():
    """A K-quant weight multiplies float32 activations whatever the setting (the same bits);
    an unknown setting is a ValueError naming it; only the real rows are computed."""
    rng = np.random.default_rng(23)
    blocks = blocks_for("Q4_K", 9, 256, seed=24)
    w = gq.GGUFWeight(jnp.asarray(blocks), "Q4_K", 256)
    x = jnp.asarray(rng.normal(size=(5, 256)).astype(np.float32))
    np.testing.assert_array_equal(
        np.asarray(cpu_gguf.matmul(x, w, activations="int8")), np.asarray(cpu_gguf.matmul(x, w))
    )
    with pytest.raises(ValueError, match="gguf_activations"):
        cpu_gguf.matmul(x, w, activations="int4")
    with pytest.raises(ValueError, match="gguf_activations"):
        cpu_gguf.use_native({"w": w}, "bf16")
    q = gq.GGUFWeight(
        jnp.asarray(np.stack([blocks_for("Q8_0", 9, 256, seed=s) for s in (1, 2)])), "Q8_0", 256
    )
    y = jax.jit(lambda x, w: cpu_gguf.matmul(x, w, 1, 3, activations="int8"))(x, q)
    assert _check(np.asarray(x[:3]), np.asarray(q.blocks[1]), "Q8_0", y[:3]) < TOL
    np.testing.assert_array_equal(np.asarray(y[3:]), 0.0)


def test_engine_with_int8_activations(make_llm, tmp_path):
    """`gguf_activations="int8"`: every GGUF weight of the engine carries the setting, and the
    logprobs stay within 0.05 of the float32-activation engine's on the same blocks while
    differing from them (the setting took effect); "bf16" is refused naming the field."""
    folder, path = _quantized_gguf(tmp_path)
    common = dict(tokenizer=str(folder), download_dir=str(tmp_path / "cache"), dtype="auto")
    sp = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    base = make_llm(path, **common)
    int8 = make_llm(path, gguf_activations="int8", **common)
    assert int8.llm_engine.config.model_config.gguf_activations == "int8"
    leaves = jax.tree.leaves(
        int8.llm_engine.runner.params, is_leaf=lambda w: isinstance(w, gq.GGUFWeight)
    )
    kinds = {w.activations for w in leaves if isinstance(w, gq.GGUFWeight)}
    assert kinds == {"int8"}
    diffs = []
    for a, b in zip(
        base.generate(PROMPTS, sp, use_tqdm=False),
        int8.generate(PROMPTS, sp, use_tqdm=False),
        strict=True,
    ):
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        diffs += [abs(la[t].logprob - lb[t].logprob) for t in la if t in lb]
    assert diffs and max(diffs) < 0.05 and max(diffs) > 0.0, diffs
    with pytest.raises(ValueError, match="gguf_activations"):
        make_llm(path, gguf_activations="bf16", **common)
