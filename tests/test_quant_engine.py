"""Quantization through the whole engine on tiny checkpoints: int8 greedy output close to the
float model's, a GPTQ act-order checkpoint equal to Hugging Face running its dequantized
weights, and an fp8 checkpoint on a float8 KV cache whose block count follows its dtype."""

from __future__ import annotations

import logging
import shutil

import numpy as np
import torch
from conftest import hf_greedy, hf_model
from test_quant_checkpoints import HF_LINEAR, _numpy_dequantize, _raw, _write_fp8, _write_int4

from pagedjax import SamplingParams
from pagedjax.executor.model_runner import compile_count
from pagedjax.models import loader

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
SMALL = dict(max_num_batched_tokens=32)  # two token buckets: a quick warm-up


def _generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _logit_gaps(hf, prompts, outputs):
    """For each generated token: the float model's best logit minus the logit of the token
    chosen, teacher-forced on the generated sequence (0 where both agree)."""
    gaps = []
    for p, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([p + out])).logits[0].numpy()  # [len, V]
        rows = logits[len(p) - 1 : len(p) - 1 + len(out)]
        gaps.extend(rows.max(axis=1) - rows[np.arange(len(out)), out])
    return np.array(gaps)


def _assert_pool_whole(llm):
    pool = llm.llm_engine.kv_cache_manager.pool
    assert pool.num_free_blocks == pool.num_usable_blocks, "a block leaked"


def test_int8_greedy_stays_close_to_float(make_llm, tmp_path, tiny_llama_dir, tiny_hf, prompts8):
    """int8 weight-only on the tiny random model (logits of std ~0.8, many near-ties):
    5 of 8 prompts give float's 10 greedy tokens exactly (measured: 5); every token int8
    picks is within 0.1 logit of the float model's best choice at that point (measured max
    0.056), so divergences are near-ties, not errors. Saved and reloaded, the int8 params
    give the same tokens without quantizing again."""
    llm = make_llm(tiny_llama_dir, quantization="int8", enforce_eager=False, **SMALL)
    assert llm.llm_engine.config.model_config.quantization == "int8"
    before = compile_count()
    got = _generate(llm, prompts8)
    assert compile_count() == before, "a quantized step compiled after warm-up"
    want = [hf_greedy(tiny_hf, p, 10) for p in prompts8]
    assert sum(g == w for g, w in zip(got, want, strict=True)) >= 5
    gaps = _logit_gaps(tiny_hf, prompts8, got)
    assert gaps.max() < 0.1, gaps.max()
    _assert_pool_whole(llm)
    eng = llm.llm_engine
    out = tmp_path / "int8-converted"
    loader.save_converted(out, eng.config.model_config.arch, eng.runner.params, eng.tokenizer)
    reloaded = make_llm(out, **SMALL)
    assert reloaded.llm_engine.config.model_config.quantization == "int8"
    assert _generate(reloaded, prompts8) == got


def test_gptq_act_order_checkpoint_equals_hf_on_its_dequantized_weights(
    make_llm, tmp_path, tiny_llama_dir, prompts8
):
    folder = _write_int4(tiny_llama_dir, tmp_path / "gptq", "gptq", 32, act_order=True)
    # The same model in float: each linear weight replaced by its NumPy dequantization.
    from safetensors.numpy import save_file

    tensors, raw = _raw(folder), _raw(tiny_llama_dir)
    for i in range(2):
        for hf_name in HF_LINEAR.values():
            prefix = f"model.layers.{i}.{hf_name}"
            w = _numpy_dequantize(tensors, prefix, "gptq", 32)  # [in, out]
            raw[prefix + ".weight"] = np.ascontiguousarray(w.T)
    deq = tmp_path / "dequantized"
    shutil.copytree(tiny_llama_dir, deq)
    save_file(raw, str(deq / "model.safetensors"))
    hf = hf_model(deq)
    llm = make_llm(folder, **SMALL)
    assert llm.llm_engine.config.model_config.quantization == "gptq"
    got = _generate(llm, prompts8)
    for p, g in zip(prompts8, got, strict=True):
        assert g == hf_greedy(hf, p, 10), f"prompt of {len(p)} tokens"
    _assert_pool_whole(llm)


def test_fp8_checkpoint_on_fp8_kv_cache(
    make_llm, tmp_path, tiny_llama_dir, tiny_hf, prompts8, caplog
):
    """fp8 weights with static activation scales and the checkpoint's k/v scales on a
    float8_e4m3fn cache: the same bytes hold four times float32's blocks, the start-up log
    says so, and greedy tokens stay within 0.5 logit of the float model's best (measured
    max 0.23; std of logits ~0.8)."""
    folder = _write_fp8(tiny_llama_dir, tmp_path / "fp8")
    nbytes = 1 << 20
    with caplog.at_level(logging.INFO, logger="pagedjax.engine.engine"):
        llm = make_llm(folder, kv_cache_dtype="fp8", kv_cache_memory_bytes=nbytes, **SMALL)
    runner = llm.llm_engine.runner
    # 2 (K and V) x 2 layers x 16 slots x 2 KV heads x 16 dims x 1 byte per block.
    per_block = 2 * 2 * 16 * 2 * 16
    assert runner.bytes_per_block() == per_block
    assert runner.num_blocks == nbytes // per_block == 512
    assert all(c.dtype == np.dtype("float8_e4m3fn") for c in runner.kv_cache)
    assert llm.llm_engine.kv_cache_manager.pool.num_usable_blocks == 511
    assert any(
        "float8_e4m3fn): 511 blocks of 16 tokens and 1 null block" in r.getMessage()
        for r in caplog.records
    )
    np.testing.assert_allclose(np.asarray(runner.params["layers"]["k_scale"]), [0.01, 0.02])
    got = _generate(llm, prompts8)
    gaps = _logit_gaps(tiny_hf, prompts8, got)
    assert gaps.max() < 0.5, gaps.max()
    _assert_pool_whole(llm)


def test_kv_block_bytes_follow_the_cache_dtype():
    """2 x 2 layers x 16 slots x 2 KV heads x 16 dims: 4 bytes each in float32, 2 in
    bfloat16, 1 in either float8 format."""
    from pagedjax.ops.kv_cache import kv_cache_bytes_per_block, kv_cache_jnp_dtype

    got = {
        (name, model): kv_cache_bytes_per_block(2, 16, 2, 16, kv_cache_jnp_dtype(name, model))
        for name, model in [("auto", "float32"), ("auto", "bfloat16"), ("fp8", "bfloat16")]
    }
    got[("fp8_e5m2", "float32")] = kv_cache_bytes_per_block(
        2, 16, 2, 16, kv_cache_jnp_dtype("fp8_e5m2", "float32")
    )
    assert list(got.values()) == [8192, 4096, 2048, 2048]
