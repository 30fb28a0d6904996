"""The native CPU kernel over int8 and AWQ / GPTQ int4 weights (`ops.cpu_quant`,
`csrc/quant_linear_cpu.cc`): against the float64 product of the dequantized weight on every
ISA path this machine runs, a layer of a stack read in place with rows past `num_rows` zero,
rows independent of the step's size, the `ops.linear` dispatch (larger steps on XLA), and
tiny engines under `linear_backend="cpu"` against `"xla"`.

Reference: W dequantized in float64 from the stored integers by NumPy (int8: q * s; int4:
(q - z[group]) * s[group], rows unpacked from the nibbles, GPTQ act-order applied as
x[:, perm] @ W_sorted), y_ref = x @ W in float64. The error bound:
|y - y_ref| <= TOL * (|x| @ |W|) elementwise, float32 rounding of the dequantized weight and
of a sum of at most K = 256 products (a sum's rounding error is at most K * 2**-24 of the
sum of the magnitudes; the measured maximum, printed, is about 3e-7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_quant_checkpoints import _write_int4

from pagedjax import SamplingParams
from pagedjax.ops import cpu_kernels, cpu_quant, linear, quant

TOL = 2e-6
ROWS = (1, 7, 64, 129)
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="no native CPU kernels")
# N = 141: two full 64-column panels and a tail on AVX-512 (16 / 8 columns on the others).
N = 141


def int8_weight(L: int, K: int, n: int, seed: int = 0) -> quant.QuantizedWeight:
    w = np.random.default_rng(seed).normal(size=(L, K, n)).astype(np.float32)
    return quant.quantize_int8(jnp.asarray(w))


def int4_weight(L, K, n, group, method="awq", act_order=False, seed=0) -> quant.QuantizedWeight:
    """Random nibbles (every bit pattern), zeros in 0 .. 16, scales in [0.001, 0.05]."""
    rng = np.random.default_rng(seed)
    G = K // group
    qweight = rng.integers(0, 2**32, size=(L, K // 8, n), dtype=np.uint32).view(np.int32)
    zeros = rng.integers(0, 17, size=(L, G, n)).astype(np.int8)
    scales = rng.uniform(0.001, 0.05, size=(L, G, n)).astype(np.float32)
    perm = np.stack([rng.permutation(K) for _ in range(L)]).astype(np.int32) if act_order else None
    return quant.QuantizedWeight(
        jnp.asarray(qweight),
        jnp.asarray(scales),
        zeros=jnp.asarray(zeros),
        perm=None if perm is None else jnp.asarray(perm),
        method=method,
        in_features=K,
    )


def reference(x: np.ndarray, w: quant.QuantizedWeight, layer: int):
    """(x @ W[layer] in float64, |x| @ |W[layer]|), W dequantized by NumPy."""
    x = x.astype(np.float64)
    if w.method == "int8":
        wd = np.asarray(w.qweight[layer], np.float64) * np.asarray(w.scales[layer], np.float64)
    else:
        packed = np.asarray(w.qweight[layer]).view(np.uint32)  # [K / 8, N]
        K = w.in_features
        q = np.stack([(packed[k // 8] >> (4 * (k % 8))) & 15 for k in range(K)]).astype(np.int64)
        g = np.arange(K) // w.group_size
        z = np.asarray(w.zeros[layer], np.int64)[g]
        wd = (q - z).astype(np.float64) * np.asarray(w.scales[layer], np.float64)[g]
        if w.perm is not None:
            x = x[:, np.asarray(w.perm[layer])]
    return x @ wd, np.abs(x) @ np.abs(wd)


def rel_err(got, ref, scale) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref) / np.maximum(scale, 1e-30)))


WEIGHTS = {
    "int8 K=203": lambda: int8_weight(3, 203, N),
    "awq K=96 g32": lambda: int4_weight(3, 96, N, 32, "awq"),
    "gptq K=200 g40": lambda: int4_weight(3, 200, N, 40, "gptq"),
    "gptq act-order K=256 g64": lambda: int4_weight(3, 256, N, 64, "gptq", act_order=True),
}


@needs_kernels
@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
@pytest.mark.parametrize("case", list(WEIGHTS))
def test_native_matches_the_dequantized_product(case, isa):
    """Each ISA build this CPU runs, forced: rows 1 (direct), 7, 64, 129 (buffered), layer 2
    of a stack of 3, N = 141 (full panels and a tail)."""
    w = WEIGHTS[case]()
    rng = np.random.default_rng(1)
    for m in ROWS:
        x = rng.normal(size=(m, w.in_features)).astype(np.float32)
        ref, scale = reference(x, w, 2)
        y = cpu_quant.matmul(jnp.asarray(x), w, 2, isa=isa)
        assert y.shape == (m, N) and y.dtype == jnp.float32
        err = rel_err(y, ref, scale)
        print(f"native {isa} {case} M={m}: relative error {err:.2e}")
        assert err < TOL, (isa, case, m, err)


@needs_kernels
@pytest.mark.parametrize("case", list(WEIGHTS))
def test_a_layer_of_a_stack_and_only_the_real_rows(case):
    """Traced layer and row count: layer 1, 5 of 9 rows; rows 5 .. 8 are exact zeros (their x
    is large, so a row multiplied by mistake would show)."""
    w = WEIGHTS[case]()
    x = np.random.default_rng(2).normal(size=(9, w.in_features)).astype(np.float32)
    x[5:] = 1e3
    y = jax.jit(lambda x, w, i, r: cpu_quant.matmul(x, w, i, r))(jnp.asarray(x), w, 1, 5)
    ref, scale = reference(x[:5], w, 1)
    assert rel_err(y[:5], ref, scale) < TOL
    np.testing.assert_array_equal(np.asarray(y[5:]), 0.0)


@needs_kernels
@pytest.mark.parametrize("case", list(WEIGHTS))
def test_a_row_does_not_depend_on_the_step_size(case):
    """Every output is one chain of fused multiply-adds over k, whether the weights are
    dequantized in registers (1 to 4 rows) or into the buffer (more): row 0 alone and in
    steps of 3, 7 and 128 rows is bit-identical."""
    w = WEIGHTS[case]()
    x = jnp.asarray(np.random.default_rng(3).normal(size=(128, w.in_features)), jnp.float32)
    alone = np.asarray(cpu_quant.matmul(x[:1], w, 0))
    for m in (3, 7, 128):
        np.testing.assert_array_equal(np.asarray(cpu_quant.matmul(x[:m], w, 0))[:1], alone)


@needs_kernels
def test_linear_dispatches_native_stacks_and_larger_steps_to_xla():
    """`use_native` marks int8 / int4 linear stacks only; `split_layers` keeps them out of
    the scan's slices; `linear` on a `LayerView` gives the native product up to 128 rows and
    XLA's `quantized_matmul` beyond, both within TOL of the reference."""
    w8 = int8_weight(2, 64, 48)
    layers = {
        "q_proj": w8,
        "o_proj": int4_weight(2, 64, 48, 32, "gptq"),
        "k_proj": quant.quantize_int8(jnp.ones((2, 64, 48)), "w8a8"),
        "v_proj": quant.quantize_fp8(jnp.ones((2, 64, 48))),
        "experts_up": quant.quantize_int8(jnp.ones((2, 4, 64, 48))),
    }
    marked = cpu_quant.use_native({"layers": layers})["layers"]
    assert {k for k, v in marked.items() if v.native} == {"q_proj", "o_proj"}
    sliced, in_place = linear.split_layers(marked)
    assert set(in_place) == {"q_proj", "o_proj"} and "k_proj" in sliced
    rng = np.random.default_rng(4)
    for name in ("q_proj", "o_proj"):
        for m in (128, 129):
            x = rng.normal(size=(m, 64)).astype(np.float32)
            y = linear.linear(jnp.asarray(x), linear.LayerView(marked[name], jnp.int32(1)))
            ref, scale = reference(x, layers[name], 1)
            assert rel_err(y, ref, scale) < TOL, (name, m)
    x = jnp.asarray(rng.normal(size=(129, 64)), jnp.float32)
    want = quant.quantized_matmul(x, jax.tree.map(lambda a: a[1], w8))
    got = linear.linear(x, linear.LayerView(marked["q_proj"], jnp.int32(1)))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # the XLA path itself


@needs_kernels
def test_model_step_reads_native_stacks_in_place(tiny_llama_dir):
    """The tiny model's forward step on int8 params marked native: its seven linear layers
    are custom calls of the kernel in a step of 8 tokens (none at 129: XLA), and its hidden
    states equal the unmarked params' (XLA) within float32 rounding."""
    from test_cpu_linear import _step

    from pagedjax.models import loader

    source = loader.resolve_model_source(str(tiny_llama_dir))
    cfg = loader.load_arch_config(source)
    plain = quant.quantize_params(loader.load_params(source, cfg, "float32"), "int8")
    marked = cpu_quant.use_native(plain)
    target = cpu_kernels.target(cpu_quant.TARGETS["int8"])
    assert _step(marked, cfg, "cpu", 8).count(target) == 7
    assert target not in _step(marked, cfg, "cpu", 129)
    assert target not in _step(plain, cfg, "cpu", 8)
    for T in (8, 129):
        want = _step(plain, cfg, "cpu", T, lower=False)
        np.testing.assert_allclose(_step(marked, cfg, "cpu", T, lower=False), want, atol=1e-5)


def test_matmul_refuses_what_it_does_not_take():
    with pytest.raises(ValueError, match="K=64"):
        cpu_quant.matmul(jnp.ones((2, 32)), int8_weight(1, 64, 16))
    with pytest.raises(ValueError, match="int8 / awq / gptq"):
        cpu_quant.matmul(jnp.ones((2, 64)), quant.quantize_int8(jnp.ones((1, 64, 16)), "w8a8"))
    with pytest.raises(ValueError, match="multiple of 8"):
        cpu_quant.matmul(jnp.ones((2, 60)), int4_weight(1, 60, 16, 12))
    assert not cpu_quant.supports(int4_weight(1, 60, 16, 12))


# ----------------------------------------------------------------------------- engines

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)


def _engine_pair(make_llm, model, **kw):
    """Greedy outputs of the cpu and xla linear backends on 8 prompts; one step of up to 256
    tokens, so prefill steps of more than 128 take the XLA fallback on the cpu engine."""
    outs = {}
    for backend in ("cpu", "xla"):
        llm = make_llm(model, linear_backend=backend, max_num_batched_tokens=256, **kw)
        layers = llm.llm_engine.runner.params["layers"]
        native = {k for k, v in layers.items() if isinstance(v, quant.QuantizedWeight) and v.native}
        assert native == (set(quant.LINEAR_WEIGHTS) if backend == "cpu" else set()), native
        outs[backend] = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return outs["cpu"], outs["xla"]


_rng = np.random.default_rng(1234)
PROMPTS = [
    {"prompt_token_ids": _rng.integers(3, 259, size=n).tolist()} for n in (1, 5, 17, 47, 90, 100)
]


def _assert_same(cpu, xla):
    worst = 0.0
    for a, b in zip(cpu, xla, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        out_a, out_b = a.outputs[0], b.outputs[0]
        for la, lb, t in zip(out_a.logprobs, out_b.logprobs, out_a.token_ids, strict=True):
            worst = max(worst, abs(la[t].logprob - lb[t].logprob))
    print(f"largest logprob difference cpu - xla: {worst:.2e}")
    assert worst < 1e-4


@needs_kernels
def test_int8_engine_cpu_equals_xla(make_llm, tiny_llama_dir):
    _assert_same(*_engine_pair(make_llm, tiny_llama_dir, quantization="int8"))


@needs_kernels
@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", True)])
def test_int4_engine_cpu_equals_xla(make_llm, tmp_path, tiny_llama_dir, method, act_order):
    folder = _write_int4(tiny_llama_dir, tmp_path / method, method, 32, act_order=act_order)
    _assert_same(*_engine_pair(make_llm, folder))
