"""Qwen3 (dense) decoder: the Llama layer with an RMSNorm on each query and key head.

As transformers' `Qwen3Attention`: q and k are projected, each head [H] is RMS-normed with
its own weight (`q_norm`, `k_norm`, shared by the heads of a layer) before RoPE; the q/k/v
projections have a bias only if the config's `attention_bias` says so; `head_dim` is the
config's, independent of hidden_size / num_attention_heads. Everything else (norms, MLP, LM
head, the cache) is `models.llama`'s.

Params pytree: `models.llama`'s, plus
    layers/q_norm  [L, H]      layers/k_norm  [L, H]     (replicated: logical axes
                                                          ("layers", None))
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from pagedjax.models import llama
from pagedjax.models.arch_config import DecoderArchConfig, qwen_sliding_fields
from pagedjax.models.layers import compute_logits as compute_logits
from pagedjax.models.layers import decoder_forward
from pagedjax.models.llama import final_norm as final_norm
from pagedjax.models.llama import logical_unit_counts as logical_unit_counts
from pagedjax.ops.attention import AttentionMetadata
from pagedjax.ops.kv_cache import KVCache

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


@dataclasses.dataclass(frozen=True)
class Qwen3ArchConfig(DecoderArchConfig):
    """A Qwen3 checkpoint's hyper-parameters (`DecoderArchConfig`); the sliding window is
    read only with `use_sliding_window`."""

    ARCHITECTURES = SUPPORTED_ARCHITECTURES
    MODEL_TYPES = {"qwen3": "Qwen3ForCausalLM"}

    @classmethod
    def _hf_fields(cls, d: dict[str, Any], arch: str) -> dict[str, Any]:
        fields = super()._hf_fields(d, arch)
        fields.update(qwen_sliding_fields(d, fields))
        return fields


ArchConfig = Qwen3ArchConfig  # the name `models.registry` expects of every model module


def param_shapes(cfg: DecoderArchConfig) -> dict[str, Any]:
    """`llama.param_shapes` plus the per-head norms q_norm, k_norm [L, H]."""
    shapes = llama.param_shapes(cfg)
    norm = (cfg.num_hidden_layers, cfg.head_dim)
    shapes["layers"].update(q_norm=norm, k_norm=norm)
    return shapes


def param_logical_axes(cfg: DecoderArchConfig) -> dict[str, Any]:
    """`llama.param_logical_axes` plus q_norm, k_norm: ("layers", None), replicated over
    "tensor" (every head uses the whole weight)."""
    axes = llama.param_logical_axes(cfg)
    axes["layers"].update(q_norm=("layers", None), k_norm=("layers", None))
    return axes


def decoder_layers(
    layers: dict[str, Any],
    kv_cache: KVCache,
    h: jax.Array,
    positions: jax.Array,
    md: AttentionMetadata,
    *,
    cfg: DecoderArchConfig,
    attention_backend: str = "xla",
    layer_offset: jax.Array | int = 0,
) -> tuple[jax.Array, KVCache]:
    """As `llama.decoder_layers`, with each query and key head RMS-normed before RoPE."""
    return llama.decoder_layers(
        layers,
        kv_cache,
        h,
        positions,
        md,
        cfg=cfg,
        attention_backend=attention_backend,
        qk_norm=True,
        layer_offset=layer_offset,
    )


forward = decoder_forward(decoder_layers, final_norm)  # the registry's entry point
