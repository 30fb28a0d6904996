"""The Hugging Face checkpoint format's names: each param's tensor name, and config.json.

One table, `HF_LAYER_NAMES`, maps a decoder layer's tensor names (after
`model.layers.<i>.`) to our params; the loader reads float checkpoints through it (and
through `HF_FUSED_LAYER_NAMES`, the fused tensors it splits), `quant_loader` takes its linear
modules (`HF_LINEAR_MODULES`) and `quant_export` writes checkpoints with it.
`hf_config_dict` writes an architecture as a config.json dict. Jax-free.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedjax.models.arch_config import DecoderArchConfig

# Tensor name under `model.layers.<i>.` -> (our layer param, stored [out, in]: transpose).
HF_LAYER_NAMES = {
    "input_layernorm.weight": ("input_norm", False),
    "self_attn.q_proj.weight": ("q_proj", True),
    "self_attn.k_proj.weight": ("k_proj", True),
    "self_attn.v_proj.weight": ("v_proj", True),
    "self_attn.o_proj.weight": ("o_proj", True),
    "self_attn.q_proj.bias": ("q_bias", False),
    "self_attn.k_proj.bias": ("k_bias", False),
    "self_attn.v_proj.bias": ("v_bias", False),
    "self_attn.o_proj.bias": ("o_bias", False),
    "self_attn.q_norm.weight": ("q_norm", False),  # Qwen3
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("post_attn_norm", False),
    "pre_feedforward_layernorm.weight": ("pre_ffn_norm", False),  # Gemma 2/3
    "post_feedforward_layernorm.weight": ("post_ffn_norm", False),
    "mlp.gate_proj.weight": ("gate_proj", True),
    "mlp.up_proj.weight": ("up_proj", True),
    "mlp.down_proj.weight": ("down_proj", True),
}
# Mixture-of-experts tensors under `model.layers.<i>.`: the router (stored [E, D]:
# transposed), and each expert's weights under `<block>.experts.<j>.` (stored [out, in]).
HF_ROUTER_NAMES = ("block_sparse_moe.gate.weight", "mlp.gate.weight")  # Mixtral, Qwen3-MoE
HF_EXPERT_NAMES = {
    "w1.weight": "experts_gate",  # Mixtral
    "w3.weight": "experts_up",
    "w2.weight": "experts_down",
    "gate_proj.weight": "experts_gate",  # Qwen3-MoE
    "up_proj.weight": "experts_up",
    "down_proj.weight": "experts_down",
}
# Fused tensors under `model.layers.<i>.` (Phi-3) -> the layer params their rows split into,
# in order (`hf_checkpoint.split_fused`).
HF_FUSED_LAYER_NAMES = {
    "self_attn.qkv_proj.weight": ("q_proj", "k_proj", "v_proj"),
    "mlp.gate_up_proj.weight": ("gate_proj", "up_proj"),
}
# The decoder's linear modules, "self_attn.q_proj" -> "q_proj" (their weights are transposed).
HF_LINEAR_MODULES = {
    name.removesuffix(".weight"): ours
    for name, (ours, transpose) in HF_LAYER_NAMES.items()
    if transpose
}
# Our layer param -> its tensor name under `model.layers.<i>.`.
HF_TENSOR_NAMES = {ours: name for name, (ours, _) in HF_LAYER_NAMES.items()}


def hf_config_dict(cfg: DecoderArchConfig, dtype: str) -> dict[str, Any]:
    """A Hugging Face style config.json dict of an architecture."""
    return {
        "architectures": [cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.hidden_act,
        "rope_parameters": {
            "rope_type": "default",
            **cfg.rope_scaling_dict,
            "rope_theta": cfg.rope_theta,
        },
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "max_position_embeddings": cfg.max_position_embeddings,
        "sliding_window": cfg.sliding_window,
        "use_sliding_window": bool(cfg.sliding_window),
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids),
        "dtype": dtype,
        **(
            {
                "layer_types": [
                    "sliding_attention" if w else "full_attention" for w in cfg.layer_windows()
                ]
            }
            if cfg.sliding_window
            else {}
        ),
        **cfg.hf_config_extras(),
    }
