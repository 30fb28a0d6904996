"""Llama-family decoder as pure functions of a params pytree (Llama 2/3, SmolLM, Mistral, Qwen2).

The model reads and writes the paged KV cache through `ops.attention`; it never sees a
request, a block manager or a batch size other than the flat token count. Its blocks
(RMSNorm, RoPE, attention, gated MLP, LM head) are `models.layers`'; this module is what is
particular to the family: the config it reads, the params layout, and the pre-norm decoder
layer. Qwen3 (`models.qwen3`) is this layer with per-head q/k norms, Phi-3 (`models.phi3`)
this model with fused checkpoint weights.

Dimension legend (used in every shape comment and einsum string of the model modules):
    T  tokens in the flat, ragged step batch        S  sequences in the step
    D  hidden size (d_model)                        F  MLP intermediate size
    N  query heads          K  KV heads             G  query heads per KV head (N // K)
    H  head dim             V  vocabulary size      L  layers (the stacked leading axis)

Params pytree (every layer weight is stacked on a leading L axis and run by `jax.lax.scan`):
    embed_tokens       [V, D]
    layers/input_norm  [L, D]           layers/post_attn_norm [L, D]
    layers/q_proj      [L, D, N*H]      layers/q_bias         [L, N*H]   (Qwen2 only)
    layers/k_proj      [L, D, K*H]      layers/k_bias         [L, K*H]   (Qwen2 only)
    layers/v_proj      [L, D, K*H]      layers/v_bias         [L, K*H]   (Qwen2 only)
    layers/o_proj      [L, N*H, D]      layers/o_bias         [L, D]     (`o_proj_bias`)
    layers/gate_proj   [L, D, F]        layers/up_proj        [L, D, F]
    layers/down_proj   [L, F, D]
    final_norm         [D]
    lm_head            [D, V]           (absent when the embeddings are tied)
    layers/k_scale     [L] float32      layers/v_scale        [L] float32
                       (a float8 KV cache's per-layer scales from the checkpoint; absent: 1.0)

Weights are stored as [in, out] (the transpose of torch.nn.Linear), so `x @ w` is the layer.
Every linear layer, the LM head included, runs through `ops.linear.linear(x, w)`, which
dispatches on the weight's kind; this model never asks how a weight is stored. With
`quantization`, the seven linear weights of a layer are `ops.quant.QuantizedWeight`s of the
same logical shape. Under `linear_backend="cpu"` the engine holds float32 linear weights as
`ops.cpu_linear.PackedWeight`s of the same logical shape (the native matmul's panel layout,
`cpu_linear.pack_params`), and the LM head as one of [1, D, V] (also with tied embeddings, as
a second copy); the scan reads those stacks in place (`ops.linear.split_layers`). A GGUF file
kept quantized holds the linear weights, the embedding and the LM head as
`ops.gguf_quant.GGUFWeight`s (rows of blocks; the embedding as the tied head's [D, V]).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.models.arch_config import DecoderArchConfig, qwen_sliding_fields
from pagedjax.models.layers import (
    attention,
    decoder_forward,
    gated_mlp,
    layer_window_fn,
    rms_norm,
    rope_inv_freq,
    scan_layers,
)
from pagedjax.models.layers import compute_logits as compute_logits
from pagedjax.ops.attention import AttentionMetadata
from pagedjax.ops.kv_cache import KVCache

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclasses.dataclass(frozen=True)
class LlamaArchConfig(DecoderArchConfig):
    """A Llama, Mistral or Qwen2 checkpoint's hyper-parameters (`DecoderArchConfig`).

    Qwen2's q/k/v projections always have a bias (and its o_proj none), Llama's q/k/v/o
    projections only if the config's `attention_bias` says so;
    Mistral's sliding window is read always, Qwen2's only with `use_sliding_window`.
    """

    ARCHITECTURES = SUPPORTED_ARCHITECTURES
    MODEL_TYPES = {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
    }

    @classmethod
    def _hf_fields(cls, d: dict[str, Any], arch: str) -> dict[str, Any]:
        fields = super()._hf_fields(d, arch)
        if arch == "Qwen2ForCausalLM":
            fields["attention_bias"], fields["o_proj_bias"] = True, False
            fields.update(qwen_sliding_fields(d, fields))
        return fields


ArchConfig = LlamaArchConfig  # the name `models.registry` expects of every model module


def param_shapes(cfg: DecoderArchConfig) -> dict[str, Any]:
    """The expected shape of every parameter, as a pytree of tuples (the legend above)."""
    L, D, F, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    NH, KH = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layers = {
        "input_norm": (L, D),
        "q_proj": (L, D, NH),
        "k_proj": (L, D, KH),
        "v_proj": (L, D, KH),
        "o_proj": (L, NH, D),
        "post_attn_norm": (L, D),
        "gate_proj": (L, D, F),
        "up_proj": (L, D, F),
        "down_proj": (L, F, D),
    }
    if cfg.attention_bias:
        layers.update(q_bias=(L, NH), k_bias=(L, KH), v_bias=(L, KH))
    if cfg.o_proj_bias:
        layers["o_bias"] = (L, D)
    shapes = {"embed_tokens": (V, D), "layers": layers, "final_norm": (D,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (D, V)
    return shapes


def param_logical_axes(cfg: DecoderArchConfig) -> dict[str, Any]:
    """The logical axis names of every parameter (same tree as `param_shapes`).

    Names: "layers" (the stacked L axis), "embed" (D), "q_heads" (N*H columns, cut at head
    boundaries), "kv_heads" (K*H), "mlp" (F), "vocab" (V). `sharding.rules` maps them to
    mesh axes; this model never names a mesh axis.
    """
    layers = {
        "input_norm": ("layers", "embed"),
        "q_proj": ("layers", "embed", "q_heads"),
        "k_proj": ("layers", "embed", "kv_heads"),
        "v_proj": ("layers", "embed", "kv_heads"),
        "o_proj": ("layers", "q_heads", "embed"),
        "post_attn_norm": ("layers", "embed"),
        "gate_proj": ("layers", "embed", "mlp"),
        "up_proj": ("layers", "embed", "mlp"),
        "down_proj": ("layers", "mlp", "embed"),
    }
    if cfg.attention_bias:
        layers.update(
            q_bias=("layers", "q_heads"),
            k_bias=("layers", "kv_heads"),
            v_bias=("layers", "kv_heads"),
        )
    if cfg.o_proj_bias:
        layers["o_bias"] = ("layers", "embed")
    axes = {"embed_tokens": ("vocab", "embed"), "layers": layers, "final_norm": ("embed",)}
    if not cfg.tie_word_embeddings:
        axes["lm_head"] = ("embed", "vocab")
    return axes


def logical_unit_counts(cfg: DecoderArchConfig) -> dict[str, int]:
    """How many indivisible units each logical axis has (a mesh axis must divide it)."""
    return {
        "layers": cfg.num_hidden_layers,
        "q_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "mlp": cfg.intermediate_size,
        "vocab": cfg.vocab_size,
        "embed": cfg.hidden_size,
    }


def final_norm(params: dict[str, Any], h: jax.Array, cfg: DecoderArchConfig) -> jax.Array:
    """The norm after the last decoder layer. h: [..., D] -> [..., D]."""
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps)


def decoder_layers(
    layers: dict[str, Any],
    kv_cache: KVCache,
    h: jax.Array,
    positions: jax.Array,
    md: AttentionMetadata,
    *,
    cfg: DecoderArchConfig,
    attention_backend: str = "xla",
    qk_norm: bool = False,
    layer_offset: jax.Array | int = 0,
) -> tuple[jax.Array, KVCache]:
    """The decoder layers whose weights `layers` holds (a leading axis of any length: all L
    layers, or one pipeline stage's, whose first layer is the model's `layer_offset`), over
    hidden states h [T, D]; layer i of `layers` reads and writes layer i of `kv_cache`
    ([layers, num_blocks, block_size, K, H] each). A layer attends within its window
    (`DecoderArchConfig.layer_windows`).

    Each layer is pre-norm: h += attention(rms_norm(h)); h += gated_mlp(rms_norm(h)).
    qk_norm: RMSNorm each query and key head before RoPE (`layers/q_norm`, `layers/k_norm`
    [L, H]; Qwen3).

    The linear layers multiply only the step's real tokens (`md.query_start_loc[-1]`) where
    the weight's kind can skip the bucket's padding rows (pre-packed weights, `ops.linear`);
    stacks read in place stay out of the scan's sliced inputs (`ops.linear.split_layers`).
    """
    inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict))
    num_rows = md.query_start_loc[-1]
    eps = cfg.rms_norm_eps
    window = layer_window_fn(cfg, layer_offset)

    def layer(w, h, kv, layer_idx):
        a, kv = attention(
            w,
            rms_norm(h, w["input_norm"], eps),
            positions,
            kv,
            layer_idx,
            md,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            inv_freq=inv_freq,
            qk_norm_eps=eps if qk_norm else None,
            attention_backend=attention_backend,
            num_rows=num_rows,
            sliding_window=window(layer_idx),
        )
        h = h + a
        x = rms_norm(h, w["post_attn_norm"], eps)
        return h + gated_mlp(w, x, activation=cfg.hidden_act, num_rows=num_rows), kv

    return scan_layers(layers, kv_cache, h, layer)


forward = decoder_forward(decoder_layers, final_norm)  # the registry's entry point
