"""The model against Hugging Face transformers (torch, float32): prefill logits of tiny random
checkpoints of each supported architecture, through every attention backend, in one cache
and across chunked prefills."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import hf_model, make_checkpoint

from pagedjax.executor.input_batch import BatchBuilder, SeqInput
from pagedjax.models import llama, loader
from pagedjax.ops import cpu_linear
from pagedjax.ops.attention import AttentionMetadata
from pagedjax.ops.kv_cache import init_kv_cache, kv_cache_shape

BLOCK = 8


def _forward_chunks(params, cfg, kv, chunks, backend, block_ids):
    """Runs one sequence's prompt through the model in the given chunks; returns all logits.
    Steps are padded to 16 tokens or more (chunks of 1 to 16 tokens share one compilation)."""
    builder = BatchBuilder(
        max_num_batched_tokens=128,
        max_num_seqs=4,
        max_model_len=256,
        block_size=BLOCK,
        query_tile_size=8,
        kv_chunk_pages=2,
        sizes=(16,),
    )
    logits, start = [], 0
    fwd = jax.jit(
        lambda p, kv, a, md: llama.forward(
            p, kv, a["input_ids"], a["positions"], md, cfg=cfg, attention_backend=backend
        )
    )
    for chunk in chunks:
        layout, buf = builder.build([SeqInput(np.asarray(chunk, np.int32), start, block_ids)])
        a = {k: jnp.asarray(v) for k, v in layout.unpack(buf.copy()).items()}
        md = AttentionMetadata.from_arrays(a, query_tile_size=8, kv_chunk_pages=2)
        hidden, kv = fwd(params, kv, a, md)
        logits.append(np.asarray(llama.compute_logits(params, hidden[: len(chunk)])))
        start += len(chunk)
    return np.concatenate(logits), kv


def _packed_if(backend, params):
    """ "cpu-prepacked": the params as the engine holds them under linear_backend="cpu"
    (pre-packed linear weights and LM head), with the "cpu" attention backend."""
    return cpu_linear.pack_params(params) if backend == "cpu-prepacked" else params


def _load(folder):
    source = loader.resolve_model_source(str(folder))
    cfg = loader.load_arch_config(source)
    return cfg, loader.load_params(source, cfg, "float32")


def _hf_logits(folder, ids):
    with torch.no_grad():
        return hf_model(folder)(torch.tensor([ids])).logits[0].numpy()


CASES = {
    "llama-gqa": dict(arch="llama"),
    "llama-tied-mha": dict(arch="llama", tie_word_embeddings=True, num_key_value_heads=4),
    "llama3-rope-scaling": dict(
        arch="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama-linear-rope": dict(
        arch="llama", rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    ),
    "qwen2-bias": dict(arch="qwen2", num_key_value_heads=1),
    "llama-attention-bias": dict(arch="llama", attention_bias=True),  # q/k/v and o biases
    "mistral-head-dim": dict(arch="mistral"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_prefill_logits_match_hf(tmp_path, name):
    folder = make_checkpoint(tmp_path / name, **CASES[name])
    cfg, params = _load(folder)
    ids = np.random.default_rng(0).integers(3, 259, size=45).tolist()
    ref = _hf_logits(folder, ids)
    shape = kv_cache_shape(cfg.num_hidden_layers, 16, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    blocks = np.arange(1, 8, dtype=np.int32)
    for backend in ("reference", "xla", "cpu", "cpu-prepacked"):
        got, _ = _forward_chunks(
            _packed_if(backend, params),
            cfg,
            init_kv_cache(shape, jnp.float32),
            [ids],
            backend.split("-")[0],
            blocks,
        )
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0, err_msg=f"{name} {backend}")


def test_chunked_prefill_and_decode_match_hf(tmp_path, tiny_llama_dir):
    """Logits of a prompt fed in uneven chunks, then token by token, through a paged cache
    with non-contiguous blocks, equal HF's logits of the whole sequence."""
    cfg, params = _load(tiny_llama_dir)
    ids = np.random.default_rng(1).integers(3, 259, size=40).tolist()
    ref = _hf_logits(tiny_llama_dir, ids)
    shape = kv_cache_shape(cfg.num_hidden_layers, 20, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    blocks = np.array([7, 3, 12, 1, 9, 15], np.int32)  # scattered, out of order
    chunks = [ids[:13], ids[13:16], ids[16:33], *([t] for t in ids[33:])]
    for backend in ("reference", "xla", "cpu", "cpu-prepacked"):
        got, _ = _forward_chunks(
            _packed_if(backend, params),
            cfg,
            init_kv_cache(shape, jnp.float32),
            chunks,
            backend.split("-")[0],
            blocks,
        )
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0, err_msg=backend)


def test_bfloat16_params_stay_close(tiny_llama_dir):
    source = loader.resolve_model_source(str(tiny_llama_dir))
    cfg = loader.load_arch_config(source)
    params = loader.load_params(source, cfg, "bfloat16")
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    ids = np.random.default_rng(2).integers(3, 259, size=20).tolist()
    shape = kv_cache_shape(cfg.num_hidden_layers, 8, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    got, _ = _forward_chunks(
        params,
        cfg,
        init_kv_cache(shape, jnp.bfloat16),
        [ids],
        "xla",
        np.arange(1, 4, dtype=np.int32),
    )
    ref = _hf_logits(tiny_llama_dir, ids)
    # bf16 keeps 8 bits of mantissa: logits of magnitude ~3 are off by a few 1e-2.
    assert np.abs(got - ref).max() < 0.15


def test_unsupported_architecture_is_named(tmp_path):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        llama.LlamaArchConfig.from_hf_config(json.loads((folder / "config.json").read_text()))


def test_unsupported_rope_type_is_named():
    hf = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 8,
        "hidden_size": 8,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0},
    }
    with pytest.raises(ValueError, match="yarn"):
        llama.LlamaArchConfig.from_hf_config(hf)
