"""Model families beyond Llama (Qwen3, Phi-3) against Hugging Face transformers (torch,
float32): prefill logits of tiny random checkpoints through the "reference" and "cpu"
attention backends, and greedy generation through the engine under chunked prefill, prefix
caching and preemption; the registry's choice of config reader, and what it refuses."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
import torch
from conftest import forward_chunks, hf_greedy, hf_model, make_checkpoint, randomize_norms

from pagedjax import SamplingParams
from pagedjax.models import loader, registry
from pagedjax.models.hf_checkpoint import assign_hf
from pagedjax.models.phi3 import Phi3ArchConfig
from pagedjax.models.qwen3 import Qwen3ArchConfig
from pagedjax.models.stacking import StackedParams

MAX_TOKENS = 8
# Qwen3: head_dim 32 with hidden 96 and 4 heads, so head_dim != hidden / heads.
QWEN3 = dict(arch="qwen3", hidden_size=96, head_dim=32, num_attention_heads=4)
CASES = {
    "qwen3-tied": dict(**QWEN3, tie_word_embeddings=True),
    "qwen3-bias-untied": dict(**QWEN3, attention_bias=True),
    "phi3": dict(arch="phi3"),
    "phi3-tied-mha": dict(arch="phi3", tie_word_embeddings=True, num_key_value_heads=4),
}
GENERATION_CASES = ("qwen3-tied", "phi3")


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    """name -> the folder of CASES[name]'s tiny checkpoint, written on first use."""
    dirs = {}

    def get(name):
        if name not in dirs:
            folder = make_checkpoint(tmp_path_factory.mktemp(name), **CASES[name])
            randomize_norms(folder, seed=len(dirs))
            dirs[name] = folder
        return dirs[name]

    return get


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_logits_match_hf(family_dirs, name):
    folder = family_dirs(name)
    source = loader.resolve_model_source(str(folder))
    cfg = loader.load_arch_config(source)
    assert type(cfg) is {"qwen3": Qwen3ArchConfig, "phi3": Phi3ArchConfig}[CASES[name]["arch"]]
    assert cfg.tie_word_embeddings == CASES[name].get("tie_word_embeddings", False)
    params = loader.load_params(source, cfg, "float32")
    if name.startswith("qwen3"):
        assert cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size
        assert params["layers"]["q_norm"].shape == (cfg.num_hidden_layers, cfg.head_dim)
    ids = np.random.default_rng(0).integers(3, 259, size=45).tolist()
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([ids])).logits[0].numpy()
    for backend in ("reference", "cpu"):
        # the whole prompt at once, then in uneven chunks across the scattered blocks
        for chunks in ([ids], [ids[:13], ids[13:30], *([t] for t in ids[30:33]), ids[33:]]):
            got = forward_chunks(params, cfg, chunks, backend)
            np.testing.assert_allclose(
                got, ref, atol=1e-4, rtol=0, err_msg=f"{name} {backend} {len(chunks)} chunks"
            )


@pytest.fixture(scope="session")
def family_prompts():
    """Eight prompts of different lengths (1 to 90 tokens); the 47- and 90-token ones start
    with the 33- and 64-token ones, so that prefix caching finds full blocks to share."""
    rng = np.random.default_rng(4321)
    lengths = (1, 5, 16, 17, 33, 47, 64, 90)
    prompts = [rng.integers(3, 259, size=n).tolist() for n in lengths]
    prompts[5][:33] = prompts[4]
    prompts[7][:64] = prompts[6]
    return prompts


@pytest.fixture(scope="session")
def family_hf_greedy(family_dirs, family_prompts):
    """name -> HF greedy continuations (MAX_TOKENS each) of the eight prompts, memoised."""
    cache = {}

    def get(name):
        if name not in cache:
            model = hf_model(family_dirs(name))
            cache[name] = [hf_greedy(model, p, MAX_TOKENS) for p in family_prompts]
        return cache[name]

    return get


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name", GENERATION_CASES)
def test_greedy_generation_matches_hf(
    make_llm, family_dirs, family_prompts, family_hf_greedy, name, block_size
):
    """All eight prompts at once, prefilled in chunks of at most 32 tokens, with prefix
    caching, in a pool that holds the longest request (90 + 8 tokens) and little more: the
    scheduler has to preempt, and the outputs still equal HF's token for token."""
    longest = max(map(len, family_prompts)) + MAX_TOKENS
    llm = make_llm(
        family_dirs(name),
        block_size=block_size,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        num_gpu_blocks_override=math.ceil(longest / block_size) + 1,  # + the null block
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in family_prompts], greedy, use_tqdm=False)
    want = family_hf_greedy(name)
    for p, out, ref in zip(family_prompts, outs, want, strict=True):
        assert out.outputs[0].token_ids == ref, f"{name}: prompt of {len(p)} tokens"
    stats = llm.llm_engine.scheduler.stats()
    assert stats.num_preemptions > 0, "the small pool should force preemptions"
    assert stats.prefix_cache_hits > 0, "shared prompt prefixes should hit the cache"


def test_registry_reads_each_family_config(family_dirs):
    for name, cls in (("qwen3-tied", Qwen3ArchConfig), ("phi3", Phi3ArchConfig)):
        d = json.loads((family_dirs(name) / "config.json").read_text())
        assert type(registry.arch_config_from_hf(d)) is cls
        d.pop("architectures")  # then the model_type names the family
        assert type(registry.arch_config_from_hf(d)) is cls
    # a family's own reader refuses another family's architecture, by name
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        Phi3ArchConfig.from_hf_config({"architectures": ["Qwen3ForCausalLM"]})


def test_param_logical_axes_cover_every_param(family_dirs):
    """Every param has logical axes, one per dimension; q_norm / k_norm are replicated
    apart from the layer axis."""
    for name in CASES:
        cfg = loader.load_arch_config(loader.resolve_model_source(str(family_dirs(name))))
        model = registry.get_model(cfg.architecture)
        shapes, axes = model.param_shapes(cfg), model.param_logical_axes(cfg)
        is_tuple = lambda x: isinstance(x, tuple)  # noqa: E731
        flat_shapes = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=is_tuple)[0]
        flat_axes = dict(jax.tree_util.tree_flatten_with_path(axes, is_leaf=is_tuple)[0])
        assert len(flat_shapes) == len(flat_axes), name
        for path, shape in flat_shapes:
            assert len(flat_axes[path]) == len(shape), (name, path)
        if name.startswith("qwen3"):
            assert axes["layers"]["q_norm"] == axes["layers"]["k_norm"] == ("layers", None)


def test_unregistered_architecture_is_named(tmp_path):
    folder = tmp_path / "falcon"
    folder.mkdir()
    hf = {"architectures": ["FalconForCausalLM"], "model_type": "falcon", "vocab_size": 8}
    (folder / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        loader.load_arch_config(loader.ModelSource("hf", str(folder)))
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        registry.get_model("FalconForCausalLM")
    with pytest.raises(ValueError, match="falcon"):
        registry.arch_config_from_hf({"model_type": "falcon"})


def _phi3_config(**extra):
    return {
        "architectures": ["Phi3ForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        **extra,
    }


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_scaling": {"type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
        {"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}},
        {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0}},
    ],
)
def test_phi3_longrope_is_refused(rope):
    with pytest.raises(ValueError, match="LongRoPE"):
        registry.arch_config_from_hf(_phi3_config(**rope))


def test_partial_rotary_factor_is_refused():
    hf = _phi3_config(rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.75})
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        registry.arch_config_from_hf(hf)
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        registry.arch_config_from_hf(_phi3_config(partial_rotary_factor=0.5))
    plain = registry.arch_config_from_hf(
        _phi3_config(rope_parameters={"rope_type": "default", "partial_rotary_factor": 1.0})
    )
    assert plain.rope_scaling is None and not plain.attention_bias


def test_fused_phi3_tensors_split_and_check_their_rows():
    cfg = registry.arch_config_from_hf(_phi3_config(num_key_value_heads=1))  # H = 4
    stack = StackedParams(cfg, np.float32, lambda name, value: value)
    qkv = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)  # q 8 + k 4 + v 4 rows
    assign_hf(stack, cfg, "model.layers.0.self_attn.qkv_proj.weight", qkv)
    layers = stack.params["layers"]
    np.testing.assert_array_equal(layers["q_proj"][0], qkv[:8].T)
    np.testing.assert_array_equal(layers["k_proj"][0], qkv[8:12].T)
    np.testing.assert_array_equal(layers["v_proj"][0], qkv[12:].T)
    with pytest.raises(ValueError, match="gate_up_proj"):
        assign_hf(stack, cfg, "model.layers.0.mlp.gate_up_proj.weight", np.zeros((12, 8)))
