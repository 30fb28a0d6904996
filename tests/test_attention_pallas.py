"""The Pallas ragged paged-attention kernel against the jnp reference: a grid of context
lengths, query lengths, GQA ratios and block sizes in one ragged batch per shape (padding
tokens, padding sequence rows and empty sequences included); 16-bit queries; fp8 pages with
scales; sliding windows (static and traced in a scan over layers, KV before them not read)
and logit soft-caps; its lowering to the Triton GPU backend (checked without a GPU); the
engine's greedy output with `attention_backend="pallas"`.

On CPU the kernel runs in Pallas' interpreter (`interpret=True`); on a GPU the same tests run
the compiled kernel."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax import SamplingParams
from pagedjax.executor.input_batch import BatchBuilder, SeqInput
from pagedjax.ops.attention import AttentionMetadata, ragged_paged_attention
from pagedjax.ops.paged_attention_pallas import paged_attention_pallas, unsupported_reason
from pagedjax.ops.paged_attention_ref import paged_attention_reference

LAYER = 1


def _case(spec, block_size, kv_heads, group, head_dim, *, q_dtype="float32", seed=0):
    """A random cache and ragged batch for sequences given as (cached_len, query_len); a
    query_len of 0 is an empty sequence. Returns q, K, V (float32 pages), md, total tokens."""
    rng = np.random.default_rng(seed)
    need = [-(-(c + q) // block_size) for c, q in spec]
    num_blocks = 2 + sum(need)
    perm = rng.permutation(np.arange(1, num_blocks))  # scattered block ids; 0 stays null
    seqs, used = [], 0
    for (cached, q), nb in zip(spec, need, strict=True):
        seqs.append(
            SeqInput(np.zeros(q, np.int32), cached, perm[used : used + nb].astype(np.int32))
        )
        used += nb
    builder = BatchBuilder(
        max_num_batched_tokens=1024,
        max_num_seqs=32,
        max_model_len=1024,
        block_size=block_size,
        sizes=(16,),  # the 16-token minimum: small cases keep padding rows
    )
    layout, buf = builder.build(seqs)
    a = layout.unpack(buf.copy())
    md = AttentionMetadata.from_arrays({f: jnp.asarray(x) for f, x in a.items()})
    shape = (2, num_blocks, block_size, kv_heads, head_dim)
    k = jnp.asarray(rng.standard_normal(shape, np.float32))
    v = jnp.asarray(rng.standard_normal(shape, np.float32))
    T = layout.num_tokens
    q = jnp.asarray(rng.standard_normal((T, kv_heads * group, head_dim), np.float32), q_dtype)
    return q, k, v, md, int(a["query_start_loc"][-1])


@functools.partial(jax.jit, static_argnames=("sm_scale", "window", "cap"))
def _reference(q, k, v, md, k_scale, v_scale, sm_scale, window=None, cap=None):
    return paged_attention_reference(
        q,
        k,
        v,
        LAYER,
        md,
        sm_scale=sm_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        sliding_window=window,
        logit_soft_cap=cap,
    )


def _grid(bs: int) -> list[tuple[int, int]]:
    """(cached_len, query_len): decode at context 1, bs - 1, bs, bs + 1 and long; prefill
    without a cached prefix (query bs - 1, bs, bs + 1) and with one; an empty sequence."""
    return [
        (0, 1),
        (bs - 2, 1),
        (bs - 1, 1),
        (bs, 1),
        (5 * bs + 3, 1),
        (0, bs - 1),
        (0, bs),
        (0, bs + 1),
        (7, 0),  # empty: no query token this step
        (bs, 3),
        (bs + 1, 2 * bs + 3),
        (3 * bs - 1, 40),
    ]


def _check(
    spec,
    bs,
    kv_heads,
    group,
    head_dim=16,
    *,
    atol=2e-5,
    rtol=1e-5,
    window=None,
    cap=None,
    kv_dtype=None,
    **kw,
):
    q, k, v, md, total = _case(spec, bs, kv_heads, group, head_dim, seed=bs * 10 + group)
    scale = head_dim**-0.5
    k_scale = v_scale = None
    if kv_dtype is not None:  # fp8 pages: a cached value means value * scale
        k_scale, v_scale = jnp.float32(0.02), jnp.float32(0.5)
        k, v = (k / k_scale).astype(kv_dtype), (v / v_scale).astype(kv_dtype)
    if cap is not None:
        q = q * 20.0  # scores of about +-20: the cap bends them
    ref = np.asarray(_reference(q, k, v, md, k_scale, v_scale, scale, window, cap))
    assert np.isfinite(ref).all()
    got = np.asarray(
        paged_attention_pallas(
            q,
            k,
            v,
            LAYER,
            md,
            sm_scale=scale,
            k_scale=k_scale,
            v_scale=v_scale,
            sliding_window=window,
            logit_soft_cap=cap,
            **kw,
        )
    )
    assert got.shape == q.shape and got.dtype == q.dtype
    assert total < q.shape[0] and md.seq_lens.shape[0] > len(spec), "needs padding rows"
    np.testing.assert_allclose(got, ref, atol=atol, rtol=rtol)
    assert not got[total:].any(), "padding tokens must come out zero"


@pytest.mark.parametrize(
    "block_size,kv_heads,group", [(16, 2, 1), (32, 1, 3), (16, 2, 4), (32, 1, 8)]
)
def test_pallas_matches_reference(block_size, kv_heads, group):
    """The whole grid in one ragged batch, each GQA ratio once and each block size twice (the
    slow test takes every combination); 32 KV tokens per inner step, so long contexts take
    several steps of the online softmax."""
    _check(_grid(block_size), block_size, kv_heads, group, kv_step_tokens=32)


# Every block size x GQA ratio, with the head dim and the tile sizes (block_m, kv_step_tokens)
# taking turns: 16 cases on a GPU. Interpreted on CPU (~6 s a case on 2 cores) the diagonal
# WIDE[::5]: each block size, GQA ratio, head dim and tile setting once.
WIDE = [
    (bs, kv_heads, group, (64, 128)[i % 2], [(None, None), (64, 128), (16, 256)][i % 3])
    for i, (bs, (kv_heads, group)) in enumerate(
        (bs, kg) for bs in (16, 32, 64, 128) for kg in ((2, 1), (1, 3), (2, 4), (1, 8))
    )
]


@pytest.mark.slow
@pytest.mark.parametrize(
    "block_size,kv_heads,group,head_dim,tiles",
    WIDE if jax.default_backend() == "gpu" else WIDE[::5],
)
def test_pallas_matches_reference_wide(block_size, kv_heads, group, head_dim, tiles):
    spec = _grid(block_size) + [(300, 1), (250, 70), (0, 2 * block_size + 1)]
    _check(
        spec,
        block_size,
        kv_heads,
        group,
        head_dim,
        atol=5e-5,
        block_m=tiles[0],
        kv_step_tokens=tiles[1],
    )


@pytest.mark.parametrize(
    "window,cap,kv_dtype,block_size,kv_heads,group",
    [
        (1, None, None, 16, 2, 1),
        (5, 30.0, None, 32, 1, 3),
        (16, 50.0, "float8_e4m3fn", 16, 2, 4),
        (40, None, None, 8, 1, 8),
        (1000, 30.0, None, 32, 2, 4),
        (None, 50.0, "float8_e5m2", 16, 1, 3),
    ],
)
def test_window_and_cap_match_reference(window, cap, kv_dtype, block_size, kv_heads, group):
    """The grid under sliding windows (one token, shorter than a block, a block, across KV
    steps, longer than every context) and logit soft-caps, float32 and fp8 pages; 32 KV tokens
    per step, so the windows start the walk at later steps."""
    spec = _grid(block_size) + [(150, 1), (120, 40)]
    _check(
        spec,
        block_size,
        kv_heads,
        group,
        window=window,
        cap=cap,
        kv_dtype=kv_dtype,
        kv_step_tokens=32,
    )


def test_traced_window_in_a_scan_over_layers():
    """A per-layer window array scanned over (Gemma 3): layer 0 with a window of 4, layer 1
    with 0 (full attention), each equal to the reference with a static window."""
    q, k, v, md, _ = _case([(0, 9), (20, 1), (13, 6), (40, 1)], 16, 2, 2, 16, seed=11)

    @jax.jit
    def layers(q, k, v, md, windows):
        def step(carry, xs):
            layer, window = xs
            out = ragged_paged_attention(
                q, k, v, layer, md, sm_scale=0.25, backend="pallas", sliding_window=window
            )
            return carry, out

        return jax.lax.scan(step, None, (jnp.arange(2), windows))[1]

    got = np.asarray(layers(q, k, v, md, jnp.array([4, 0], jnp.int32)))
    for layer, window in enumerate([4, None]):
        want = paged_attention_reference(q, k, v, layer, md, sm_scale=0.25, sliding_window=window)
        np.testing.assert_allclose(got[layer], np.asarray(want), atol=2e-5, rtol=1e-5)


def test_window_skips_steps_before_it():
    """KV steps wholly before the window are not read: a decode row and a prefill chunk at
    position 300 (window 16: positions 285 on) give the reference's clean-cache result with
    the pages below position 256 NaN."""
    spec = [(300, 1), (300, 20)]
    q, k, v, md, _ = _case(spec, 16, 2, 2, 16, seed=5)
    ref = np.asarray(_reference(q, k, v, md, None, None, 0.25, 16))
    tables = np.asarray(md.block_tables)[: len(spec), : 256 // 16]
    k = k.at[LAYER, tables.ravel()].set(jnp.nan)
    v = v.at[LAYER, tables.ravel()].set(jnp.nan)
    got = paged_attention_pallas(q, k, v, LAYER, md, sm_scale=0.25, sliding_window=16)
    np.testing.assert_allclose(np.asarray(got), ref, atol=2e-5, rtol=1e-5)
    # A window of 300 reaches back to position 1: the poison is read.
    wide = paged_attention_pallas(q, k, v, LAYER, md, sm_scale=0.25, sliding_window=300)
    assert np.isnan(np.asarray(wide)).any()


@pytest.mark.parametrize("q_dtype,block_size", [("bfloat16", 16), ("float16", 4)])
def test_16_bit_queries_and_pages(q_dtype, block_size):
    """16-bit q and pages against the reference on the same rounded inputs (float32 math):
    the kernel rounds the softmax weights to the 16-bit type before P @ V. The float16 case
    also takes the engine's smallest block size, 4."""
    spec = [(0, 1), (40, 1), (0, 19), (33, 12)]
    q, k, v, md, total = _case(spec, block_size, 2, 3, 64, q_dtype=q_dtype, seed=3)
    k, v = k.astype(q_dtype), v.astype(q_dtype)
    ref = np.asarray(_reference(q, k, v, md, None, None, 0.125).astype(jnp.float32))
    got = jax.jit(
        lambda q, k, v, md: ragged_paged_attention(
            q, k, v, LAYER, md, sm_scale=0.125, backend="pallas"
        )
    )(q, k, v, md)  # through the entry point
    assert got.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), ref, atol=2e-2, rtol=2e-2)
    assert not np.asarray(got[total:].astype(jnp.float32)).any()


@pytest.mark.parametrize(
    "q_dtype,kv_dtype,atol",
    [("float32", "float8_e4m3fn", 2e-5), ("bfloat16", "float8_e5m2", 2e-2)],
)
def test_fp8_pages_with_scales(q_dtype, kv_dtype, atol):
    """A cached fp8 value means value * scale: the kernel equals the reference reading the same
    fp8 pages with the same scalar scales (traced, as a layer's scales would be)."""
    spec = [(0, 1), (50, 1), (0, 21), (17, 9)]
    q, k, v, md, _ = _case(spec, 16, 1, 4, 64, q_dtype=q_dtype, seed=5)
    k_scale, v_scale = jnp.float32(0.02), jnp.float32(0.5)
    k8 = (k / k_scale).astype(kv_dtype)  # |k8| < 448, e4m3fn's largest finite value
    v8 = (v / v_scale).astype(kv_dtype)
    ref = np.asarray(_reference(q, k8, v8, md, k_scale, v_scale, 0.125).astype(jnp.float32))
    assert np.isfinite(ref).all()
    got = paged_attention_pallas(
        q, k8, v8, LAYER, md, sm_scale=0.125, k_scale=k_scale, v_scale=v_scale
    )
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), ref, atol=atol, rtol=atol)
    # The scales matter: without them the result is far off.
    plain = np.asarray(_reference(q, k8, v8, md, None, None, 0.125).astype(jnp.float32))
    assert np.abs(plain - ref).max() > 0.5


@pytest.mark.parametrize(
    "head_dim,block_size,q_dtype,kv_dtype,block_m,window_cap",
    [
        (128, 16, "bfloat16", "bfloat16", None, False),
        (64, 128, "float16", "float16", 64, False),
        (64, 32, "float32", "float32", None, True),
        (128, 16, "bfloat16", "float8_e4m3fn", None, False),
        (128, 64, "bfloat16", "float8_e5m2", 64, True),
    ],
)
def test_kernel_lowers_for_cuda_triton(
    head_dim, block_size, q_dtype, kv_dtype, block_m, window_cap
):
    """Cross-platform lowering (no GPU needed): the kernel becomes one Triton custom call (with
    a traced sliding window and a soft-cap in two cases)."""
    spec = [(0, 1), (40, 1), (0, 19), (33, 12)]
    q, k, v, md, _ = _case(spec, block_size, 2, 4, head_dim, q_dtype=q_dtype)
    k, v = k.astype(kv_dtype), v.astype(kv_dtype)
    extra = dict(sliding_window=jnp.int32(8), logit_soft_cap=30.0) if window_cap else {}

    def f(q, k, v, md):
        return paged_attention_pallas(
            q,
            k,
            v,
            LAYER,
            md,
            sm_scale=0.1,
            k_scale=0.5,
            v_scale=2.0,
            interpret=False,
            block_m=block_m,
            **extra,
        )

    try:
        text = jax.jit(f).trace(q, k, v, md).lower(lowering_platforms=("cuda",)).as_text()
    except Exception as e:  # jaxlib > 0.10.2 compiles Triton at lowering: needs the CUDA plugin
        if "compilation handler" in str(e).lower() or "compile" in str(e).lower():
            pytest.skip(f"this jaxlib compiles Triton while lowering, without a GPU plugin: {e}")
        raise
    targets = re.findall(r"custom_call @([\w$.]+)", text)
    assert [t for t in targets if "triton" in t], targets


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(head_dim=48), "head dim"),
        (dict(q_dtype="int32"), "queries"),
        (dict(block_m=8), "block_m"),
        (dict(block_m=48), "block_m"),
    ],
)
def test_bad_shapes_and_dtypes_are_value_errors(change, match):
    head_dim = change.get("head_dim", 16)
    q, k, v, md, _ = _case([(0, 3)], 16, 1, 4, head_dim, q_dtype=change.get("q_dtype", "float32"))
    with pytest.raises(ValueError, match=match):
        paged_attention_pallas(q, k, v, LAYER, md, sm_scale=0.1, block_m=change.get("block_m"))


def test_unsupported_reason_names_the_constraint():
    assert unsupported_reason(128, 16) is None and unsupported_reason(64, 4) is None
    assert "head dim" in unsupported_reason(80, 16)
    assert "head dim" in unsupported_reason(8, 16)
    assert "block_size" in unsupported_reason(64, 12)


def test_engine_greedy_pallas_equals_reference(make_llm, tiny_llama_dir, prompts8, hf_greedy_cache):
    """Greedy output through `attention_backend="pallas"` (interpreted on CPU) equals the
    reference backend's and Hugging Face's; the 17- and 64-token prompts are prefilled in
    chunks of up to 16 tokens next to decode tokens."""
    prompts = [prompts8[0], prompts8[3], prompts8[6]]  # 1, 17 and 64 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    outs = {}
    for backend in ("pallas", "reference"):
        llm = make_llm(
            tiny_llama_dir,
            attention_backend=backend,
            max_num_batched_tokens=16,  # one token bucket: one compile per engine
            max_num_seqs=4,
            max_model_len=96,
        )
        assert llm.llm_engine.config.model_config.attention_backend == backend
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[backend] = [o.outputs[0].token_ids for o in res]
    assert outs["pallas"] == outs["reference"]
    assert outs["pallas"] == [hf_greedy_cache(p, 4) for p in prompts]
