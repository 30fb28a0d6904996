"""Gemma 2 and Gemma 3 (text) decoders, as transformers' `Gemma2ForCausalLM` and
`Gemma3ForCausalLM`.

What differs from `models.llama`'s layer:
    norms        Gemma's RMSNorm, which scales by (1 + w) in float32 (`layers.rms_norm` with
                 `offset=True`), four per layer: input_layernorm before attention,
                 post_attention_layernorm on the attention output (before the residual add),
                 pre_feedforward_layernorm before the MLP, post_feedforward_layernorm on its
                 output; the final norm too.
    embeddings   scaled by sqrt(D) in the embedding dtype (transformers' normalizer, a
                 float32 scalar cast to that dtype). `decoder_layers` applies it at the
                 model's first layer (`layer_offset == 0`), so that a caller that looks the
                 embedding up itself (the pipeline) gets it as well.
    MLP          GeGLU: `hidden_activation` (tanh-approximate GELU).
    attention    softmax scale query_pre_attn_scalar ** -0.5; Gemma 2's attention-logit
                 soft-cap (`attn_logit_softcapping`; transformers' Gemma 3 applies none, so
                 neither does this); sliding-window layers interleaved with global ones
                 (`layer_types`; without it transformers' default: Gemma 2 every other layer
                 from layer 0, Gemma 3 five of every six, `sliding_window_pattern`); Gemma 3's
                 per-head q/k RMSNorm (1 + w) before RoPE, and a RoPE of its own for the
                 sliding layers (`rope_local_base_freq`: the per-layer inverse frequencies
                 are a table picked by layer); rope_scaling applies to the global layers.
    LM head      tied embeddings by default; `final_logit_softcapping`: logits =
                 cap * tanh(logits / cap) (`layers.compute_logits` with the config).

Not supported (refused with a ValueError naming it): `Gemma3ForConditionalGeneration` (the
multimodal checkpoints: vision tower, and the text model's tensors under other names) and
`use_bidirectional_attention` (EmbeddingGemma).

Params pytree: `models.llama`'s (layers/post_attn_norm is the norm of the attention output
here), plus
    layers/pre_ffn_norm  [L, D]       layers/post_ffn_norm  [L, D]
    layers/q_norm        [L, H]       layers/k_norm         [L, H]      (Gemma 3)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.models import llama
from pagedjax.models.arch_config import DecoderArchConfig, hf_rope, hf_rope_dict
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
from pagedjax.models.llama import logical_unit_counts as logical_unit_counts
from pagedjax.ops.attention import AttentionMetadata
from pagedjax.ops.kv_cache import KVCache

GEMMA2, GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"
SUPPORTED_ARCHITECTURES = (GEMMA2, GEMMA3)
# Architectures of the family the engine does not run -> why (`registry.get_model` says it).
REFUSED_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": (
        "the multimodal Gemma 3 checkpoints (vision tower and projector, the text model's "
        "tensors under language_model.*) are not supported; only the text-only "
        "Gemma3ForCausalLM checkpoints (e.g. gemma-3-1b, gemma-3-270m)"
    ),
}
_LAYER_TYPES = ("sliding_attention", "full_attention")
# transformers' class defaults of what a config.json may leave out (Gemma2Config,
# Gemma3TextConfig): an absent key means the default, not "none".
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    GEMMA2: dict(
        head_dim=256,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        max_position_embeddings=8192,
        bos_token_id=2,
        eos_token_id=1,
    ),
    GEMMA3: dict(
        head_dim=256,
        rms_norm_eps=1e-6,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        final_logit_softcapping=None,
        max_position_embeddings=131072,
        bos_token_id=2,
        eos_token_id=1,
    ),
}


@dataclasses.dataclass(frozen=True)
class GemmaArchConfig(DecoderArchConfig):
    """A Gemma 2 or Gemma 3 (text) checkpoint's hyper-parameters (`DecoderArchConfig`).

    Attributes (beyond the shared ones):
        query_pre_attn_scalar: the softmax scale is its -1/2 power.
        attn_logit_softcap: Gemma 2's attention-logit soft-cap, or None.
        rope_local_theta, rope_local_scaling: Gemma 3's RoPE of the sliding-window layers
            (`rope_theta` / `rope_scaling` are the global layers'); None: the global one.
    """

    ARCHITECTURES = SUPPORTED_ARCHITECTURES
    MODEL_TYPES = {
        "gemma2": GEMMA2,
        "gemma3_text": GEMMA3,
        "gemma3": "Gemma3ForConditionalGeneration",  # refused, by name
    }

    query_pre_attn_scalar: float = 256.0
    attn_logit_softcap: float | None = None
    rope_local_theta: float | None = None
    rope_local_scaling: tuple[tuple[str, Any], ...] | None = None

    @property
    def qk_norm(self) -> bool:
        """Gemma 3 RMS-norms each query and key head (q_norm, k_norm)."""
        return self.architecture == GEMMA3

    @classmethod
    def _hf_fields(cls, d: dict[str, Any], arch: str) -> dict[str, Any]:
        if d.get("use_bidirectional_attention"):
            raise ValueError(
                "use_bidirectional_attention (EmbeddingGemma: attention without a causal "
                "mask) is not supported"
            )
        d = {**_HF_DEFAULTS[arch], **d}
        fields = super()._hf_fields(d, arch)
        L = fields["num_hidden_layers"]
        fields.update(
            head_dim=d["head_dim"],
            rms_norm_eps=d["rms_norm_eps"],
            hidden_act=d["hidden_activation"],
            tie_word_embeddings=bool(d["tie_word_embeddings"]),
            query_pre_attn_scalar=float(d["query_pre_attn_scalar"]),
            final_logit_softcap=_cap(d["final_logit_softcapping"]),
            attn_logit_softcap=_cap(d["attn_logit_softcapping"]) if arch == GEMMA2 else None,
        )
        types = d.get("layer_types")
        if types is None:  # transformers' default pattern
            pattern = 2 if arch == GEMMA2 else d.get("sliding_window_pattern") or 6
            types = [_LAYER_TYPES[(i + 1) % pattern == 0] for i in range(L)]
        if len(types) != L or any(t not in _LAYER_TYPES for t in types):
            raise ValueError(
                f"layer_types must name {L} layers, each one of {_LAYER_TYPES}; got {types!r}"
            )
        sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        window = d["sliding_window"] if sliding else None
        fields.update(sliding_window=window or None, sliding_layers=sliding if window else None)
        if arch == GEMMA3:
            fields.update(_gemma3_rope(d))
        return fields

    def hf_config_extras(self) -> dict[str, Any]:
        types = ["sliding_attention" if w else "full_attention" for w in self.layer_windows()]
        extras = {
            "hidden_activation": self.hidden_act,
            "query_pre_attn_scalar": self.query_pre_attn_scalar,
            "final_logit_softcapping": self.final_logit_softcap,
            "attn_logit_softcapping": self.attn_logit_softcap,
            "sliding_window": self.sliding_window,
            "layer_types": types,
        }
        if self.rope_local_theta is not None:
            extras["rope_parameters"] = {
                "full_attention": _rope_params(self.rope_theta, self.rope_scaling),
                "sliding_attention": _rope_params(self.rope_local_theta, self.rope_local_scaling),
            }
        return extras


ArchConfig = GemmaArchConfig  # the name `models.registry` expects of every model module


def _cap(value) -> float | None:
    return float(value) if value else None


def _rope_params(theta: float, scaling) -> dict[str, Any]:
    return {"rope_type": "default", **dict(scaling or ()), "rope_theta": theta}


def _gemma3_rope(d: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's two RoPEs: transformers 5 nests them in `rope_parameters` by layer type;
    4.x configs have `rope_theta` and `rope_scaling` (global layers) and
    `rope_local_base_freq` (sliding layers)."""
    rope = d.get("rope_parameters") or {}
    if "full_attention" in rope or "sliding_attention" in rope:
        full = dict(rope.get("full_attention") or {})
        local = dict(rope.get("sliding_attention") or {})
    else:
        full, local = hf_rope_dict(d), {}
    full.setdefault("rope_theta", d.get("rope_theta") or 1_000_000.0)
    local.setdefault("rope_theta", d.get("rope_local_base_freq") or 10_000.0)
    theta, scaling = hf_rope({"rope_parameters": full})
    local_theta, local_scaling = hf_rope({"rope_parameters": local})
    return dict(
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        rope_local_scaling=local_scaling,
    )


def param_shapes(cfg: GemmaArchConfig) -> dict[str, Any]:
    """`llama.param_shapes` plus pre_ffn_norm, post_ffn_norm [L, D] (and Gemma 3's q_norm,
    k_norm [L, H])."""
    shapes = llama.param_shapes(cfg)
    L, D = cfg.num_hidden_layers, cfg.hidden_size
    shapes["layers"].update(pre_ffn_norm=(L, D), post_ffn_norm=(L, D))
    if cfg.qk_norm:
        shapes["layers"].update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    return shapes


def param_logical_axes(cfg: GemmaArchConfig) -> dict[str, Any]:
    """`llama.param_logical_axes` plus the norms: ("layers", "embed"), and q_norm, k_norm
    ("layers", None) (every head uses the whole weight)."""
    axes = llama.param_logical_axes(cfg)
    axes["layers"].update(pre_ffn_norm=("layers", "embed"), post_ffn_norm=("layers", "embed"))
    if cfg.qk_norm:
        axes["layers"].update(q_norm=("layers", None), k_norm=("layers", None))
    return axes


def final_norm(params: dict[str, Any], h: jax.Array, cfg: GemmaArchConfig) -> jax.Array:
    """Gemma's RMSNorm (1 + w) after the last decoder layer. h: [..., D] -> [..., D]."""
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps, offset=True)


def embedding_scale(h: jax.Array, cfg: GemmaArchConfig) -> jax.Array:
    """h * sqrt(D), the factor a float32 scalar cast to h's dtype (as transformers)."""
    return h * jnp.asarray(np.float32(cfg.hidden_size**0.5)).astype(h.dtype)


def _layer_inv_freq_fn(cfg: GemmaArchConfig, layer_offset: jax.Array | int):
    """`fn(layer_idx)` -> the RoPE inverse frequencies [H // 2] of local layer `layer_idx`:
    the local ones on sliding-window layers when the config has them (Gemma 3), else the
    global ones; a constant when every layer has the same, else read from an [L, H // 2]
    table at `layer_offset + layer_idx`."""
    glob = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict)
    sliding = [w > 0 for w in cfg.layer_windows()]
    if cfg.rope_local_theta is None or not any(sliding):
        return lambda layer_idx: jnp.asarray(glob)
    local = rope_inv_freq(cfg.head_dim, cfg.rope_local_theta, dict(cfg.rope_local_scaling or ()))
    if all(sliding):
        return lambda layer_idx: jnp.asarray(local)
    table = jnp.asarray(np.stack([local if s else glob for s in sliding]))  # [L, H/2]
    return lambda layer_idx: table[layer_offset + layer_idx]


def decoder_layers(
    layers: dict[str, Any],
    kv_cache: KVCache,
    h: jax.Array,
    positions: jax.Array,
    md: AttentionMetadata,
    *,
    cfg: GemmaArchConfig,
    attention_backend: str = "xla",
    layer_offset: jax.Array | int = 0,
) -> tuple[jax.Array, KVCache]:
    """As `llama.decoder_layers` (same arguments and results), with Gemma's layer:

        h += post_attn_norm(attention(input_norm(h)))
        h += post_ffn_norm(gated_mlp(pre_ffn_norm(h)))

    every norm Gemma's (1 + w); h [T, D] is the looked-up embedding when the stack starts at
    the model's first layer (`layer_offset` 0, possibly traced), which scales it by sqrt(D).
    """
    if isinstance(layer_offset, int):
        h = embedding_scale(h, cfg) if layer_offset == 0 else h
    else:
        h = jnp.where(layer_offset == 0, embedding_scale(h, cfg), h)
    num_rows = md.query_start_loc[-1]
    eps = cfg.rms_norm_eps
    window = layer_window_fn(cfg, layer_offset)
    inv_freq = _layer_inv_freq_fn(cfg, layer_offset)

    def norm(x, weight):
        return rms_norm(x, weight, eps, offset=True)

    def layer(w, h, kv, layer_idx):
        a, kv = attention(
            w,
            norm(h, w["input_norm"]),
            positions,
            kv,
            layer_idx,
            md,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            inv_freq=inv_freq(layer_idx),
            qk_norm_eps=eps if cfg.qk_norm else None,
            qk_norm_offset=True,
            sm_scale=cfg.query_pre_attn_scalar**-0.5,
            attention_backend=attention_backend,
            num_rows=num_rows,
            sliding_window=window(layer_idx),
            logit_soft_cap=cfg.attn_logit_softcap,
        )
        h = h + norm(a, w["post_attn_norm"])
        m = gated_mlp(w, norm(h, w["pre_ffn_norm"]), activation=cfg.hidden_act, num_rows=num_rows)
        return h + norm(m, w["post_ffn_norm"]), kv

    return scan_layers(layers, kv_cache, h, layer)


forward = decoder_forward(decoder_layers, final_norm)  # the registry's entry point
