"""Gemma 2 and Gemma 3 (text) against Hugging Face transformers (torch, float32): tiny random
checkpoints (head_dim != hidden / heads, a query_pre_attn_scalar of its own, random norm
weights, a sliding window of 16 interleaved with global layers, soft caps); prefill logits
through the "reference" and "cpu" attention backends with prompts of ~3 windows, the decoder
split in two stacks as the pipeline runs it, and greedy generation through the engine under
chunked prefill, prefix caching and preemption; reading config.json (both transformers
generations' layouts, absent keys) and what is refused."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import (
    TINY_VOCAB,
    forward_chunks,
    hf_greedy,
    hf_model,
    make_tokenizer,
    randomize_norms,
)

from pagedjax import SamplingParams
from pagedjax.executor.input_batch import BatchBuilder, SeqInput
from pagedjax.models import gemma, loader, registry
from pagedjax.models.hf_format import hf_config_dict
from pagedjax.ops.attention import AttentionMetadata
from pagedjax.ops.kv_cache import init_kv_cache, kv_cache_shape

WINDOW = 16
BLOCK = 8
MAX_TOKENS = 8
_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # != 64 / 4
    query_pre_attn_scalar=24,  # != head_dim
    sliding_window=WINDOW,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=0.1,
)
CASES = {
    # every other layer sliding (transformers' default layer_types), the caps of the release
    "gemma2": dict(
        arch="gemma2",
        num_hidden_layers=4,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    # caps that bite, q/k/v/o biases, an untied head
    "gemma2-tight-caps": dict(
        arch="gemma2",
        num_hidden_layers=4,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=2.0,
        attention_bias=True,
        tie_word_embeddings=False,
    ),
    # transformers' default 5:1 pattern, global / local RoPE bases 1e6 / 1e4, no caps
    "gemma3": dict(arch="gemma3", num_hidden_layers=6),
    # 2:1 pattern, linear RoPE scaling on the global layers, own bases, a final cap, untied
    "gemma3-linear-rope": dict(
        arch="gemma3",
        num_hidden_layers=6,
        sliding_window_pattern=3,
        rope_theta=5e5,
        rope_local_base_freq=2e4,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        final_logit_softcapping=3.0,
        tie_word_embeddings=False,
    ),
}
GENERATION_CASES = ("gemma2", "gemma3")


def make_gemma_checkpoint(folder, arch: str, seed: int = 0, **overrides):
    """A tiny random Gemma 2 / Gemma 3 (text) checkpoint with random norm weights (HF
    initializes Gemma's norms to 0, i.e. a scale of 1) and the byte tokenizer."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    config_cls, model_cls = {
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**_COMMON, **overrides})).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    randomize_norms(folder, seed + 1)
    make_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory):
    """name -> the folder of CASES[name]'s tiny checkpoint, written on first use."""
    dirs = {}

    def get(name):
        if name not in dirs:
            dirs[name] = make_gemma_checkpoint(
                tmp_path_factory.mktemp(name), seed=len(dirs), **CASES[name]
            )
        return dirs[name]

    return get


def _load(folder):
    source = loader.resolve_model_source(str(folder))
    cfg = loader.load_arch_config(source)
    return cfg, loader.load_params(source, cfg, "float32")


def _hf_logits(folder, ids, **config_changes):
    """HF float32 logits of `ids`, optionally with config.json fields changed."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, **config_changes
    ).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def prompt45():
    return np.random.default_rng(0).integers(3, 259, size=45).tolist()  # ~3 windows


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_logits_match_hf(gemma_dirs, prompt45, name):
    folder = gemma_dirs(name)
    cfg, params = _load(folder)
    assert type(cfg) is gemma.GemmaArchConfig
    assert cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size
    assert cfg.tie_word_embeddings == CASES[name].get("tie_word_embeddings", True)
    assert ("lm_head" in params) != cfg.tie_word_embeddings
    ids = prompt45
    ref = _hf_logits(folder, ids)
    for backend in ("reference", "cpu"):
        # the whole prompt at once, then in uneven chunks across the scattered blocks
        for chunks in ([ids], [ids[:13], ids[13:30], *([t] for t in ids[30:33]), ids[33:]]):
            got = forward_chunks(params, cfg, chunks, backend)
            np.testing.assert_allclose(
                got, ref, atol=1e-4, rtol=0, err_msg=f"{name} {backend} {len(chunks)} chunks"
            )
    # what this case exercises changes HF's logits well beyond the tolerance
    changes = {"sliding_window": 4096}
    if cfg.attn_logit_softcap:
        changes["attn_logit_softcapping"] = None
    if cfg.final_logit_softcap:
        changes["final_logit_softcapping"] = None
    for key, value in changes.items():
        other = _hf_logits(folder, ids, **{key: value})
        assert np.abs(other - ref).max() > 1e-3, f"{name}: {key} does not matter here"


def test_split_stack_with_traced_offset_matches_forward(gemma_dirs, prompt45):
    """The pipeline runs `decoder_layers` per stage on the looked-up embedding with a traced
    `layer_offset`: the embedding scale, the per-layer window and RoPE tables follow it."""
    cfg, params = _load(gemma_dirs("gemma3-linear-rope"))
    model = registry.get_model(cfg.architecture)
    ids = prompt45
    builder = BatchBuilder(
        max_num_batched_tokens=64,
        max_num_seqs=2,
        max_model_len=256,
        block_size=BLOCK,
        query_tile_size=8,
        kv_chunk_pages=2,
    )
    layout, buf = builder.build([SeqInput(np.asarray(ids, np.int32), 0, np.arange(1, 8))])
    a = {k: jnp.asarray(v) for k, v in layout.unpack(buf.copy()).items()}
    md = AttentionMetadata.from_arrays(a, query_tile_size=8, kv_chunk_pages=2)

    def kv(num_layers):
        shape = kv_cache_shape(num_layers, 8, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
        return init_kv_cache(shape, jnp.float32)

    whole, _ = model.forward(
        params, kv(6), a["input_ids"], a["positions"], md, cfg=cfg, attention_backend="reference"
    )

    @jax.jit
    def split(params, offsets):
        h = params["embed_tokens"][a["input_ids"]]  # as the pipeline: no scale here
        for (lo, hi), offset in zip(((0, 3), (3, 6)), offsets, strict=True):
            stage = jax.tree.map(lambda w, lo=lo, hi=hi: w[lo:hi], params["layers"])
            h, _ = model.decoder_layers(
                stage,
                kv(3),
                h,
                a["positions"],
                md,
                cfg=cfg,
                attention_backend="reference",
                layer_offset=offset,
            )
        return model.final_norm(params, h, cfg)

    got = split(params, jnp.asarray([0, 3], jnp.int32))
    n = len(ids)
    np.testing.assert_allclose(np.asarray(got)[:n], np.asarray(whole)[:n], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def gemma_prompts():
    """Eight prompts of 1 to 90 tokens (up to ~6 windows); the 47- and 90-token ones start
    with the 33- and 64-token ones, so that prefix caching finds full blocks to share."""
    rng = np.random.default_rng(2468)
    prompts = [rng.integers(3, 259, size=n).tolist() for n in (1, 5, 16, 17, 33, 47, 64, 90)]
    prompts[5][:33] = prompts[4]
    prompts[7][:64] = prompts[6]
    return prompts


@pytest.fixture(scope="module")
def gemma_hf_greedy(gemma_dirs, gemma_prompts):
    cache = {}

    def get(name):
        if name not in cache:
            model = hf_model(gemma_dirs(name))
            cache[name] = [hf_greedy(model, p, MAX_TOKENS) for p in gemma_prompts]
        return cache[name]

    return get


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name", GENERATION_CASES)
def test_greedy_generation_matches_hf(
    make_llm, gemma_dirs, gemma_prompts, gemma_hf_greedy, name, block_size
):
    """All eight prompts at once, prefilled in chunks of at most 32 tokens, with prefix
    caching, in a pool that holds the longest request and little more: the scheduler has to
    preempt, and the outputs still equal HF's token for token."""
    longest = max(map(len, gemma_prompts)) + MAX_TOKENS
    llm = make_llm(
        gemma_dirs(name),
        block_size=block_size,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        num_gpu_blocks_override=math.ceil(longest / block_size) + 1,  # + the null block
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in gemma_prompts], greedy, use_tqdm=False)
    want = gemma_hf_greedy(name)
    for p, out, ref in zip(gemma_prompts, outs, want, strict=True):
        assert out.outputs[0].token_ids == ref, f"{name}: prompt of {len(p)} tokens"
    stats = llm.llm_engine.scheduler.stats()
    assert stats.num_preemptions > 0, "the small pool should force preemptions"
    assert stats.prefix_cache_hits > 0, "shared prompt prefixes should hit the cache"


# ----------------------------------------------------------------------------- config.json


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_configs_read_layer_types_ropes_and_caps(gemma_dirs):
    g2 = registry.arch_config_from_hf(_config(gemma_dirs("gemma2")))
    assert g2.layer_windows() == (WINDOW, 0, WINDOW, 0)
    assert (g2.attn_logit_softcap, g2.final_logit_softcap) == (50.0, 30.0)
    assert g2.query_pre_attn_scalar == 24.0 and g2.hidden_act == "gelu_pytorch_tanh"
    assert g2.rope_local_theta is None and not g2.qk_norm
    g3 = registry.arch_config_from_hf(_config(gemma_dirs("gemma3")))
    assert g3.layer_windows() == (WINDOW,) * 5 + (0,)
    assert (g3.rope_theta, g3.rope_local_theta) == (1e6, 1e4) and g3.qk_norm
    assert g3.attn_logit_softcap is None and g3.final_logit_softcap is None
    g3r = registry.arch_config_from_hf(_config(gemma_dirs("gemma3-linear-rope")))
    assert g3r.layer_windows() == (WINDOW, WINDOW, 0) * 2
    assert (g3r.rope_theta, g3r.rope_local_theta, g3r.rope_local_scaling) == (5e5, 2e4, None)
    assert g3r.rope_scaling_dict == {"rope_type": "linear", "factor": 4.0}
    for d in (_config(gemma_dirs("gemma2")), _config(gemma_dirs("gemma3"))):
        cfg = registry.arch_config_from_hf(d)
        d.pop("architectures")  # then the model_type names the architecture
        assert registry.arch_config_from_hf(d) == cfg


def test_transformers4_config_layout_reads_the_same(gemma_dirs):
    """transformers 4.x's config.json: rope_theta / rope_scaling / rope_local_base_freq, no
    layer_types (the default pattern, sliding_window_pattern), keys at their class default
    left out (tie_word_embeddings, Gemma 2's caps)."""
    new = _config(gemma_dirs("gemma3-linear-rope"))
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(
        rope_theta=5e5,
        rope_local_base_freq=2e4,
        rope_scaling={"factor": 4.0, "rope_type": "linear"},
        sliding_window_pattern=3,
    )
    assert registry.arch_config_from_hf(old) == registry.arch_config_from_hf(new)
    g2 = _config(gemma_dirs("gemma2"))
    for key in ("layer_types", "tie_word_embeddings", "attn_logit_softcapping"):
        g2.pop(key)
    g2.pop("final_logit_softcapping")
    assert registry.arch_config_from_hf(g2) == registry.arch_config_from_hf(
        _config(gemma_dirs("gemma2"))
    )


@pytest.mark.parametrize("name", list(CASES))
def test_hf_config_dict_round_trips(gemma_dirs, name):
    """The config.json a conversion writes (`hf_config_dict`) reads back the same."""
    cfg = registry.arch_config_from_hf(_config(gemma_dirs(name)))
    assert registry.arch_config_from_hf(hf_config_dict(cfg, "float32")) == cfg


def test_refused_configs_are_named(gemma_dirs):
    multimodal = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"}
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*multimodal"):
        registry.arch_config_from_hf(multimodal)
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration"):
        registry.arch_config_from_hf({"model_type": "gemma3"})
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration"):
        registry.get_model("Gemma3ForConditionalGeneration")
    d = _config(gemma_dirs("gemma3"))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        registry.arch_config_from_hf({**d, "use_bidirectional_attention": True})


def test_param_logical_axes_cover_every_param(gemma_dirs):
    for name in ("gemma2-tight-caps", "gemma3"):
        cfg = registry.arch_config_from_hf(_config(gemma_dirs(name)))
        model = registry.get_model(cfg.architecture)
        shapes, axes = model.param_shapes(cfg), model.param_logical_axes(cfg)
        is_tuple = lambda x: isinstance(x, tuple)  # noqa: E731
        flat_shapes = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_tuple)[0]
        flat_axes = dict(jax.tree_util.tree_flatten_with_path(axes, is_leaf=is_tuple)[0])
        assert len(flat_shapes) == len(flat_axes), name
        for path, shape in flat_shapes:
            assert len(flat_axes[path]) == len(shape), (name, path)
        assert axes["layers"]["pre_ffn_norm"] == ("layers", "embed")
    assert axes["layers"]["q_norm"] == ("layers", None)


def test_engine_logprobs_have_the_final_cap(make_llm, gemma_dirs, prompt45):
    folder = gemma_dirs("gemma3-linear-rope")  # final cap 3.0: far from the raw logits
    ref = _hf_logits(folder, prompt45)[-1].astype(np.float64)
    want = ref - np.log(np.exp(ref - ref.max()).sum()) - ref.max()
    llm = make_llm(folder, block_size=16, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=0)
    out = llm.generate([{"prompt_token_ids": prompt45}], params, use_tqdm=False)[0]
    token = out.outputs[0].token_ids[0]
    assert token == int(np.argmax(ref))
    assert out.outputs[0].logprobs[0][token].logprob == pytest.approx(want[token], abs=1e-4)


def test_scoring_logprobs_have_the_final_cap(gemma_dirs, prompt45):
    """`scoring.token_logprobs` (perplexity) applies the final cap: HF's log-softmax."""
    from pagedjax.scoring import token_logprobs

    folder = gemma_dirs("gemma3-linear-rope")
    cfg, params = _load(folder)
    ref = torch.log_softmax(torch.tensor(_hf_logits(folder, prompt45)), dim=-1).numpy()
    want = ref[np.arange(len(prompt45) - 1), prompt45[1:]]
    got = token_logprobs(params, cfg, prompt45, chunk_size=16, attention_backend="reference")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_conversion_and_int8_keep_the_model(gemma_dirs, prompt45, tmp_path):
    """A converted folder (`save_converted`: config.json from `hf_config_dict`, orbax params)
    reloads as the same model; int8 weights (the linear layers quantized on load) run and
    stay close to float."""
    folder = gemma_dirs("gemma3-linear-rope")
    cfg, params = _load(folder)
    want = forward_chunks(params, cfg, [prompt45], "reference")
    loader.save_converted(tmp_path / "conv", cfg, params, tokenizer=None)
    source = loader.resolve_model_source(str(tmp_path / "conv"))
    assert source.kind == "orbax" and loader.load_arch_config(source) == cfg
    got = forward_chunks(loader.load_params(source, cfg, "float32"), cfg, [prompt45], "reference")
    np.testing.assert_array_equal(got, want)
    source = loader.resolve_model_source(str(folder))
    q = loader.load_params(source, cfg, "float32", quantization="int8")
    got = forward_chunks(q, cfg, [prompt45], "reference")
    err = np.abs(got - want)
    assert err.mean() < 0.05 and err.max() < 0.5, (err.mean(), err.max())
