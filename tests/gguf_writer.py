"""Writing a tiny Hugging Face checkpoint as a GGUF file the way llama.cpp's converter lays it
out (`write_gguf`): its metadata keys per architecture, the tensor names of the `gguf`
package's own name map, llama's Q/K row reordering (written out independently of the
loader's inverse), Gemma's RMSNorm weights stored as (w + 1), and Qwen3-MoE's experts
merged into one [E, out, in] stack per layer and weight (Qwen2MoeModel's merge). Used by the
GGUF loading tests."""

from __future__ import annotations

import json
import re

import numpy as np

# config.json model_type -> the GGUF architecture llama.cpp's converter writes for it.
GGUF_ARCH = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3moe",
    "phi3": "phi3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
}


def llama_cpp_permute(w, n_head):
    """llama.cpp's convert_hf_to_gguf reordering of Q/K rows (llama only), written out
    independently: within each head, rows (i, i + H/2) become adjacent (2i, 2i + 1)."""
    H = w.shape[0] // n_head
    out = np.empty_like(w)
    for h in range(n_head):
        rows = w[h * H : (h + 1) * H]
        out[h * H : (h + 1) * H : 2] = rows[: H // 2]
        out[h * H + 1 : (h + 1) * H : 2] = rows[H // 2 :]
    return out


_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight$")


def merged_experts(raw, num_experts):
    """The per-expert tensors of `raw` merged as llama.cpp's Qwen2MoeModel does: name ->
    [E, out, in] under `model.layers.<i>.mlp.experts.<w>.weight`; the other tensors as
    they are."""
    out, experts = {}, {}
    for name, t in raw.items():
        if m := _EXPERT.match(name):
            experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = t
        else:
            out[name] = t
    for (layer, w), by_id in experts.items():
        assert sorted(by_id) == list(range(num_experts)), (layer, w)
        out[f"model.layers.{layer}.mlp.experts.{w}.weight"] = np.stack(
            [by_id[e] for e in range(num_experts)]
        )
    return out


def write_gguf(
    path,
    hf_dir,
    quantize_ffn=False,
    arch=None,
    extra_tensors=None,
    quantize=None,
    extra_fields=None,
):
    """Writes the tiny HF checkpoint in `hf_dir` as a GGUF file at `path`.

    Args:
        quantize_ffn: store each layer's `ffn_up` as Q8_0.
        quantize: None, or fn(gguf tensor name) -> a block format name ("Q4_1", ...) or None:
            2-D and 3-D (expert stack) tensors are stored quantized with the `gguf` package's
            quantizer.
        arch: the GGUF architecture to name (default: the converter's for the model_type).
        extra_tensors: {name: float32 array} written as well (tensors a file may carry).
        extra_fields: {key: int} uint32 metadata written as well.
    """
    import gguf
    from safetensors.numpy import load_file

    cfg = json.loads((hf_dir / "config.json").read_text())
    raw = load_file(str(hf_dir / "model.safetensors"))
    num_experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if cfg["model_type"] == "qwen3_moe":
        raw = merged_experts(raw, num_experts)
    model_arch = GGUF_ARCH[cfg["model_type"]]
    arch = arch or model_arch
    L, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    w = gguf.GGUFWriter(str(path), arch)
    if model_arch in ("gemma2", "gemma3"):
        _gemma_parameters(w, cfg, model_arch)
    else:
        _text_model_parameters(w, cfg, model_arch)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    if model_arch == "qwen3moe":  # TextModel's expert keys, Qwen2MoeModel's expert MLP size
        w.add_expert_count(num_experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    for key, value in (extra_fields or {}).items():
        w.add_uint32(key, value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[model_arch.upper()], L)
    for name, t in raw.items():
        if model_arch == "gemma2" and name == "lm_head.weight":
            continue  # Gemma2Model skips it (the head is tied)
        gg = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gg is not None, name
        if model_arch == "llama" and gg.endswith("attn_q.weight"):
            t = llama_cpp_permute(t, heads)
        elif model_arch == "llama" and gg.endswith("attn_k.weight"):
            t = llama_cpp_permute(t, cfg["num_key_value_heads"])
        elif model_arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            t = t + np.float32(1)  # Gemma's (1 + w), in the tensor's dtype
        fmt = quantize(gg) if quantize and t.ndim >= 2 else None
        if fmt:
            kind = gguf.GGMLQuantizationType[fmt]
            w.add_tensor(gg, gguf.quants.quantize(t, kind), raw_dtype=kind)
        elif quantize_ffn and gg.endswith("ffn_up.weight"):
            q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gg, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(gg, t)
    for name, t in (extra_tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _text_model_parameters(w, cfg, model_arch):
    """TextModel.set_gguf_parameters, and llama's / phi3's additions."""
    L, heads, hidden = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["hidden_size"]
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if cfg.get("head_dim") is not None:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if model_arch == "llama":  # LlamaModel
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg.get("head_dim") or hidden // heads)
    elif model_arch == "phi3":  # Phi3MiniModel
        w.add_rope_dimension_count(hidden // heads)
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
        w.add_sliding_window(cfg.get("sliding_window") or 0)


def _gemma_parameters(w, cfg, model_arch):
    """Gemma2Model.set_gguf_parameters (no RoPE base: llama.cpp's default), or
    Gemma3Model's (TextModel's, the global layers' RoPE base, the final cap when set, the
    window unless every layer is global); neither writes a layer pattern, the local RoPE base
    or query_pre_attn_scalar."""
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    if model_arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        return
    rope = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(rope.get("full_attention", rope).get("rope_theta", 1_000_000.0))
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if cfg.get("sliding_window_pattern") != 1:
        w.add_sliding_window(cfg["sliding_window"])
