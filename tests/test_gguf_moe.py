"""Qwen3-MoE GGUF files (llama.cpp's `qwen3moe`), written from a tiny random Hugging Face
checkpoint (8 experts, top-2, 3 layers) the way llama.cpp's converter lays them out
(`gguf_writer`): one float32 file, and one with Q8_0 attention / embedding / head / router
and Q4_1 expert stacks. References: transformers (torch, float32) on the source checkpoint,
and transformers reading the GGUF file itself (`from_pretrained(..., gguf_file=)`, which
dequantizes it). Every layer is sparse: the format has no dense layers (no
`mlp_only_layers`; llama.cpp runs experts on every layer), so a dense layer's tensor is
refused by name."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from conftest import forward_chunks, hf_greedy, hf_model, make_checkpoint, randomize_norms
from gguf_writer import write_gguf
from test_moe import CASES, EXPERT_NAMES

from pagedjax import SamplingParams
from pagedjax.models import loader
from pagedjax.models.qwen3_moe import Qwen3MoeArchConfig
from pagedjax.ops.gguf_quant import GGUFWeight

# test_moe's Qwen3-MoE case, every layer sparse (llama.cpp's qwen3moe has no dense layers)
CASE = {k: v for k, v in CASES["qwen3_moe"].items() if k != "mlp_only_layers"}
EXPERTS = EXPERT_NAMES
NEW_TOKENS = 8
_rng = np.random.default_rng(5)
PROMPTS = [_rng.integers(3, 259, size=n).tolist() for n in (3, 21, 50)]


def _formats(name: str) -> str:
    """The quantized file's block format of each tensor (2-D and 3-D ones)."""
    return "Q4_1" if name.endswith("_exps.weight") else "Q8_0"


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory):
    """(HF folder, the float32 GGUF file, the quantized GGUF file) of the same weights."""
    base = tmp_path_factory.mktemp("qwen3moe-gguf")
    folder = make_checkpoint(base / "hf", seed=3, **CASE)
    randomize_norms(folder, seed=13)
    f32 = write_gguf(base / "f32.gguf", folder)
    quantized = write_gguf(base / "quantized.gguf", folder, quantize=_formats)
    return folder, f32, quantized


def _load(path, quantization=None):
    source = loader.resolve_model_source(str(path))
    cfg = loader.load_arch_config(source)
    return cfg, loader.load_params(source, cfg, "float32", quantization=quantization)


def _hf_from_gguf(folder, path):
    """transformers' own reading of the GGUF file (its blocks dequantized), with the source's
    config.json: transformers' GGUF reader maps no key to `moe_intermediate_size`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        config=AutoConfig.from_pretrained(str(folder)),
        dtype=torch.float32,
    ).eval()
    model.generation_config.eos_token_id = None
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_qwen3moe_gguf_loads_as_the_safetensors_checkpoint(moe_gguf):
    """The float32 file: the safetensors folder's config and every param, bit for bit (the
    router [E, D] and the [E, out, in] expert stacks transposed back)."""
    folder, f32, _ = moe_gguf
    assert loader.resolve_model_source(str(f32)).kind == "gguf"
    cfg, params = _load(f32)
    ref_cfg, ref = _load(folder)
    assert type(cfg) is Qwen3MoeArchConfig and cfg == ref_cfg
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.norm_topk_prob and cfg.qk_norm and cfg.sparse_layers is None
    got = dict(jax.tree_util.tree_leaves_with_path(params))
    want = dict(jax.tree_util.tree_leaves_with_path(ref))
    assert got.keys() == want.keys()
    assert params["layers"]["experts_down"].shape == (3, 8, 32, 64)
    for k, w in want.items():
        key = jax.tree_util.keystr(k)
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(w), err_msg=key)


def test_qwen3moe_gguf_prefill_logits_match_hf(moe_gguf):
    """Prefill logits (45 tokens, whole and in chunks) within 1e-4 of HF's: the float32
    file against HF on the source checkpoint (which transformers' reading of the file equals
    exactly); the quantized file, kept in blocks and dequantized, against transformers'
    reading of that file."""
    folder, f32, quantized = moe_gguf
    ids = np.random.default_rng(0).integers(3, 259, size=45).tolist()
    chunkings = ([ids], [ids[:13], ids[13:30], *([t] for t in ids[30:33]), ids[33:]])
    ref = _logits(hf_model(folder), ids)
    np.testing.assert_array_equal(_logits(_hf_from_gguf(folder, f32), ids), ref)
    cfg, params = _load(f32)
    for chunks in chunkings:
        got = forward_chunks(params, cfg, chunks, "reference")
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0, err_msg=f"f32 {len(chunks)}")

    ref_q = _logits(_hf_from_gguf(folder, quantized), ids)
    assert np.abs(ref_q - ref).max() > 1e-3  # the blocks do change the weights
    for quantization in ("gguf", None):
        cfg, params = _load(quantized, quantization)
        for chunks in chunkings:
            got = forward_chunks(params, cfg, chunks, "reference")
            np.testing.assert_allclose(
                got, ref_q, atol=1e-4, rtol=0, err_msg=f"{quantization} {len(chunks)}"
            )


def test_quantized_qwen3moe_gguf_keeps_attention_blocks_and_dequantizes_experts(moe_gguf):
    """Kept load (quantization="gguf"): attention, embedding and head as `GGUFWeight` blocks
    (Q8_0); the Q4_1 expert stacks and the Q8_0 router as float32 arrays, equal to the
    dequantized load's."""
    _, _, quantized = moe_gguf
    _, kept = _load(quantized, "gguf")
    _, dense = _load(quantized)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        w = kept["layers"][name]
        assert isinstance(w, GGUFWeight) and w.qtype == "Q8_0", name
    assert isinstance(kept["embed_tokens"], GGUFWeight)
    assert isinstance(kept["lm_head"], GGUFWeight)
    for name in (*EXPERTS, "router"):
        w = kept["layers"][name]
        assert not isinstance(w, GGUFWeight) and w.dtype == np.float32, name
        np.testing.assert_array_equal(np.asarray(w), np.asarray(dense["layers"][name]), name)


def test_qwen3moe_gguf_greedy_matches_hf(make_llm, moe_gguf, tmp_path):
    """`LLM(file.gguf)`: the float32 file's greedy tokens equal HF's on the source checkpoint;
    the quantized file kept in blocks (the default) equals the same file dequantized
    (dtype="float32") token for token, logprobs within 1e-4, and transformers' reading of
    that file."""
    folder, f32, quantized = moe_gguf
    common = dict(tokenizer=str(folder), download_dir=str(tmp_path / "cache"), block_size=16)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=1)
    requests = [{"prompt_token_ids": p} for p in PROMPTS]
    hf = hf_model(folder)
    outs = make_llm(f32, **common).generate(requests, sp, use_tqdm=False)
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf, p, NEW_TOKENS), len(p)

    kept_llm = make_llm(quantized, dtype="auto", **common)
    assert kept_llm.llm_engine.config.model_config.quantization == "gguf"
    kept = kept_llm.generate(requests, sp, use_tqdm=False)
    dense = make_llm(quantized, **common).generate(requests, sp, use_tqdm=False)
    hf_q = _hf_from_gguf(folder, quantized)
    for p, a, b in zip(PROMPTS, kept, dense, strict=True):
        out_a, out_b = a.outputs[0], b.outputs[0]
        assert out_a.token_ids == out_b.token_ids == hf_greedy(hf_q, p, NEW_TOKENS), len(p)
        pairs = zip(out_a.logprobs, out_b.logprobs, out_a.token_ids, strict=True)
        for la, lb, t in pairs:
            assert abs(la[t].logprob - lb[t].logprob) < 1e-4, len(p)


def test_qwen3moe_gguf_dense_layer_tensor_is_refused(moe_gguf, tmp_path):
    """A dense MLP tensor in a qwen3moe file (which the format does not have) is named."""
    folder, _, _ = moe_gguf
    extra = {"blk.1.ffn_gate.weight": np.zeros((128, 64), np.float32)}
    path = write_gguf(tmp_path / "dense.gguf", folder, extra_tensors=extra)
    source = loader.resolve_model_source(str(path))
    cfg = loader.load_arch_config(source)
    with pytest.raises(ValueError, match="unexpected tensor 'blk.1.ffn_gate.weight'"):
        loader.load_params(source, cfg)
