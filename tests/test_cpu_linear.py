"""The native CPU matmul (`ops.cpu_linear`, csrc/linear_cpu.cc) against NumPy in float64; the
weight kinds of `ops.linear.linear`; and the model's use of pre-packed weights (whose logits
tests/test_model.py checks against Hugging Face) and `linear_backend`'s resolution."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.engine_args import EngineArgs
from pagedjax.executor.input_batch import BatchBuilder, SeqInput
from pagedjax.models import llama, loader
from pagedjax.ops import cpu_kernels, cpu_linear, linear
from pagedjax.ops.attention import AttentionMetadata
from pagedjax.ops.kv_cache import init_kv_cache, kv_cache_shape
from pagedjax.ops.quant import LINEAR_WEIGHTS, quantize_params


@pytest.mark.parametrize(
    "M, K, N",
    [
        (1, 24, 40),  # one row; N not a multiple of the 16-column micro-panel
        (5, 1100, 17),  # one row block (AVX-512, AVX2): K in 512, 512 and 76; a partial panel
        (13, 576, 192),  # two full 6-row blocks and a 1-row tail; narrow work items
        (64, 600, 1536),  # a decode step's MLP shape; two equal K slices accumulate
        (7, 64, 1000),  # many work items, the last one partial
        (30, 520, 48),  # AVX-512's 12-row blocks and a 6-row tail; an odd panel count
        (97, 256, 96),  # rows past one 96-row pass (MC) of the AVX-512 and AVX2 paths
        (150, 300, 80),  # past the decode plan's 128 rows: items of MC rows (prefill plan)
    ],
)
@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
def test_matmul_matches_numpy(M, K, N, isa):
    """Every ISA path this CPU runs (forced), against float64 NumPy."""
    rng = np.random.default_rng(M * K + N)
    L = 3
    w = rng.standard_normal((L, K, N)).astype(np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    weight = cpu_linear.pack(jnp.asarray(w))
    f = jax.jit(functools.partial(cpu_linear.matmul, isa=isa))
    for i in range(L):
        got = np.asarray(f(x, weight, i))
        want = x.astype(np.float64) @ w[i].astype(np.float64)
        assert got.shape == (M, N) and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.sqrt(K))


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
def test_matmul_row_is_independent_of_the_other_rows(isa):
    """Batch invariance of the kernel: each row's result is bit-identical whether it is
    multiplied alone, among 7, 40 or 129 other rows (every micro-kernel reduces over k in
    the same order, under the decode plan (up to 128 rows) and the prefill plan alike)."""
    rng = np.random.default_rng(7)
    w = cpu_linear.pack(jnp.asarray(rng.standard_normal((1, 700, 80)).astype(np.float32)))
    x = rng.standard_normal((200, 700)).astype(np.float32)
    f = jax.jit(functools.partial(cpu_linear.matmul, isa=isa))
    whole = np.asarray(f(x, w, 0))
    for rows in ([5], [3, 4, 5, 6, 7, 8, 9, 10], list(range(41))[::-1], list(range(60, 190))):
        got = np.asarray(f(x[rows], w, 0))
        for i, r in enumerate(rows):
            assert np.array_equal(got[i], whole[r]), (rows, r)


@pytest.mark.parametrize("isa", cpu_kernels.runnable_isas())
def test_grouped_matmul_matches_numpy_and_reads_each_row_as_matmul_does(isa):
    """The experts' grouped matmul (every ISA path, forced): each tile times its expert's
    weight against float64 NumPy, over runs of one expert's tiles (one tile, several, a
    decode-sized run and one past a 96-row pass), an expert used twice apart, tiles of an
    expert held elsewhere (E: zeros), in two layers; and each row bit-identical to `matmul`
    of that row alone on its expert (the same reduction order whatever the grouping)."""
    rng = np.random.default_rng(11)
    L, E, K, N, m = 2, 5, 300, 40, 4
    w = rng.standard_normal((L, E, K, N)).astype(np.float32)
    p = cpu_linear.pack(jnp.asarray(w.reshape(L * E, K, N)))
    stack = cpu_linear.PackedWeight(p.panels.reshape(L, E, *p.panels.shape[1:]), N)
    expert = np.array([0, 2, 2, 3, *[4] * 30, 1, 5, 5, 0], np.int32)
    x = rng.standard_normal((len(expert), m, K)).astype(np.float32)
    f = jax.jit(functools.partial(cpu_linear.grouped_matmul, isa=isa))
    alone = jax.jit(functools.partial(cpu_linear.matmul, isa=isa))
    for layer in range(L):
        got = np.asarray(f(x, stack, layer, jnp.asarray(expert)))
        assert got.shape == (len(expert), m, N) and got.dtype == np.float32
        for t, e in enumerate(expert):
            if e == E:
                assert not got[t].any()
                continue
            want = x[t].astype(np.float64) @ w[layer, e].astype(np.float64)
            np.testing.assert_allclose(got[t], want, rtol=1e-5, atol=1e-5 * np.sqrt(K))
        layer_stack = cpu_linear.PackedWeight(stack.panels[layer], N)  # [E, ...] as L = E
        for t in (0, 5, len(expert) - 1):
            one = np.asarray(alone(x[t, 2:3], layer_stack, int(expert[t])))
            assert np.array_equal(one[0], got[t, 2])


def test_grouped_matmul_rejects_bad_input():
    stack = cpu_linear.pack(jnp.zeros((4, 8, 16), jnp.float32))
    x = jnp.zeros((3, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"\[L, E, K, N\]"):
        cpu_linear.grouped_matmul(x, stack, 0, jnp.zeros((3,), jnp.int32))  # not a 4-D stack
    stack4 = cpu_linear.PackedWeight(stack.panels.reshape(2, 2, *stack.panels.shape[1:]), 16)
    with pytest.raises(ValueError, match="disagree"):
        cpu_linear.grouped_matmul(x, stack4, 0, jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="disagree"):
        cpu_linear.grouped_matmul(x[..., :4], stack4, 0, jnp.zeros((3,), jnp.int32))


def test_isa_setting_resolution():
    """ "auto" is the widest path the CPU runs; a wider one or an unknown name is refused."""
    assert cpu_kernels.resolve_isa("auto") == cpu_kernels.runnable_isas()[0]
    assert cpu_kernels.resolve_isa("portable") == "portable"
    with pytest.raises(ValueError, match="cpu_kernel_isa must be one of"):
        cpu_kernels.resolve_isa("sse9")
    missing = [i for i in cpu_kernels.ISAS if i not in cpu_kernels.runnable_isas()]
    for isa in missing:
        with pytest.raises(ValueError, match="needs the CPU flags"):
            cpu_kernels.resolve_isa(isa)


@pytest.mark.parametrize("num_rows", [0, 1, 7, 13, 20])
def test_matmul_multiplies_only_num_rows(num_rows):
    """A traced row count: rows below it match NumPy, rows past it (padding) are zero."""
    rng = np.random.default_rng(num_rows)
    w = rng.standard_normal((2, 300, 40)).astype(np.float32)
    x = rng.standard_normal((13, 300)).astype(np.float32)
    got = np.asarray(jax.jit(cpu_linear.matmul)(x, cpu_linear.pack(jnp.asarray(w)), 1, num_rows))
    n = min(num_rows, 13)
    want = x[:n].astype(np.float64) @ w[1].astype(np.float64)
    np.testing.assert_allclose(got[:n], want, rtol=1e-5, atol=1e-5 * np.sqrt(300))
    assert not got[n:].any()


def test_pack_layout_and_unpack():
    """panels[l, p, k, c] = W[l, k, 16 p + c], zeros past N; unpack inverts the stack and
    one layer's slice."""
    w = np.arange(2 * 3 * 20, dtype=np.float32).reshape(2, 3, 20)
    packed = cpu_linear.pack(jnp.asarray(w))
    assert packed.panels.shape == (2, 2, 3, 16) and packed.shape == (2, 3, 20)
    panels = np.asarray(packed.panels)
    assert panels[1, 1, 2, 3] == w[1, 2, 19] and panels[0, 0, 1, 5] == w[0, 1, 5]
    assert not panels[:, 1, :, 4:].any()
    layer = jax.tree.map(lambda a: a[1], packed)
    np.testing.assert_array_equal(np.asarray(cpu_linear.unpack(layer)), w[1])
    np.testing.assert_array_equal(np.asarray(cpu_linear.unpack(packed)), w)
    with pytest.raises(ValueError, match="float32 \\[L, K, N\\]"):
        cpu_linear.pack(jnp.ones((3, 4), jnp.float32))


def test_matmul_layer_index_inside_scan():
    """A traced layer index (the model's scan counter) selects each layer in place."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 32, 48)).astype(np.float32)
    x = rng.standard_normal((6, 32)).astype(np.float32)
    packed = cpu_linear.pack(jnp.asarray(w))

    def body(carry, i):
        return carry, cpu_linear.matmul(x, packed, i)

    _, ys = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(4)))()
    np.testing.assert_allclose(np.asarray(ys), np.einsum("mk,lkn->lmn", x, w), rtol=1e-5, atol=1e-4)


def test_matmul_rejects_bad_input():
    x = jnp.ones((2, 8), jnp.float32)
    with pytest.raises(ValueError, match="takes a PackedWeight"):
        cpu_linear.matmul(x, jnp.ones((1, 8, 4), jnp.float32))  # not packed
    with pytest.raises(ValueError, match="float32 \\[L, K, N\\] weight, not bfloat16"):
        cpu_linear.pack(jnp.ones((1, 8, 4), jnp.bfloat16))
    with pytest.raises(ValueError, match="disagree on K"):
        cpu_linear.matmul(x, cpu_linear.pack(jnp.ones((1, 9, 4), jnp.float32)))
    assert not cpu_linear.supports(jnp.ones((2, 2), jnp.bfloat16))


def _step(params, cfg, backend, num_tokens, lower=True):
    """One forward step over a prompt of `num_tokens` tokens: its HLO text (`lower`), or
    its hidden states [T, D] as NumPy."""
    builder = BatchBuilder(
        max_num_batched_tokens=256,
        max_num_seqs=4,
        max_model_len=256,
        block_size=16,
        query_tile_size=8,
        kv_chunk_pages=2,
    )
    blocks = np.arange(1, 17, dtype=np.int32)
    layout, buf = builder.build([SeqInput(np.zeros(num_tokens, np.int32), 0, blocks)])
    a = {k: jnp.asarray(v) for k, v in layout.unpack(buf.copy()).items()}
    md = AttentionMetadata.from_arrays(a, query_tile_size=8, kv_chunk_pages=2)
    shape = kv_cache_shape(cfg.num_hidden_layers, 17, 16, cfg.num_key_value_heads, cfg.head_dim)
    fwd = jax.jit(
        lambda p, kv, a, md: llama.forward(
            p, kv, a["input_ids"], a["positions"], md, cfg=cfg, attention_backend=backend
        )
    )
    args = (params, init_kv_cache(shape, jnp.float32), a, md)
    return fwd.lower(*args).as_text() if lower else np.asarray(fwd(*args)[0])


def _lowered_step(params, cfg, backend, num_tokens):
    return _step(params, cfg, backend, num_tokens)


def test_model_uses_the_native_matmul_only_where_it_should(tiny_llama_dir):
    """Pre-packed linear layers run through the native matmul in steps of every size,
    whatever the attention backend (so the "cpu-prepacked" model-vs-HF tests cover it);
    packed with max_rows = MAX_TOKENS (`batch_invariant=False`), a larger step keeps XLA's
    dot; plain (not packed) or quantized weights keep XLA's dot."""
    source = loader.resolve_model_source(str(tiny_llama_dir))
    cfg = loader.load_arch_config(source)
    params = loader.load_params(source, cfg, "float32")
    packed = cpu_linear.pack_params(params)
    assert _lowered_step(packed, cfg, "cpu", 8).count(cpu_linear.TARGET) == 7
    assert _lowered_step(packed, cfg, "xla", 8).count(cpu_linear.TARGET) == 7
    big = cpu_linear.MAX_TOKENS + 1
    assert _lowered_step(packed, cfg, "cpu", big).count(cpu_linear.TARGET) == 7
    variant = cpu_linear.pack_params(params, cpu_linear.MAX_TOKENS)
    assert _lowered_step(variant, cfg, "cpu", 8).count(cpu_linear.TARGET) == 7
    assert cpu_linear.TARGET not in _lowered_step(variant, cfg, "cpu", big)
    assert cpu_linear.TARGET not in _lowered_step(params, cfg, "cpu", 8)
    int8 = quantize_params(params, "int8")
    assert cpu_linear.TARGET not in _lowered_step(int8, cfg, "cpu", 8)


def test_model_with_prepacked_weights(tiny_llama_dir, tmp_path):
    """The engine's pre-packed float32 weights (`pack_params`) give the hidden states of the
    plain weights under XLA's dot, through the native matmul (a small and a large step) and
    through XLA's dot on unpacked layers (a step over max_rows), and are saved as plain weights;
    quantized weights are left as they are."""
    source = loader.resolve_model_source(str(tiny_llama_dir))
    cfg = loader.load_arch_config(source)
    params = loader.load_params(source, cfg, "float32")
    packed = cpu_linear.pack_params(params)
    assert all(isinstance(packed["layers"][n], cpu_linear.PackedWeight) for n in LINEAR_WEIGHTS)
    variant = cpu_linear.pack_params(params, cpu_linear.MAX_TOKENS)
    for T in (8, cpu_linear.MAX_TOKENS + 1):
        want = _step(params, cfg, "cpu", T, lower=False)
        for p in (packed, variant):
            got = _step(p, cfg, "cpu", T, lower=False)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    loader.save_converted(tmp_path / "saved", cfg, packed, None)  # an engine's params
    back = loader.load_params(loader.resolve_model_source(str(tmp_path / "saved")), cfg)
    for name in LINEAR_WEIGHTS:
        np.testing.assert_array_equal(
            np.asarray(back["layers"][name]), np.asarray(params["layers"][name])
        )
    hidden = jnp.asarray(np.random.default_rng(0).standard_normal((6, cfg.hidden_size)), "float32")
    want = np.asarray(hidden @ params["lm_head"])
    got = np.asarray(llama.compute_logits(packed, hidden, 4))
    np.testing.assert_allclose(got[:4], want[:4], rtol=1e-5, atol=1e-5)
    assert not got[4:].any()
    # Tied embeddings: the packed head is the transposed embedding, dropped again on saving.
    tied = cpu_linear.pack_params({k: v for k, v in params.items() if k != "lm_head"})
    want = np.asarray(hidden @ params["embed_tokens"].T)
    np.testing.assert_allclose(
        np.asarray(llama.compute_logits(tied, hidden)), want, rtol=1e-5, atol=1e-5
    )
    assert "lm_head" not in cpu_linear.unpack_params(tied, tie_word_embeddings=True)
    int8 = cpu_linear.pack_params(quantize_params(params, "int8"))
    assert not any(isinstance(int8["layers"][n], cpu_linear.PackedWeight) for n in LINEAR_WEIGHTS)


@pytest.fixture
def thread_cap():
    """Sets the kernels' thread cap for one test; lifted afterwards whatever happens."""
    yield cpu_kernels.set_thread_limit
    cpu_kernels.set_thread_limit(0)


def test_thread_limit_reaches_the_libraries_and_keeps_the_bits(thread_cap, tiny_llama_dir):
    """`set_thread_limit` reaches every loaded ISA path's library, and capping the kernels at
    one thread changes no bit: the matmul of every path at decode and prefill sizes (its work
    items are planned for the thread count) and a whole model step (attention splits a few
    sequences' items by KV head when there are fewer than two per thread) give what the
    uncapped pool gives."""
    rng = np.random.default_rng(3)
    w = cpu_linear.pack(jnp.asarray(rng.standard_normal((1, 576, 1536)).astype(np.float32)))
    xs = [rng.standard_normal((m, 576)).astype(np.float32) for m in (1, 8, 300)]
    isas = cpu_kernels.runnable_isas()
    fs = [jax.jit(functools.partial(cpu_linear.matmul, isa=isa)) for isa in isas]
    assert all(cpu_kernels.available(isa) for isa in isas)
    thread_cap(0)
    assert cpu_kernels.library_thread_limits() == dict.fromkeys(isas, 0)
    whole = [[np.asarray(f(x, w, 0)) for x in xs] for f in fs]
    thread_cap(1)
    assert cpu_kernels.thread_limit() == 1
    assert cpu_kernels.library_thread_limits() == dict.fromkeys(isas, 1)
    for f, wants in zip(fs, whole, strict=True):
        for x, want in zip(xs, wants, strict=True):
            np.testing.assert_array_equal(np.asarray(f(x, w, 0)), want)
    source = loader.resolve_model_source(str(tiny_llama_dir))
    cfg = loader.load_arch_config(source)
    packed = cpu_linear.pack_params(loader.load_params(source, cfg, "float32"))
    for T in (1, 8, 40):
        thread_cap(0)
        want = _step(packed, cfg, "cpu", T, lower=False)
        thread_cap(1)
        np.testing.assert_array_equal(_step(packed, cfg, "cpu", T, lower=False), want)
    thread_cap(0)
    assert cpu_kernels.library_thread_limits() == dict.fromkeys(isas, 0)


def test_linear_gives_the_same_layer_for_every_weight_kind():
    """`linear.linear` on the same [in, out] weights as a plain array, int8 (within its
    rounding bound), a packed stack's layer (`LayerView`: native; with max_rows, native
    below it and unpacked above) and a packed single weight (float32 rounding); a packed stack given
    whole is refused."""
    rng = np.random.default_rng(3)
    L, K, N = 3, 72, 40
    w = rng.standard_normal((L, K, N)).astype(np.float32)
    stack = cpu_linear.pack(jnp.asarray(w))
    capped = stack.replace(max_rows=cpu_linear.MAX_TOKENS)
    int8 = quantize_params({"layers": {n: jnp.asarray(w) for n in LINEAR_WEIGHTS}}, "int8")
    f = jax.jit(lambda x, w, n: linear.linear(x, w, num_rows=n))
    for M in (5, cpu_linear.MAX_TOKENS + 3):
        x = rng.standard_normal((M, K)).astype(np.float32)
        for i in range(L):
            want = x.astype(np.float64) @ w[i].astype(np.float64)
            tol = dict(rtol=1e-5, atol=1e-5 * np.sqrt(K))
            np.testing.assert_allclose(np.asarray(f(x, jnp.asarray(w[i]), M)), want, **tol)
            for s in (stack, capped):
                view = linear.LayerView(s, jnp.int32(i))
                np.testing.assert_allclose(np.asarray(f(x, view, M)), want, **tol)
            one = cpu_linear.pack(jnp.asarray(w[i : i + 1]))
            np.testing.assert_allclose(np.asarray(f(x, one, M)), want, **tol)
            q = jax.tree.map(lambda a, i=i: a[i], int8["layers"]["q_proj"])
            # Each weight moves by at most half its column's step s: |x| . s / 2 per output.
            bound = np.abs(x) @ np.broadcast_to(np.asarray(q.scales) / 2, (K, N))
            assert np.all(np.abs(np.asarray(f(x, q, M)) - want) <= bound + 1e-4)
    x = rng.standard_normal((6, K)).astype(np.float32)
    got = np.asarray(f(x, linear.LayerView(stack, jnp.int32(1)), 4))
    np.testing.assert_allclose(got[:4], x[:4] @ w[1], rtol=1e-5, atol=1e-4)
    assert not got[4:].any()  # the native kernel multiplies only num_rows rows
    with pytest.raises(ValueError, match="needs a LayerView"):
        linear.linear(jnp.asarray(x), stack)


def test_linear_backend_resolution(tiny_llama_dir):
    """ "auto" packs on one CPU device where the kernels build; explicit "cpu" off one device
    is a ValueError naming linear_backend; an unknown value too."""
    from pagedjax.ops import cpu_kernels

    config = EngineArgs(model=str(tiny_llama_dir)).create_engine_config()
    want = "cpu" if cpu_kernels.available() else "xla"
    assert config.model_config.linear_backend == want
    config = EngineArgs(model=str(tiny_llama_dir), linear_backend="xla").create_engine_config()
    assert config.model_config.linear_backend == "xla"
    args = EngineArgs(model=str(tiny_llama_dir), linear_backend="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="linear_backend 'cpu' runs on one CPU device"):
        args.create_engine_config()
    with pytest.raises(ValueError, match="linear_backend"):
        EngineArgs(model=str(tiny_llama_dir), linear_backend="gguf").create_engine_config()


def test_cpu_kernel_isa_setting(tiny_llama_dir):
    """`cpu_kernel_isa` "auto" resolves to the widest path the CPU runs; a forced narrower
    path is kept and becomes the process's path; an unknown one is a ValueError naming the
    field."""
    from pagedjax.ops import cpu_kernels

    try:
        config = EngineArgs(model=str(tiny_llama_dir)).create_engine_config()
        assert config.model_config.cpu_kernel_isa == cpu_kernels.runnable_isas()[0]
        args = EngineArgs(model=str(tiny_llama_dir), cpu_kernel_isa="portable")
        assert args.create_engine_config().model_config.cpu_kernel_isa == "portable"
        assert cpu_kernels.default_isa() == "portable"
        with pytest.raises(ValueError, match="cpu_kernel_isa"):
            EngineArgs(model=str(tiny_llama_dir), cpu_kernel_isa="sse9").create_engine_config()
    finally:
        cpu_kernels.set_default_isa("auto")
