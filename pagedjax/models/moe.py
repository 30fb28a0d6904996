"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE): the Llama layer (Qwen3's, with per-head
q/k norms) whose MLP is a routed mixture of experts (`models.moe_layer`).

`models.mixtral` and `models.qwen3_moe` are this module with their config readers. Dense
layers among the sparse ones (Qwen3-MoE's `mlp_only_layers` and `decoder_sparse_step`) run
the plain gated MLP; a layer of a stack picks its MLP with `lax.cond` on a per-layer table,
so the stacks stay uniform: a model with both kinds of layer holds zeros for the expert
stacks of its dense layers and for the dense MLP of its sparse layers (`absent_layer_params`).

Params pytree: `models.llama`'s (q_norm / k_norm with `qk_norm`), the dense MLP (gate_proj,
up_proj, down_proj [L, D, F]) only when some layer is dense, and
    layers/router        [L, D, E]       (HF `gate.weight` transposed; replicated)
    layers/experts_gate  [L, E, D, Fe]   layers/experts_up [L, E, D, Fe]
    layers/experts_down  [L, E, Fe, D]
Logical axes of the expert stacks: with `expert_parallel` ("layers", "expert", ...) (whole
experts over "tensor", `sharding.expert`), else ("layers", None, "embed", "moe_mlp") and
("layers", None, "moe_mlp", "embed"): each expert tensor-parallel like the dense MLP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.models import llama
from pagedjax.models.arch_config import DecoderArchConfig
from pagedjax.models.layers import (
    attention,
    gated_mlp,
    layer_window_fn,
    rms_norm,
    rope_inv_freq,
    scan_layers,
)
from pagedjax.models.moe_layer import moe_block, route
from pagedjax.ops.attention import AttentionMetadata
from pagedjax.ops.kv_cache import KVCache
from pagedjax.sharding.expert import expert_parallel

EXPERT_WEIGHTS = ("experts_gate", "experts_up", "experts_down")
_DENSE_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class MoeArchConfig(DecoderArchConfig):
    """A mixture-of-experts checkpoint's hyper-parameters (`DecoderArchConfig` plus):

    Attributes:
        num_experts: E (Mixtral's `num_local_experts`, Qwen3-MoE's `num_experts`).
        num_experts_per_tok: k, the experts each token is routed to.
        moe_intermediate_size: Fe, each expert's MLP size (Mixtral: `intermediate_size`).
        norm_topk_prob: the k routing weights are renormalised to sum to 1.
        sparse_layers: the layers whose MLP is the mixture (the others: a dense MLP of
            `intermediate_size`); None: every layer.
        qk_norm: RMSNorm on each query and key head (Qwen3-MoE).
        expert_parallel: whole experts spread over the tensor axis (set by the engine from
            `enable_expert_parallel`, not read from config.json).
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[int, ...] | None = None
    qk_norm: bool = False
    expert_parallel: bool = False

    def __post_init__(self):
        super().__post_init__()
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"[1, num_experts={self.num_experts}]"
            )

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layers is None or layer in self.sparse_layers

    @property
    def has_dense_layers(self) -> bool:
        return any(not self.is_sparse(i) for i in range(self.num_hidden_layers))


def param_shapes(cfg: MoeArchConfig) -> dict[str, Any]:
    """`llama.param_shapes` with the expert stacks and router; the dense MLP only when a
    layer is dense; q_norm / k_norm [L, H] with `qk_norm`."""
    shapes = llama.param_shapes(cfg)
    L, D, E, Fe = cfg.num_hidden_layers, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    layers = shapes["layers"]
    if not cfg.has_dense_layers:
        for name in _DENSE_MLP:
            del layers[name]
    if cfg.qk_norm:
        layers.update(q_norm=(L, cfg.head_dim), k_norm=(L, cfg.head_dim))
    layers.update(
        router=(L, D, E),
        experts_gate=(L, E, D, Fe),
        experts_up=(L, E, D, Fe),
        experts_down=(L, E, Fe, D),
    )
    return shapes


def param_logical_axes(cfg: MoeArchConfig) -> dict[str, Any]:
    """`llama.param_logical_axes` plus the router (replicated) and the expert stacks: split by
    expert ("expert") under expert parallelism, else by their MLP columns ("moe_mlp")."""
    axes = llama.param_logical_axes(cfg)
    layers = axes["layers"]
    if not cfg.has_dense_layers:
        for name in _DENSE_MLP:
            del layers[name]
    if cfg.qk_norm:
        layers.update(q_norm=("layers", None), k_norm=("layers", None))
    if cfg.expert_parallel:
        into = out = ("layers", "expert", None, None)
    else:
        into, out = ("layers", None, "embed", "moe_mlp"), ("layers", None, "moe_mlp", "embed")
    layers.update(
        router=("layers", "embed", None), experts_gate=into, experts_up=into, experts_down=out
    )
    return axes


def logical_unit_counts(cfg: MoeArchConfig) -> dict[str, int]:
    """`llama.logical_unit_counts` plus "expert" (E) and "moe_mlp" (Fe)."""
    return {
        **llama.logical_unit_counts(cfg),
        "expert": cfg.num_experts,
        "moe_mlp": cfg.moe_intermediate_size,
    }


def absent_layer_params(cfg: MoeArchConfig) -> dict[str, tuple[int, ...]]:
    """Stacked params a checkpoint has no tensor for in some layers (loaded as zeros): the
    expert stacks and router of dense layers, the dense MLP of sparse layers."""
    if not cfg.has_dense_layers:
        return {}
    L = range(cfg.num_hidden_layers)
    dense = tuple(i for i in L if not cfg.is_sparse(i))
    sparse = tuple(i for i in L if cfg.is_sparse(i))
    return {
        **{name: dense for name in (*EXPERT_WEIGHTS, "router")},
        **{name: sparse for name in _DENSE_MLP},
    }


def final_norm(params: dict[str, Any], h: jax.Array, cfg: DecoderArchConfig) -> jax.Array:
    """The norm after the last decoder layer. h: [..., D] -> [..., D]."""
    return rms_norm(h, params["final_norm"], cfg.rms_norm_eps)


def moe_mlp(w: dict[str, Any], x: jax.Array, cfg: MoeArchConfig) -> jax.Array:
    """The routed mixture of experts over normed x [T, D] -> [T, D] (`moe_layer`), its
    experts split over the tensor axis by index under `expert_parallel`."""
    ids, weights = route(x, w["router"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    experts = {name: w[name] for name in EXPERT_WEIGHTS}
    if cfg.expert_parallel:
        return expert_parallel(moe_block, experts, x, ids, weights, activation=cfg.hidden_act)
    return moe_block(experts, x, ids, weights, activation=cfg.hidden_act)


def decoder_layers(
    layers: dict[str, Any],
    kv_cache: KVCache,
    h: jax.Array,
    positions: jax.Array,
    md: AttentionMetadata,
    *,
    cfg: MoeArchConfig,
    attention_backend: str = "xla",
    layer_offset: jax.Array | int = 0,
) -> tuple[jax.Array, KVCache]:
    """As `llama.decoder_layers` (per-head q/k norms with `cfg.qk_norm`), the MLP of each
    layer the routed experts (`moe_mlp`) or, on a dense layer, the gated MLP."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling_dict))
    num_rows = md.query_start_loc[-1]
    eps = cfg.rms_norm_eps
    window = layer_window_fn(cfg, layer_offset)
    sparse_table = jnp.asarray([cfg.is_sparse(i) for i in range(cfg.num_hidden_layers)])

    def mlp(w, x, layer_idx):
        if not cfg.has_dense_layers:
            return moe_mlp(w, x, cfg)
        return jax.lax.cond(
            sparse_table[layer_offset + layer_idx],
            lambda: moe_mlp(w, x, cfg),
            lambda: gated_mlp(w, x, activation=cfg.hidden_act, num_rows=num_rows),
        )

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
            qk_norm_eps=eps if cfg.qk_norm else None,
            attention_backend=attention_backend,
            num_rows=num_rows,
            sliding_window=window(layer_idx),
        )
        h = h + a
        x = rms_norm(h, w["post_attn_norm"], eps)
        return h + mlp(w, x, layer_idx), kv

    return scan_layers(layers, kv_cache, h, layer)
