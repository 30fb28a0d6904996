"""GGUF files of the families beyond Llama (qwen2, qwen3, phi3, gemma2, gemma3), written from
tiny Hugging Face checkpoints the way llama.cpp's converter lays them out (`gguf_writer`): the
architecture and params equal the safetensors load, greedy generation through `LLM(file.gguf)`
equals Hugging Face's on the same weights, and architectures or features without support are
refused by name."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from conftest import hf_greedy, hf_model, make_checkpoint, randomize_norms
from gguf_writer import write_gguf
from test_gemma import make_gemma_checkpoint

from pagedjax import SamplingParams
from pagedjax.models import loader

CASES = {
    # head_dim 32 with hidden 64 and 4 heads (the file's attention.key_length); tied head
    "qwen3": dict(arch="qwen3", head_dim=32, tie_word_embeddings=True),
    # fused attn_qkv and gate+up ffn_up (stored Q8_0); a window on every layer
    "phi3": dict(arch="phi3", sliding_window=16),
    "qwen2": dict(arch="qwen2"),  # q/k/v biases
    # Gemma's norms stored as (w + 1); a window of 16 on every other layer, both soft caps;
    # query_pre_attn_scalar = head_dim (32 != 64 / 4), which is what llama.cpp runs the
    # file with (the file does not carry it)
    "gemma2": dict(
        arch="gemma2",
        num_hidden_layers=4,
        query_pre_attn_scalar=32,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
    ),
    # q/k norms, five sliding layers of every six, global / local RoPE bases 1e6 / 1e4
    "gemma3": dict(arch="gemma3", num_hidden_layers=6, query_pre_attn_scalar=32),
}
GEMMA = {"gemma2", "gemma3"}
QUANTIZED_FFN = {"phi3"}
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def gguf_cases(tmp_path_factory):
    """name -> (HF folder, GGUF file of the same weights), written on first use."""
    made = {}

    def get(name):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            if name in GEMMA:  # random norm weights of its own
                folder = make_gemma_checkpoint(folder, seed=3, **CASES[name])
            else:
                folder = make_checkpoint(folder, seed=3, **CASES[name])
                randomize_norms(folder, seed=len(made))
            path = write_gguf(
                folder.parent / f"{name}.gguf", folder, quantize_ffn=name in QUANTIZED_FFN
            )
            made[name] = folder, path
        return made[name]

    return get


def _load(path):
    source = loader.resolve_model_source(str(path))
    cfg = loader.load_arch_config(source)
    return source, cfg, loader.load_params(source, cfg)


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_loads_as_the_safetensors_checkpoint(gguf_cases, name):
    folder, path = gguf_cases(name)
    source, cfg, params = _load(path)
    assert source.kind == "gguf"
    _, ref_cfg, ref = _load(folder)
    assert cfg == ref_cfg
    got = dict(jax.tree_util.tree_leaves_with_path(params))
    want = dict(jax.tree_util.tree_leaves_with_path(ref))
    assert got.keys() == want.keys()
    for k, w in want.items():
        key = jax.tree_util.keystr(k)
        g, w = np.asarray(got[k]), np.asarray(w)
        if name in QUANTIZED_FFN and ("gate_proj" in key or "up_proj" in key):
            # Q8_0: each value within its 32-block's scale / 127 (at most the max / 127)
            np.testing.assert_allclose(g, w, atol=np.abs(w).max() / 127, err_msg=key)
        elif name in GEMMA and "norm" in key:
            # stored as float32 (w + 1), loaded as that less 1: the scale 1 + w the model
            # computes is the same float32 (w itself within (w + 1)'s rounding)
            one = np.float32(1)
            assert not np.array_equal(w, np.zeros_like(w)), key
            np.testing.assert_array_equal(g + one, w + one, err_msg=key)
        else:
            np.testing.assert_array_equal(g, w, err_msg=key)


@pytest.mark.parametrize("name", ["qwen3", "phi3", "gemma2", "gemma3"])
def test_gguf_greedy_matches_hf(make_llm, gguf_cases, name, tmp_path):
    """`LLM(file.gguf)` (converted once into the cache folder) against HF on the GGUF's own
    weights (dequantized where stored Q8_0), prompts of up to 3 of phi3's windows."""
    folder, path = gguf_cases(name)
    if name in QUANTIZED_FFN:  # HF reads the same dequantized weights
        folder = _with_gguf_weights(folder, path, tmp_path / "dequantized")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 259, size=n).tolist() for n in (3, 21, 50)]
    hf = hf_model(folder)
    want = [hf_greedy(hf, p, NEW_TOKENS) for p in prompts]
    llm = make_llm(path, tokenizer=str(folder), download_dir=str(tmp_path / "cache"), block_size=16)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    for p, out, ref in zip(prompts, outs, want, strict=True):
        assert out.outputs[0].token_ids == ref, f"{name}: prompt of {len(p)} tokens"


def _with_gguf_weights(folder, path, out):
    """A copy of HF checkpoint `folder` whose fused MLP weights are the GGUF file's
    dequantized ones."""
    import shutil

    from gguf.quants import dequantize
    from safetensors.numpy import load_file, save_file

    from pagedjax.models.gguf_file import gguf_reader

    shutil.copytree(folder, out)
    tensors = dict(load_file(str(out / "model.safetensors")))
    for t in gguf_reader(str(path)).tensors:
        if t.name.endswith("ffn_up.weight"):
            layer = int(t.name.split(".")[1])
            tensors[f"model.layers.{layer}.mlp.gate_up_proj.weight"] = dequantize(
                t.data, t.tensor_type
            )
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("arch", ["gemma", "falcon", "qwen2moe"])
def test_unsupported_gguf_architecture_is_named(tmp_path, tiny_llama_dir, arch):
    path = write_gguf(tmp_path / f"{arch}.gguf", tiny_llama_dir, arch=arch)
    with pytest.raises(ValueError, match=f"'{arch}'.*not supported"):
        loader.load_arch_config(loader.resolve_model_source(str(path)))


def test_mixtral_gguf_is_refused_as_mixture_of_experts(tmp_path, tiny_llama_dir):
    """llama.cpp writes Mixtral as "llama" with an expert count: refused, MoE named (only
    qwen3moe MoE files load: tests/test_gguf_moe.py)."""
    path = write_gguf(
        tmp_path / "mixtral.gguf", tiny_llama_dir, extra_fields={"llama.expert_count": 8}
    )
    with pytest.raises(ValueError, match="mixture-of-experts.*'llama' are not supported"):
        loader.load_arch_config(loader.resolve_model_source(str(path)))


def test_phi3_longrope_gguf_is_refused(gguf_cases, tmp_path):
    folder, _ = gguf_cases("phi3")
    factors = np.ones(8, np.float32)
    path = write_gguf(
        tmp_path / "longrope.gguf",
        folder,
        extra_tensors={"rope_factors_long.weight": factors, "rope_factors_short.weight": factors},
    )
    with pytest.raises(ValueError, match="rope_factors_long.*LongRoPE"):
        loader.load_arch_config(loader.resolve_model_source(str(path)))


def test_a_file_is_parsed_once_and_again_when_it_changes(tmp_path, tiny_llama_dir):
    """The reader of a GGUF file is shared by the loads of one process while the file is
    unchanged; the same path rewritten with other contents is read afresh."""
    from pagedjax.models.gguf_file import gguf_reader

    path = write_gguf(tmp_path / "m.gguf", tiny_llama_dir)
    first = gguf_reader(str(path))
    assert gguf_reader(str(path)) is first
    source = loader.resolve_model_source(str(path))
    assert loader.load_arch_config(source).num_hidden_layers > 0
    written = write_gguf(
        tmp_path / "other.gguf", tiny_llama_dir, extra_fields={"llama.expert_count": 8}
    )
    written.replace(path)  # a new inode at the same path
    assert gguf_reader(str(path)) is not first
    with pytest.raises(ValueError, match="mixture-of-experts"):
        loader.load_arch_config(source)
